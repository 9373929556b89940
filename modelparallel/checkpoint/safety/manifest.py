"""A checkpoint's manifest: read and checked, and what a committed directory must hold.

The manifest (``checkpoint_manifest.json``) lists every file of a checkpoint with its size and
CRC32. Reading it checks its fields and types and that every path in it stays inside the
checkpoint, so a malformed or hostile manifest is a ``ManifestError`` naming the file rather
than a ``KeyError`` deep in a load. A checkpoint directory must hold exactly the files its
manifest lists: anything else would load unverified.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from .failure import CheckpointError
from .files import UnsafeCheckpointError, inside, read_json

MANIFEST = "checkpoint_manifest.json"
FORMATS = ("modelparallel-partial", "modelparallel-full", "modelparallel-dcp")
"""A partial (``smp.save_checkpoint``), a full one, and one DCP directory (the v2 API's saves)."""
TRASH = re.compile(r"^\.mp-trash-[0-9a-f]{12}-(.+)$")
"""A directory a commit or a deletion moved aside (``commit.hidden_name("trash", ...)``)."""
MAX_MANIFEST_BYTES = 16 * 2**20
"""Largest manifest read (a manifest lists files: ~100 bytes each, so about 150,000 of them);
anything larger is refused before it is read, so a crafted one cannot exhaust memory."""


class ManifestError(CheckpointError, ValueError):
    """A manifest that does not parse or lacks what a checkpoint needs; names the file."""


def read_manifest(directory: str | Path, name: str = MANIFEST) -> dict:
    """The manifest of a checkpoint directory, checked (fields, types, paths inside it).

    Raises:
        FileNotFoundError: naming the directory, when it has none.
        ManifestError: naming the file and every problem, when it is unreadable or malformed.
    """
    path = Path(directory) / name
    try:
        manifest = read_json(*inside(directory, name), MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory} is not a complete modelparallel checkpoint: no {name}") from None
    except UnsafeCheckpointError as e:
        raise ManifestError(f"{path}: unreadable manifest ({e})") from None
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: unreadable manifest ({str(e).removeprefix(f'{path}: ')})") from None
    problems = manifest_problems(manifest)
    if problems:
        raise ManifestError(f"{path}: malformed manifest: " + "; ".join(problems))
    return manifest


def _entry_problems(where: str, entry) -> list[str]:
    if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or isinstance(entry.get("size"), bool) \
            or entry["size"] < 0 or not isinstance(entry.get("crc32"), str) \
            or not re.fullmatch(r"[0-9a-f]{8}", entry["crc32"]):
        return [f"{where}: needs an integer 'size' and an 8-hex-digit 'crc32', got {entry!r}"[:300]]
    return []


def _path_problem(rel) -> str | None:
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts):
        return f"file name {rel!r} is not a plain relative path inside the checkpoint"
    return None


def manifest_problems(m) -> list[str]:
    """Everything wrong with a parsed manifest (empty if it is usable)."""
    if not isinstance(m, dict):
        return [f"expected a JSON object, got {type(m).__name__}"]
    problems = []
    kind = m.get("format")
    if kind not in FORMATS:
        problems.append(f"'format' must be one of {', '.join(FORMATS)}, got {kind!r}")
    files = m.get("files")
    if not isinstance(files, dict):
        problems.append("'files' (every file with its size and CRC32) is missing or not an object")
        files = {}
    for rel, entry in files.items():
        problems += [p] if (p := _path_problem(rel)) else []
        problems += _entry_problems(f"files[{rel!r}]", entry)
    if not isinstance(m.get("saved_at_ns", 0), int):
        problems.append("'saved_at_ns' must be an integer")
    if kind == "modelparallel-partial":
        if not isinstance(m.get("parts"), list) or not all(isinstance(p, str) for p in m["parts"]):
            problems.append("'parts' must be a list of part names")
    elif kind == "modelparallel-full":
        weights = m.get("weights")
        if not isinstance(weights, list) or not all(isinstance(w, str) and w in files for w in weights):
            problems.append("'weights' must list files that 'files' lists")
        entry = m.get("user_content")
        problems += _entry_problems("'user_content'", entry)
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", "..") \
                or not name.startswith("user_content_"):
            problems.append(f"'user_content' must name a user_content_* file next to the checkpoint, got {name!r}")
    return problems


def safe_name(path: str | Path, name, what: str) -> str:
    """``name`` if it is one plain entry of directory ``path`` (a tag, or what ``newest`` names),
    not a path that leaves it (``/abs``, ``../x``, ``a/b``) nor a symlink (a checkpoint is a
    directory the library wrote; a link could lead anywhere, and is never followed).

    Raises:
        ValueError: naming ``what`` and the name.
    """
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith(".") \
            or "\0" in name:
        raise ValueError(f"{what} {name!r} is not a checkpoint name in {path} (no '/', not starting with '.')")
    entry = Path(path) / name
    if entry.is_symlink():
        target = os.readlink(entry)
        raise ValueError(f"{what} {name!r} is a symlink (to {target}); a checkpoint is a directory written in "
                         f"{path}, and no link inside it is followed: use the tag of the checkpoint it points to "
                         f"({Path(target).name.removesuffix('_partial')!r}), or the directory holding it as the path")
    return name


def unlisted_files(directory: str | Path, manifest: dict) -> list[str]:
    """A message per file (or symlink) in the checkpoint directory that its manifest does not
    list: what was committed is exactly what loads, nothing slipped in loads unverified."""
    listed = set(manifest["files"])
    root = Path(directory)
    return [f"{root / f}: not listed in the manifest (a checkpoint holds only the files it committed)"
            for f in entries(root) if f != MANIFEST and f not in listed]


def entries(root: str | Path) -> list[str]:
    """Every entry under ``root`` that is not a directory (files, symlinks, FIFOs, sockets,
    devices), as sorted relative POSIX paths; symlinked directories are listed, not entered."""
    root, found = Path(root), []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        found += [(here / n).relative_to(root).as_posix() for n in filenames]
        found += [(here / n).relative_to(root).as_posix() for n in dirnames if (here / n).is_symlink()]
    return sorted(found)


def check_committed(directory: str | Path, manifest: dict) -> None:
    """After the commit: the directory holds exactly the manifest's files at their sizes.

    Raises:
        OSError: naming what is missing, resized or extra (the save must not report success).
    """
    problems = unlisted_files(directory, manifest)
    for rel, entry in manifest["files"].items():
        path = Path(directory) / rel
        size = path.lstat().st_size if path.is_file() and not path.is_symlink() else None
        if size != entry["size"]:
            problems.append(f"{path}: {'missing' if size is None else f'{size} bytes'} after commit, "
                            f"{entry['size']} written")
    if problems:
        raise OSError("the committed checkpoint is not what was written: " + "; ".join(problems))


def set_aside_note(parent: str | Path, name: str) -> str:
    """For a message about a missing ``parent/name``: the copies of it an interrupted commit left
    aside (``.mp-trash-...``), which the next save of it restores if whole; "" if there is none.
    Nothing is read or changed (a load only reports)."""
    try:
        found = sorted(e.name for e in os.scandir(parent) if TRASH.match(e.name)
                       and TRASH.match(e.name).group(1) == name and e.is_dir(follow_symlinks=False))
    except OSError:
        return ""
    if not found:
        return ""
    return (f"; an interrupted commit left a copy of it aside as {', '.join(found)} in {parent}: the next save of "
            f"{name} puts it back if it is whole, or rename it to {name} yourself")


def restore_swapped_out(parent: str | Path, name: str) -> bool:
    """Put back ``parent/name`` from the copy a commit moved aside (``.mp-trash-{nonce}-{name}``)
    when a crash came before the new one took its place: only while ``name`` is absent, and only
    a copy whose manifest and files are whole (a half-deleted one stays trash). Returns whether
    one was restored."""
    parent, final = Path(parent), Path(parent) / name
    if os.path.lexists(final) or not parent.is_dir():
        return False
    for entry in sorted(parent.iterdir()):
        trash = TRASH.match(entry.name)
        if trash and trash.group(1) == name and entry.is_dir() and not entry.is_symlink():
            try:
                check_committed(entry, read_manifest(entry))
            except (OSError, ValueError, CheckpointError):
                continue
            os.rename(entry, final)
            fd = os.open(parent, os.O_RDONLY)
            try:
                os.fsync(fd)  # the name back on disk
            finally:
                os.close(fd)
            logging.getLogger("modelparallel").warning("restored %s from %s, which an interrupted commit left aside",
                                                       final, entry.name)
            return True
    return False
