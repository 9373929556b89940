"""The corpus's files and a download-free byte tokenizer for ``train``: what the launcher checks
before any rank starts, so this module imports no torch (the windows over the text are ``data``'s).

Every rank reads the corpus itself rather than receiving it from rank 0: reading a few megabytes
of text is cheaper than broadcasting it, and it needs no collective before the model exists. That
only works if every rank sees the same files in the same order, so file discovery is sorted and
shuffled with a fixed seed, never by directory-listing order.
"""

from __future__ import annotations

import os
import random
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

TEXT_SUFFIXES = (".py", ".txt", ".md")
# Third-party code and tool caches are not "the corpus" even when they sit under a data
# directory (the stdlib directory of many Python builds contains site-packages).
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "node_modules"}
_FILE_ORDER_SEED = 20240601


def default_data_path() -> Path:
    """The Python standard library: text every machine with Python has, so the default run needs
    no download and no user data."""
    return Path(sysconfig.get_paths()["stdlib"])


class ByteTokenizer:
    """Raw UTF-8 bytes as ids 0..255 plus a few specials; decoding is exact for any text.

    Needs no vocabulary file, so named-config runs work offline, and a 256-way softmax keeps a
    tiny CPU model's output layer cheap. ``vocab_size`` is padded to a multiple of 8 so the
    vocabulary splits evenly over common tensor-parallel degrees.
    """

    eos_token_id = 256  # separates documents; also used as bos/pad for generation
    pad_token_id = 256
    bos_token_id = 256
    vocab_size = 264

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special ids are dropped and split multi-byte characters replaced."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size


def find_text_files(paths: Sequence[str | os.PathLike], suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[Path]:
    """Every regular file ending in ``suffixes`` under ``paths`` (files are taken as given), sorted.

    Raises:
        FileNotFoundError: naming each path that does not exist.
        ValueError: if no text file is found, so a typo does not train on nothing.
    """
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(f"--data path(s) not found: {', '.join(missing)}")
    found: set[Path] = set()
    for p in map(Path, paths):
        if p.is_file():
            found.add(p.resolve())
            continue
        for root, dirs, files in os.walk(p):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
            # regular files only: a dangling link (an editor's lock file) or a FIFO named *.py
            # would fail the size check before launch, or hang every rank reading it
            found.update(Path(root, f).resolve() for f in files
                         if f.endswith(suffixes) and os.path.isfile(os.path.join(root, f)))
    if not found:
        raise ValueError(f"no {'/'.join('*' + s for s in suffixes)} files under "
                         f"{', '.join(map(str, paths))}")
    return sorted(found)


def select_files(files: list[Path], max_files: int | None) -> list[Path]:
    """A fixed-seed shuffle, then the first ``max_files``: a bounded corpus that still samples the
    whole tree (alphabetical order would take only ``__future__``, ``_aix_support``...)."""
    order = list(files)
    random.Random(_FILE_ORDER_SEED).shuffle(order)
    return order[:max_files] if max_files else order
