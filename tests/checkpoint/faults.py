"""I/O fault injection for the checkpoint tests: count every file-system call a process makes on
files under one directory, and make the N-th fail (SQLite's way: every N, not hand-picked cases).

``inject(root, fail_at, kind)`` wraps, for its duration, the calls the checkpoint layer, DCP, the
safetensors and torch readers and writers go through: ``os`` (open, read, pread, preadv, write,
pwrite, fsync, ftruncate, rename, replace, unlink, mkdir, rmdir, stat, lstat, fstat, scandir,
listdir), ``io.open`` / ``builtins.open`` and the read / write / flush / readinto / truncate of the
file objects they return, ``mmap.mmap``, ``torch.save`` / ``torch.load``, ``safetensors``'
``safe_open`` and ``save_file``, and the atomic directory exchange. Only calls on paths under
``root`` (or on descriptors and file objects opened there) are counted, so imports and logging
do not shift the numbering.

The failing call gets a fault that fits it: a read fails with EIO or returns fewer bytes than
asked (a short read, which correct code retries); a write fails with ENOSPC or writes fewer
bytes (a short write: ``os.write`` / ``os.pwrite``); opening, renaming, deleting fails with
EACCES (PermissionError) or EIO. ``kind`` picks among them.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import mmap
import os
import threading

READS = {"read", "pread", "preadv", "stat", "lstat", "fstat", "scandir", "listdir", "mmap", "torch.load",
         "safe_open", "f.read", "f.readinto"}
WRITES = {"write", "pwrite", "fsync", "ftruncate", "torch.save", "save_file", "f.write", "f.flush", "f.truncate"}
SHORT = {"read", "pread", "preadv", "write", "pwrite"}
KINDS = ("error", "other", "short")


class Fault(OSError):
    """Marks an injected error (tests tell it from a real one)."""


class Counter:
    """Call numbering of one injection window (thread-safe: checksums fsync in a thread)."""

    def __init__(self, root: str, fail_at: int, kind: str, only: set[str] | None = None):
        self.root, self.fail_at, self.kind = os.path.realpath(root), fail_at, kind
        self.only = only
        self.count, self.lock = 0, threading.Lock()
        self.fds: dict[int, str] = {}
        self.fired: str | None = None

    def under(self, path) -> str | None:
        if isinstance(path, int):
            return self.fds.get(path)
        try:
            p = os.fspath(path)
        except TypeError:
            return None
        p = p.decode() if isinstance(p, bytes) else p
        p = os.path.abspath(p)
        return p if p == self.root or p.startswith(self.root + os.sep) else None

    def hit(self, name: str, where: str) -> str | None:
        """The fault to inject into this call (None: run it)."""
        if self.only is not None and name not in self.only:
            return None
        with self.lock:
            self.count += 1
            if self.count != self.fail_at:
                return None
            options = ["short"] if name in SHORT else []
            kind = self.kind if self.kind != "short" or options else "error"
            self.fired = f"{name} {where} ({kind})"
            return kind


_ON_DESCRIPTORS = {"write", "pwrite", "read", "pread", "preadv", "fsync", "fstat", "ftruncate", "mmap"}


def _error(name: str, kind: str, where: str | None) -> OSError:
    """The error a real system gives such a call (calls on a descriptor name no file)."""
    if name in READS:
        code = errno.EIO
    elif name in WRITES:
        code = errno.ENOSPC if kind == "error" else errno.EIO
    else:
        code = errno.EACCES if kind == "error" else errno.EIO
    if where and name not in _ON_DESCRIPTORS:
        return Fault(code, os.strerror(code), where)
    return Fault(code, os.strerror(code))


def _dir_fd_path(counter: Counter, path, kwargs) -> str | None:
    fd = kwargs.get("dir_fd")
    if fd is not None and isinstance(path, (str, bytes)) and not os.path.isabs(path):
        base = counter.fds.get(fd)
        return os.path.join(base, os.fsdecode(path)) if base else None
    return counter.under(path)


def _wrap(counter: Counter, name: str, real):
    def call(*args, **kwargs):
        target = args[0] if args else kwargs.get("path", kwargs.get("fd"))
        where = _dir_fd_path(counter, target, kwargs) if name in ("open", "stat", "lstat", "mkdir", "unlink", "rmdir",
                                                                  "rename", "replace") else counter.under(target)
        if where is None:
            return real(*args, **kwargs)
        kind = counter.hit(name, where)
        if kind == "short" and name in SHORT:
            return _short(name, real, args, kwargs)
        if kind is not None:
            raise _error(name, kind, where)
        out = real(*args, **kwargs)
        if name == "open" and isinstance(out, int):
            counter.fds[out] = where
        return out

    return call


def _short(name: str, real, args, kwargs):
    """The call done for part of what was asked (at least one byte)."""
    if name in ("write", "pwrite"):
        data = memoryview(args[1]).cast("B")
        return real(args[0], data[:max(1, len(data) // 2)], *args[2:])
    if name in ("read", "pread"):
        n = max(1, args[1] // 2)
        return real(args[0], n, *args[2:])
    buffers = args[1]
    first = memoryview(buffers[0]).cast("B") if buffers else memoryview(b"")
    return real(args[0], [first[:max(1, len(first) // 2)]], *args[2:])


class _File:
    """A file object whose reads and writes are counted and may fail."""

    def __init__(self, f, counter: Counter, where: str):
        self._f, self._counter, self._where = f, counter, where

    def _check(self, name: str) -> None:
        kind = self._counter.hit(name, self._where)
        if kind is not None:
            raise _error(name, kind, None)

    def write(self, data):
        self._check("f.write")
        return self._f.write(data)

    def read(self, *args):
        self._check("f.read")
        return self._f.read(*args)

    def readinto(self, b):
        self._check("f.readinto")
        return self._f.readinto(b)

    def flush(self):
        self._check("f.flush")
        return self._f.flush()

    def truncate(self, *args):
        self._check("f.truncate")
        return self._f.truncate(*args)

    def _forget(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._counter.fds.pop(self._f.fileno(), None)

    def close(self):
        self._forget()
        return self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __iter__(self):
        return iter(self._f)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._forget()
        return self._f.__exit__(*exc)


def _wrap_open(counter: Counter, real):
    def fake_open(file, *args, **kwargs):
        where = counter.under(file) if not isinstance(file, int) else None
        if where is None:
            return real(file, *args, **kwargs)
        kind = counter.hit("io.open", where)
        if kind is not None:
            raise _error("io.open", kind, where)
        f = real(file, *args, **kwargs)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            counter.fds[f.fileno()] = where  # its descriptor's calls (fsync, mmap) count too
        return _File(f, counter, where)

    return fake_open


_OS_CALLS = ("open", "read", "pread", "preadv", "write", "pwrite", "fsync", "ftruncate", "rename", "replace", "unlink",
             "mkdir", "rmdir", "stat", "lstat", "fstat", "scandir", "listdir")


@contextlib.contextmanager
def inject(root, fail_at: int = 0, kind: str = "error", only: set[str] | None = None):
    """Count calls on files under ``root``; the ``fail_at``-th (1-based; 0: none) fails with a
    fault of ``kind`` ("error", "other", "short"). ``only``: count only these calls (e.g.
    ``WRITES``: the N-th write). Yields the ``Counter`` (``count``: calls seen; ``fired``: which
    call failed)."""
    import safetensors
    import safetensors.torch
    import torch

    from modelparallel.checkpoint.safety import commit
    from modelparallel.materialize import safetensors_io

    counter = Counter(str(root), fail_at, kind, only)
    saved = []

    def patch(owner, attr, new):
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    for name in _OS_CALLS:
        patch(os, name, _wrap(counter, name, getattr(os, name)))
    real_close = os.close

    def close(fd):
        counter.fds.pop(fd, None)
        return real_close(fd)

    patch(os, "close", close)
    fake_open = _wrap_open(counter, io.open)
    patch(io, "open", fake_open)
    patch(builtins, "open", fake_open)
    patch(mmap, "mmap", _wrap(counter, "mmap", mmap.mmap))
    patch(torch, "save", _wrap_second(counter, "torch.save", torch.save))
    patch(torch, "load", _wrap(counter, "torch.load", torch.load))
    patch(safetensors, "safe_open", _wrap(counter, "safe_open", safetensors.safe_open))
    patch(safetensors_io, "safe_open", _wrap(counter, "safe_open", safetensors_io.safe_open))
    patch(safetensors.torch, "save_file", _wrap_second(counter, "save_file", safetensors.torch.save_file))
    patch(commit, "_exchange", _wrap(counter, "rename", commit._exchange))
    try:
        yield counter
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


def _wrap_second(counter: Counter, name: str, real):
    """``torch.save(obj, f)`` / ``save_file(tensors, f)``: the file is the second argument."""
    def call(obj, f, *args, **kwargs):
        where = counter.under(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "_where", None)
        if where is not None and (kind := counter.hit(name, where)) is not None:
            raise _error(name, kind, where)
        return real(obj, f, *args, **kwargs)

    return call
