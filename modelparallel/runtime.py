"""The one runtime handle: process group, device, the ("dp", "tp") mesh and SMP's rank API.

``init`` is the only place that reads the launcher's environment. Everything inside the library
takes the mesh (or this handle) as an argument; the module-level ``_RUNTIME`` exists only so the
SMP-style facade (``smp.tp_rank()``, ``smp.get_tp_process_group()``...) has something to read.

Rank vocabulary. Tensor-parallel ranks share one batch, so the data-parallel group is the set of
ranks holding the same tensor-parallel shard: ``dp_size == rdp_size == world / tp``. With pipeline
parallelism fixed at 1, the model-parallel group is the tensor-parallel group.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .config import Config, build_config, without_effect

logger = logging.getLogger("modelparallel")

WORLD, DP_GROUP, TP_GROUP, RDP_GROUP, MP_GROUP = "world", "dp", "tp", "rdp", "mp"

_RUNTIME: Runtime | None = None


@dataclass
class Runtime:
    """Everything a distributed job needs to know about where it runs."""

    config: Config
    mesh: DeviceMesh
    device: torch.device
    models: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)
    pending_resume: Any = None

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group for WORLD, DP_GROUP, RDP_GROUP, TP_GROUP or MP_GROUP."""
        if name == WORLD:
            return dist.group.WORLD
        if name in (DP_GROUP, RDP_GROUP):
            return self.mesh.get_group("dp")
        if name in (TP_GROUP, MP_GROUP):
            return self.mesh.get_group("tp")
        raise ValueError(f"unknown group {name!r}; use one of world, dp, rdp, tp, mp")

    def owned_parameter_ids(self) -> set[int]:
        """ids of every parameter of this runtime's ``DistributedModel``s (one pass, for set lookups)."""
        return {id(p) for m in self.models for p in m.module.parameters()}


def _device() -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _ensure_process_group(timeout: timedelta) -> None:
    """Join the launcher's process group, or make a world of one when run as a plain process."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def mesh_layout(config: Config) -> torch.Tensor:
    """Global ranks arranged as a [dp, tp] grid according to ``placement_strategy``.

    The strategy is an order of the letters D, P, T, slowest-varying first: "cluster" is "DPT"
    (a TP group on consecutive ranks, so on one node), "spread" is "TPD" (TP ranks strided).
    """
    order = {"cluster": "DPT", "spread": "TPD"}.get(config.placement_strategy,
                                                    config.placement_strategy.upper())
    sizes = {"D": config.dp_degree, "P": config.pipeline_parallel_degree,
             "T": config.tensor_parallel_degree}
    grid = torch.arange(config.world_size).reshape([sizes[c] for c in order])
    grid = grid.permute([order.index(c) for c in "DPT"])
    return grid.reshape(config.dp_degree, config.tensor_parallel_degree)


def _setup_logging(global_rank: int) -> None:
    """Show the library's INFO lines (what stays replicated, the layout) unless the user has
    configured the ``modelparallel`` logger already."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[modelparallel rank {global_rank}] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def init(config: dict | str | None = None, *, timeout_s: float = 300.0) -> Runtime:
    """Start (or restart) the distributed runtime.

    Args:
        config: a dict, a JSON file path, or None to read ``MODELPARALLEL_CONFIG``.
        timeout_s: collective timeout; a rank that fails makes the others fail within it.

    Returns:
        The runtime handle (also reachable through the module-level rank API).

    Raises:
        ValueError: for any invalid config, before any collective runs.
    """
    global _RUNTIME
    world = int(os.environ.get("WORLD_SIZE", 1)) if not dist.is_initialized() else dist.get_world_size()
    cfg = build_config(config, world)
    _ensure_process_group(timedelta(seconds=timeout_s))
    device = _device()
    mesh = DeviceMesh(device.type, mesh_layout(cfg), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(cfg.random_seed)
    random.seed(cfg.random_seed)
    _RUNTIME = Runtime(config=cfg, mesh=mesh, device=device)
    _setup_logging(dist.get_rank())
    if dist.get_rank() == 0:
        logger.info("world %d = rdp %d x tp %d on %s", cfg.world_size, cfg.dp_degree,
                    cfg.tensor_parallel_degree, device.type)
        _log_without_effect(without_effect(config))
    return _RUNTIME


_LOGGED_KEYS: set[str] = set()


def _log_without_effect(keys: dict[str, Any]) -> None:
    """Say once per process which given keys tune SageMaker machinery that does not exist here."""
    fresh = {k: v for k, v in keys.items() if k not in _LOGGED_KEYS}
    if fresh:
        _LOGGED_KEYS.update(fresh)
        logger.info("config keys accepted with no effect here: %s",
                    ", ".join(f"{k}={v!r}" for k, v in sorted(fresh.items())))


def current() -> Runtime:
    """The runtime started by ``init``; raises if there is none."""
    if _RUNTIME is None:
        raise RuntimeError("modelparallel is not initialized: call modelparallel.init() first")
    return _RUNTIME


def is_initialized() -> bool:
    return _RUNTIME is not None


# ---- SMP's rank API -------------------------------------------------------------------------

def rank() -> int:
    current()
    return dist.get_rank()


def size() -> int:
    return current().config.world_size


def local_rank() -> int:
    current()
    return int(os.environ.get("LOCAL_RANK", 0))


def local_size() -> int:
    current()
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def tp_rank() -> int:
    return current().mesh.get_local_rank("tp")


def tp_size() -> int:
    return current().config.tensor_parallel_degree


def dp_rank() -> int:
    return current().mesh.get_local_rank("dp")


def dp_size() -> int:
    return current().config.dp_degree


rdp_rank, rdp_size = dp_rank, dp_size
mp_rank, mp_size = tp_rank, tp_size


def pp_rank() -> int:
    current()
    return 0


def pp_size() -> int:
    return current().config.pipeline_parallel_degree


def get_world_process_group() -> dist.ProcessGroup:
    return current().group(WORLD)


def get_tp_process_group() -> dist.ProcessGroup:
    return current().group(TP_GROUP)


def get_dp_process_group() -> dist.ProcessGroup:
    return current().group(DP_GROUP)


def get_rdp_process_group() -> dist.ProcessGroup:
    return current().group(RDP_GROUP)


def get_mp_process_group() -> dist.ProcessGroup:
    return current().group(MP_GROUP)


def barrier(group: str = WORLD) -> None:
    """Wait until every rank of ``group`` arrives."""
    dist.barrier(group=current().group(group))


def broadcast(obj: Any, group: str = WORLD, src_rank: int = 0) -> Any:
    """Send a picklable object from the group's ``src_rank`` (a rank within the group) to all of it.

    Every rank of the group calls this; every rank gets the object back.
    """
    pg = current().group(group)
    box = [obj]
    dist.broadcast_object_list(box, group_src=src_rank, group=pg)
    return box[0]
