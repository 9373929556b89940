"""Checksums of written files: size and CRC32 (the manifest's entries), fsync overlapped with the
hashing, and each rank's share of the files when all ranks verify a checkpoint together.

Kept apart from ``commit`` because computing and checking a file's record is work on file
contents, while ``commit`` moves whole directories; both saving and loading use these.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
from pathlib import Path

from .crc import crc32
from .durable import named
from .files import check_file
from .manifest import MANIFEST

_DCP_DATA = re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$")


def file_checksum(path: str | Path, fsync: bool = False) -> dict:
    """``{"size", "crc32"}`` of a file. With ``fsync`` the file is also flushed to disk, in a
    thread while the CRC is computed: the disk write-back and the CPU work overlap (the CRC releases
    the GIL), so checksumming a just-written checkpoint costs about what its fsync costs alone.
    An error names ``path``."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            sync = _Background(os.fsync, f.fileno()) if fsync else None
            crc = 0
            try:
                if size:
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:  # no copies: ~2x read()
                        crc = crc32(view)
            finally:
                if sync is not None:
                    sync.join()
    except OSError as e:
        raise named(e, path) from None
    return {"size": size, "crc32": f"{crc:08x}"}


def synced_checksum(path: str | Path, known: dict | None) -> dict:
    """``file_checksum(path, fsync=True)``, without reading the file again when ``known`` holds
    the size and CRC32 computed while it was written and the file still has that size: then it
    is only fsynced. An error names ``path``."""
    if known is None:
        return file_checksum(path, fsync=True)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size != known["size"]:
                return file_checksum(path, fsync=True)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise named(e, path) from None
    return {"size": known["size"], "crc32": known["crc32"]}


class _Background(threading.Thread):
    """Run ``fn(*args)`` in a thread; ``join`` re-raises its exception (an fsync EIO must fail the save)."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.error = fn, args, None
        self.start()

    def run(self) -> None:
        try:
            self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - handed to the joining thread
            self.error = e

    def join(self, timeout=None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def data_files(root: str | Path) -> list[str]:
    """Every file under ``root`` except the manifest, as sorted relative POSIX paths."""
    root = Path(root)
    files = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(f for f in files if f != MANIFEST)


def share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """This rank's share of the files when ``world`` ranks split the reading. A DCP data file
    (``__{r}_{n}.distcp``) goes to the rank that wrote it, which is also the rank that loads it
    when the layout is unchanged: on several nodes each one hashes (and fsyncs) what is in its
    own page cache. The rest go largest first to the least-loaded rank, so ranks read about the
    same number of bytes."""
    loads, owner = [0] * world, {}
    for name, size in sizes.items():
        m = _DCP_DATA.search(name)
        if m and int(m.group(1)) < world:
            owner[name] = int(m.group(1))
            loads[owner[name]] += size
    for name in sorted(set(sizes) - set(owner), key=lambda n: (-sizes[n], n)):
        owner[name] = loads.index(min(loads))
        loads[owner[name]] += sizes[name]
    return sorted(n for n, r in owner.items() if r == rank)


def verify_file(root: str | Path, rel: str, expected: dict) -> str | None:
    """None if ``root/rel`` is a regular file inside ``root`` (no symlink on the way) with the
    recorded size and CRC32, else a message naming the file."""
    return check_file(root, rel, expected)

