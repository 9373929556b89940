"""The one way a checkpoint file is opened: once, without following a symlink, checked on the
descriptor (regular file, one link), and read from that descriptor.

A load that checks a path and then opens it again by name reads whatever is there at the second
open: a symlink swapped in between makes it read a file outside the checkpoint, a FIFO hangs it.
Every reader of checkpoint files (the verified reader, the single-file resume, ``smp.load``, the
``newest`` pointer, manifests) opens through ``open_file`` / ``open_inside`` and reads only from
the descriptor they return. Errors name the file.

The path the user names is his own choice, not the checkpoint's: a ``latest -> step_100`` link
or a root linked to a mounted volume is followed, once, at the start (``resolve_named``); inside
the checkpoint nothing is followed.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .failure import CheckpointError

CHUNK = 1 << 22
"""Bytes per ``read`` call."""

HARD_LINKS_ENV = "MODELPARALLEL_ALLOW_HARD_LINKS"
"""Set to 1, checkpoint files with more than one link are read (never written through): a
snapshot made with hard links (``cp -al``, ``rsync --link-dest``) gives every file of the
original checkpoint a second link too, and only the user knows the links are his own."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asked for something a checkpoint may not contain (code, classes), or a
    path that leaves the checkpoint (a symlink, ``..``, a file the manifest does not list)."""


def plain_parts(rel: str, what: str) -> list[str]:
    """The components of a plain relative path (no ``..``, ``.``, empty part, backslash, NUL).

    Raises:
        UnsafeCheckpointError: naming ``what`` and the path.
    """
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise UnsafeCheckpointError(f"{what} names {rel!r}: only plain relative paths inside the checkpoint "
                                    "are allowed")
    return parts


def _refuse_link(path: Path, e: OSError):
    if e.errno in (errno.ELOOP, errno.EMLINK):
        raise UnsafeCheckpointError(f"{path}: a symlink (a checkpoint holds regular files only, and no "
                                    "link inside it is followed: put the file itself there)") from None
    if e.errno == errno.ENOTDIR:
        raise UnsafeCheckpointError(f"{path}: a path component is not a directory (or is a symlink: no link "
                                    "inside a checkpoint is followed; name the real directory to load)") from None
    raise type(e)(e.errno, e.strerror, str(path)) from None


def open_file(name: str | Path, path: str | Path | None = None, *, dir_fd: int | None = None,
              follow: bool = False) -> int:
    """The one way a checkpoint file is opened for reading: once, and everything is read from
    the descriptor returned (never a check of the path and then another open, which a symlink
    or FIFO swapped in between would defeat). Opened read-only and non-blocking (a FIFO's open
    returns at once), without following a symlink unless ``follow`` (a path the user named
    himself), then checked on the descriptor: a regular file, with one link unless ``follow``.
    ``name`` is relative to ``dir_fd`` if given; ``path`` names the file in errors. The caller
    closes it.

    Raises:
        UnsafeCheckpointError: a symlink, a non-regular file, a hard link.
        OSError: naming the file (e.g. ``FileNotFoundError``).
    """
    path = Path(path if path is not None else name)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        _refuse_link(path, e)
    try:
        check_descriptor(fd, path, links=not follow)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_descriptor(fd: int, path: str | Path, links: bool = True) -> os.stat_result:
    """``fstat`` of an open checkpoint file, refused unless it is a regular file (a FIFO would
    block a read forever, a device never end) with one link (``links``: a hard link reaches a
    file outside the checkpoint, and writing through it changes that file)."""
    st = fstat(fd, path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCheckpointError(f"{path}: not a regular file ({_kind(st.st_mode)}); a checkpoint holds "
                                    "regular files only")
    if links and st.st_nlink != 1 and os.environ.get(HARD_LINKS_ENV) != "1":
        raise UnsafeCheckpointError(f"{path}: a file with {st.st_nlink} hard links; a checkpoint file has one "
                                    "(a hard link reaches a file outside the checkpoint). If you made the links "
                                    f"yourself (a snapshot by `cp -al` or `rsync --link-dest`), set {HARD_LINKS_ENV}=1 "
                                    "to read them")
    return st


def open_inside(root: str | Path, rel: str, what: str = "the checkpoint") -> int:
    """A read-only descriptor of the regular file ``root/rel`` (``open_file``), every component
    opened without following a symlink. The caller closes it.

    Raises:
        UnsafeCheckpointError: a symlink, a non-regular file, a hard link or a path that is not plain.
        OSError: naming the file (e.g. ``FileNotFoundError``).
    """
    parts = plain_parts(rel, what)
    root = Path(root)
    path = root.joinpath(*parts)
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise type(e)(e.errno, e.strerror, str(root)) from None
    try:
        for part in parts[:-1]:
            try:
                sub = os.open(part, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=dir_fd)
            except OSError as e:
                _refuse_link(path, e)
            os.close(dir_fd)
            dir_fd = sub
        return open_file(parts[-1], path, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def resolve_named(path: str | Path) -> Path:
    """The real directory of a checkpoint path the user named, every symlink in it followed once,
    now (``os.path.realpath``): a ``latest -> step_100`` link or a root on a linked volume is the
    user's own choice. Everything inside the result is then opened as any checkpoint file
    (``open_inside``: no link followed), and the result's own last component without following
    a link either, so a link swapped in after this call is refused, not followed. A path that
    does not exist comes back resolved as far as it goes (the caller's open names it)."""
    return Path(os.path.realpath(os.fspath(path)))


def read_small(path: str | Path, limit: int, follow: bool = False) -> bytes:
    """The bytes of a small file (a pointer, a manifest), opened once (``open_file``) and read
    from that descriptor, refused past ``limit`` bytes without reading more than that.

    Raises:
        ValueError: larger than ``limit``, naming the file.
        OSError: naming the file (``FileNotFoundError`` if absent).
    """
    path = Path(path)
    fd = open_file(path, follow=follow)
    try:
        return read_capped(fd, path, limit)
    finally:
        os.close(fd)


def read_capped(fd: int, path: Path, limit: int) -> bytes:
    size = fstat(fd, path).st_size
    if size > limit:
        raise ValueError(f"{path}: {size} bytes, more than the {limit} this file may have")
    data = read_from(fd, path, limit + 1)
    if len(data) > limit:  # grew since the fstat
        raise ValueError(f"{path}: more than the {limit} bytes this file may have")
    return data


def fstat(fd: int, path) -> os.stat_result:
    """``os.fstat``, its error naming ``path`` (a descriptor's error names no file)."""
    try:
        return os.fstat(fd)
    except OSError as e:
        raise type(e)(e.errno, e.strerror, str(path)) from None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a file"


def read_path(path: str | Path) -> bytes:
    """The bytes of the file the user named (its own path: a symlink the user made is followed),
    opened once (``open_file``) and read here rather than by ``torch.load``, whose reader turns
    an I/O error into an unrelated ``SystemError``; errors name the file."""
    fd = open_file(path, follow=True)
    try:
        return read_from(fd, Path(path))
    finally:
        os.close(fd)


def read_from(fd: int, path: str | Path, limit: int | None = None) -> bytes:
    """The bytes of open file ``fd`` from where it stands (at most ``limit``); errors name ``path``."""
    chunks, left = [], limit
    try:
        while left is None or left > 0:
            chunk = os.read(fd, CHUNK if left is None else min(CHUNK, left))
            if not chunk:
                break
            chunks.append(chunk)
            left = None if left is None else left - len(chunk)
    except OSError as e:
        raise type(e)(e.errno, e.strerror, str(path)) from None
    return b"".join(chunks)


