"""How a load opens a checkpoint's files, and reads them verified.

Whoever can write into a checkpoint directory controls every name a loader reads: DCP's metadata
names its data files, a manifest names everything. So every file a load opens is

1. listed in the checkpoint's manifest (``CheckpointFiles.entry``): nothing else loads, and a
   name the manifest does not hold (``../x``, an absolute path) is refused;
2. reached from the checkpoint directory through real directories only: each component is opened
   relative to its parent with ``O_NOFOLLOW`` (``open_inside``), so no symlink is ever followed,
   whatever changes between a check and the open;
3. opened once (``safe_open.open_file``), non-blocking, so even a FIFO's open returns at once,
   and checked on that descriptor: a regular file (a FIFO would block the read forever, a
   device never end) with one link (a hard link reaches a file elsewhere);
4. read front to back through that one descriptor while its CRC32 is computed
   (``VerifiedReader``): what is checked is exactly what is used. A file truncated, replaced or
   flipped after an earlier check is caught by the read itself, and the caller uses the bytes
   only after ``finish`` compared size and checksum.

Errors name the file first: ``{path}: CRC32 ..., manifest says ... (corrupted)``.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Executor
from pathlib import Path

from .failure import CheckpointError
from .safe_open import (UnsafeCheckpointError, read_capped, fstat, open_file, open_inside,  # noqa: F401
                        plain_parts, read_from, read_path, read_small)

from .crc import crc32, read_hashed

CHUNK = 1 << 22
"""Bytes per read when a file is only checksummed (skipped regions, verification)."""


class CorruptFileError(CheckpointError, ValueError):
    """A checkpoint file does not match its manifest (size or CRC32); names the file."""


class VerifiedReader:
    """One file of a checkpoint read front to back through one descriptor, its CRC32 computed
    over every byte read; ``finish`` reads what is left and compares size and CRC with the
    manifest. Bytes may be consumed into a destination (``read_into``), returned (``read``) or
    only checksummed (``skip_to``); ``prefetch`` reads a region ahead once (e.g. a zip directory)
    and serves it when the cursor gets there, so those bytes are checksummed as the ones used.
    An entry whose ``crc32`` is None (a directory plain DCP wrote: no manifest to compare with)
    is checked for its size only."""

    def __init__(self, root: str | Path, rel: str, entry: dict, pool: Executor | None = None):
        self.path, self.entry, self.pool = Path(root) / rel, entry, pool
        self.fd = open_inside(root, rel)
        self.pos, self.crc = 0, 0
        self._ahead: tuple[int, bytes] | None = None
        try:
            size = fstat(self.fd, self.path).st_size
            if size != entry["size"]:
                raise CorruptFileError(f"{self.path}: size {size} bytes, manifest says {entry['size']} "
                                       "(truncated or overwritten)")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "VerifiedReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _pread(self, view: memoryview, offset: int, hashed: bool = True) -> None:
        """Fill ``view`` from ``offset``; ``hashed``: extend the CRC over it (with the reader's
        ``pool``, in pieces on its threads: ``crc.read_hashed``)."""
        try:
            crc, got = read_hashed(self.fd, view, offset, self.crc, self.pool if hashed else None)
        except OSError as e:
            raise type(e)(e.errno, e.strerror, str(self.path)) from None
        if got < len(view):
            raise CorruptFileError(f"{self.path}: ended at byte {offset + got}, manifest says "
                                   f"{self.entry['size']} bytes (truncated)")
        if hashed:
            self.crc = crc

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` (bytes) with the next bytes of the file."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        n, start = len(view), self.pos
        if start + n > self.entry["size"]:
            raise CorruptFileError(f"{self.path}: a read of {n} bytes at {start} passes the end "
                                   f"({self.entry['size']} bytes)")
        done = 0
        while done < n:
            pos, want = start + done, n - done
            if self._ahead is not None:
                first, data = self._ahead
                if pos >= first + len(data):
                    self._ahead = None
                    continue
                if pos >= first:  # served from the bytes read ahead: they are the ones hashed
                    k = min(want, first + len(data) - pos)
                    view[done:done + k] = data[pos - first:pos - first + k]
                    self.crc = crc32(view[done:done + k], self.crc)
                    done += k
                    continue
                want = min(want, first - pos)
            self._pread(view[done:done + want], pos)
            done += want
        self.pos += n

    def read(self, n: int) -> bytearray:
        if n < 0 or self.pos + n > self.entry["size"]:  # checked before the memory is taken
            raise CorruptFileError(f"{self.path}: a read of {n} bytes at {self.pos} passes the end "
                                   f"({self.entry['size']} bytes)")
        out = bytearray(n)
        self.read_into(memoryview(out))
        return out

    def skip_to(self, offset: int) -> None:
        """Checksum the bytes up to ``offset`` without keeping them."""
        if offset < self.pos:
            raise CorruptFileError(f"{self.path}: entries overlap or are out of order at byte {offset}")
        scratch = memoryview(bytearray(min(CHUNK, max(offset - self.pos, 0)) or 1))
        while self.pos < offset:
            self.read_into(scratch[:min(len(scratch), offset - self.pos)])

    def prefetch(self, start: int, n: int) -> bytes:
        """The ``n`` bytes at ``start`` (ahead of the cursor), read now and served again (and
        checksummed) when the cursor reaches them."""
        if start < self.pos or start + n > self.entry["size"]:
            raise CorruptFileError(f"{self.path}: bytes {start}..{start + n} are outside the unread file")
        buf = bytearray(n)
        self._pread(memoryview(buf), start, hashed=False)
        self._ahead = (start, bytes(buf))
        return self._ahead[1]

    def finish(self) -> None:
        """Read to the end and compare CRC32 and size with the manifest.

        Raises:
            CorruptFileError: naming the file.
        """
        self.skip_to(self.entry["size"])
        try:
            longer = os.pread(self.fd, 1, self.pos)
        except OSError as e:
            raise type(e)(e.errno, e.strerror, str(self.path)) from None
        if longer:
            raise CorruptFileError(f"{self.path}: longer than the manifest's {self.entry['size']} bytes")
        got = f"{self.crc:08x}"
        if self.entry["crc32"] is not None and got != self.entry["crc32"]:
            raise CorruptFileError(f"{self.path}: CRC32 {got}, manifest says {self.entry['crc32']} (corrupted)")


def read_verified(root: str | Path, rel: str, entry: dict) -> bytes:
    """The whole file, after its size and CRC32 matched ``entry`` (small files: metadata, user
    content)."""
    with VerifiedReader(root, rel, entry) as reader:
        data = reader.read(entry["size"])
        reader.finish()
    return bytes(data)


def check_file(root: str | Path, rel: str, entry: dict) -> str | None:
    """None if ``root/rel`` is a regular file inside with the recorded size and CRC32, else a
    message naming the file (every byte read)."""
    try:
        with VerifiedReader(root, rel, entry) as reader:
            reader.finish()
    except FileNotFoundError:
        return f"{Path(root) / rel}: missing (listed in the manifest)"
    except (CheckpointError, OSError) as e:
        return str(e)
    return None


def read_json(root: str | Path, rel: str, limit: int) -> object:
    """A JSON file of at most ``limit`` bytes, opened as any checkpoint file (no symlink, regular).

    Raises:
        ValueError: too large, unreadable or nested too deeply, naming the file.
    """
    path = Path(root) / rel
    fd = open_inside(root, rel)
    try:
        data = read_capped(fd, path, limit)
    finally:
        os.close(fd)
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to be a manifest") from None
    except ValueError as e:
        raise ValueError(f"{path}: unreadable ({e})") from None


def inside(directory: str | Path, rel: str) -> tuple[Path, str]:
    """``(directory's parent, "{directory's name}/{rel}")``: ``open_inside`` then opens the
    checkpoint directory too without following a symlink."""
    directory = Path(directory)
    return directory.parent, f"{directory.name}/{rel}"


class CheckpointFiles:
    """The files of one committed checkpoint, opened only as its manifest lists them; DCP
    metadata is read (verified) once per part."""

    def __init__(self, directory: str | Path, manifest: dict):
        self.directory, self.manifest = Path(directory), manifest
        self._metadata: dict = {}

    def entry(self, rel: str) -> dict:
        """The manifest's record of ``rel``.

        Raises:
            UnsafeCheckpointError: ``rel`` is not listed (naming where it would lead).
        """
        entry = self.manifest["files"].get(rel) if isinstance(rel, str) else None
        if entry is None:
            raise UnsafeCheckpointError(f"{self.directory}: {rel!r} is not listed in the manifest (a load opens only "
                                        "the files the checkpoint committed)")
        return entry

    def inside(self, rel: str) -> tuple[Path, str]:
        """(root, relative path) that open ``rel`` with the checkpoint directory itself opened
        without following a symlink (one swapped in after the directory was checked)."""
        return inside(self.directory, rel)

    def reader(self, rel: str, pool: Executor | None = None) -> VerifiedReader:
        return VerifiedReader(*self.inside(rel), self.entry(rel), pool)

    def read(self, rel: str) -> bytes:
        return read_verified(*self.inside(rel), self.entry(rel))

    def metadata(self, part: str):
        """DCP's ``Metadata`` of ``part`` (``""``: a checkpoint that is one DCP directory), read
        verified and with no code run (cached)."""
        if part not in self._metadata:
            from .safe_load import parse_dcp_metadata

            rel = f"{part}/.metadata" if part else ".metadata"
            self._metadata[part] = parse_dcp_metadata(self.read(rel), self.directory / rel)
        return self._metadata[part]
