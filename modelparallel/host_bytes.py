"""``host_bytes``: a contiguous CPU tensor's memory as a writable buffer, in place.

Files are read into and written from tensors through Python's buffer protocol, which torch
tensors do not offer themselves. ``Tensor.numpy()`` would, but it marks the tensor's storage as
never resizable again: reading a model's weights into it, or saving them, would then change what
training may do with them (FSDP frees and regrows storages by resizing them). A ctypes view of
the same bytes changes nothing; the caller holds the tensor while the view is in use.
"""

from __future__ import annotations

import ctypes

import torch


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t`` (any dtype), readable and writable in place.

    Raises:
        ValueError: ``t`` not contiguous or not in host memory.
    """
    if not t.is_cpu or not t.is_contiguous():  # (``is_cpu``: a fifth of the time of asking the device)
        where = "a non-contiguous" if t.device.type == "cpu" else f"a {t.device.type}"
        raise ValueError(f"host_bytes needs a contiguous CPU tensor, got {where} one")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")
