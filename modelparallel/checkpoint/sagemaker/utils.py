"""Checkpoint retention for scripts that name their own checkpoint directories (SageMaker v2's
``torch.sagemaker.checkpoint.utils``).

v2 scripts write each checkpoint to ``root/<name with the step in it>`` and then call
``limit_num_subdirs(root, keep, sort_fn=SORT_BY_LAST_INT, regex=..., log=rank == 0)`` to delete
all but the newest ``keep``. The rank given ``log=True`` is the one that deletes (and says so);
the others only compute. What can be deleted is deliberately narrow: real directories directly
under ``root`` whose name matches ``regex`` and that ``sort_fn`` can order; the newest is never
deleted, symlinks and files are never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable

logger = logging.getLogger("modelparallel")

_INT = re.compile(r"\d+")


def SORT_BY_LAST_INT(name: str) -> int:  # noqa: N802 - SageMaker's name for a sort key
    """The last integer in ``name`` (``"llama-120steps"`` -> 120): the step of a checkpoint
    directory named after it.

    Raises:
        ValueError: when ``name`` holds no digit.
    """
    found = _INT.findall(os.path.basename(os.path.normpath(name)))
    if not found:
        raise ValueError(f"SORT_BY_LAST_INT: {name!r} holds no integer to sort by")
    return int(found[-1])


def _orderable(root: str, regex: str | None, sort_fn: Callable[[str], object]) -> list[tuple[object, str]]:
    """(sort key, name) of the subdirectories eligible for deletion, oldest first."""
    pattern = re.compile(regex) if regex is not None else None
    out = []
    for entry in os.scandir(root):
        if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
            continue
        if pattern is not None and not pattern.match(entry.name):
            continue
        try:
            out.append((sort_fn(entry.name), entry.name))
        except ValueError as e:
            logger.warning("limit_num_subdirs: keeping %s (cannot order it: %s)", entry.path, e)
    return sorted(out)


def limit_num_subdirs(root_dir: str | os.PathLike, num_kept: int | None,
                      sort_fn: Callable[[str], object] = SORT_BY_LAST_INT, regex: str | None = None,
                      log: bool = True) -> list[str]:
    """Delete all but the newest ``num_kept`` checkpoint directories under ``root_dir``.

    Args:
        root_dir: the directory holding one subdirectory per checkpoint.
        num_kept: how many to keep (at least 1; None keeps all).
        sort_fn: maps a subdirectory name to a sort key, oldest smallest; a name it raises
            ``ValueError`` for is kept.
        regex: only names matching it (``re.match``) are candidates; default: every directory.
        log: this rank deletes and logs; pass ``rank == 0`` so that one rank of the job does.

    Returns:
        The paths deleted (empty on ranks with ``log`` false, which delete nothing).

    Raises:
        ValueError: for ``num_kept`` < 1 (that would delete the newest checkpoint).
        NotADirectoryError: when ``root_dir`` exists and is not a directory.

    A ``root_dir`` that does not exist yet holds nothing to delete: scripts prune before their
    first save, when the checkpoint directory is still to be made.
    """
    if num_kept is None:
        return []
    if isinstance(num_kept, bool) or not isinstance(num_kept, int) or num_kept < 1:
        raise ValueError(f"limit_num_subdirs(num_kept={num_kept!r}): keep at least 1 checkpoint (None keeps all)")
    root = os.fspath(root_dir)
    if not os.path.lexists(root):
        return []
    if not os.path.isdir(root):
        raise NotADirectoryError(f"limit_num_subdirs: {root} is not a directory")
    candidates = _orderable(root, regex, sort_fn)
    doomed = [os.path.join(root, name) for _, name in candidates[:-num_kept]]
    if not log:
        return []
    for path in doomed:
        logger.info("limit_num_subdirs: removing %s (keeping the newest %d)", path, num_kept)
        shutil.rmtree(path)
    return doomed
