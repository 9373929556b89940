"""How checkpoint files are opened (modelparallel/checkpoint/safety/safe_open.py) and what a damaged
or forged file gives: one open per file, checked on its descriptor, and errors that name it.

One process, no ranks: each test builds the files it needs in ``tmp_path``. A failure means a
reader reopened a file by name after checking it (a symlink or FIFO swapped in between wins),
accepted a FIFO, a hard link or an oversized pointer, allocated what a forged size claims, or
raised an error that does not say which file is at fault.
"""

import io
import os

import pytest
import torch

from modelparallel.checkpoint.safety import commit
from modelparallel.checkpoint import single_file
from modelparallel.checkpoint.sagemaker import legacy
from modelparallel.checkpoint.load import parts
from modelparallel.checkpoint.safety.errors import CheckpointError
from modelparallel.checkpoint.safety.files import CorruptFileError, VerifiedReader
from modelparallel.checkpoint.safety.lock import DirectoryLock
from modelparallel.checkpoint.safety.safe_open import UnsafeCheckpointError, open_inside


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_an_open_file_is_read_whatever_its_name_points_to_afterwards(tmp_path):
    """The single-file resume reads the file it opened and checked, not whatever the name holds
    at a second open (a symlink to an outside file swapped in after the check)."""
    inside, outside = {"w": torch.ones(3)}, {"w": torch.zeros(3)}
    (tmp_path / "model.pt").write_bytes(_saved(inside))
    (tmp_path / "outside.pt").write_bytes(_saved(outside))
    fd = open_inside(tmp_path, "model.pt")
    try:
        os.replace(tmp_path / "model.pt", tmp_path / "moved.pt")
        (tmp_path / "model.pt").symlink_to(tmp_path / "outside.pt")
        got = single_file._load_descriptor(fd, tmp_path / "model.pt")
    finally:
        os.close(fd)
    assert torch.equal(got["w"], inside["w"]), "the file was reopened by its name"


@pytest.mark.parametrize("kind", ["fifo", "symlink", "hard link"])
def test_a_checkpoint_file_that_is_not_one_regular_file_is_refused_at_once(tmp_path, kind):
    target = tmp_path / "elsewhere.pt"
    target.write_bytes(_saved({"w": torch.ones(1)}))
    name = tmp_path / "model.pt"
    {"fifo": lambda: os.mkfifo(name), "symlink": lambda: name.symlink_to(target),
     "hard link": lambda: os.link(target, name)}[kind]()
    with pytest.raises(UnsafeCheckpointError, match="model.pt"):  # a FIFO would block a blocking open
        os.close(open_inside(tmp_path, "model.pt"))


def test_newest_is_read_with_a_small_cap_and_never_through_a_link_or_fifo(tmp_path):
    newest = tmp_path / commit.NEWEST
    with open(newest, "wb") as f:
        f.truncate(1 << 30)  # sparse: claims 1 GiB, costs nothing on disk
    with pytest.raises(ValueError, match=f"{newest}: {1 << 30} bytes"):
        commit.read_newest(tmp_path)
    newest.unlink()
    os.mkfifo(newest)
    with pytest.raises(UnsafeCheckpointError, match="FIFO"):
        commit.read_newest(tmp_path)
    newest.unlink()
    assert commit.read_newest(tmp_path) is None
    commit.write_newest(tmp_path, "a_partial")
    assert commit.read_newest(tmp_path) == "a_partial"


def test_a_read_past_the_end_is_refused_before_its_memory_is_taken(tmp_path):
    """A forged entry claiming a huge length (1 TiB here: allocating it would fail) is refused
    by comparing with the file's size first."""
    data = b"x" * 100
    (tmp_path / "f").write_bytes(data)
    entry = {"size": len(data), "crc32": "0"}
    with VerifiedReader(tmp_path, "f", entry) as reader:
        with pytest.raises(CorruptFileError, match=f"{tmp_path / 'f'}: a read of {1 << 40} bytes"):
            reader.read(1 << 40)


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("damage", ["empty", "truncated", "half"])
def test_smp_load_of_a_damaged_file_names_it(tmp_path, weights_only, damage):
    data = _saved({"w": torch.ones(64)})
    f = tmp_path / "model.pt"
    f.write_bytes({"empty": b"", "truncated": data[:-5], "half": data[:len(data) // 2]}[damage])
    with pytest.raises(CorruptFileError, match=str(f)):
        legacy.load(f, partial=False, weights_only=weights_only)


def test_smp_load_of_a_fifo_is_refused_not_hung(tmp_path):
    os.mkfifo(tmp_path / "model.pt")
    with pytest.raises(UnsafeCheckpointError, match="FIFO"):
        legacy.load(tmp_path / "model.pt", partial=False)


@pytest.mark.parametrize("content", [{"__modelparallel_value__": "bogus"},
                                     {"__modelparallel_value__": "hf_config", "config": {}, "class": "Nope"},
                                     b"not a torch file"])
def test_forged_user_content_names_its_file(tmp_path, content):
    data = content if isinstance(content, bytes) else _saved(content)
    name = tmp_path / "user_content.pt"
    with pytest.raises(CheckpointError, match=str(name)):
        parts.read_user_content(data, name)


def test_a_lock_file_that_is_a_hard_link_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "ck").mkdir()
    os.link(victim, tmp_path / "ck" / ".mp-lock")
    with pytest.raises(CheckpointError, match="hard link"):
        DirectoryLock(tmp_path / "ck").acquire()
    assert victim.read_text() == "precious\n"


def test_a_checkpoint_directory_swapped_for_a_symlink_is_not_followed(tmp_path):
    """The directory was checked when the load began; a symlink put in its place afterwards
    (to a directory holding other files) is refused when a file of it is opened."""
    from modelparallel.checkpoint.safety.files import CheckpointFiles

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "f").write_bytes(b"outside")
    files = CheckpointFiles(tmp_path / "a_partial", {"files": {"f": {"size": 7, "crc32": "00000000"}}})
    (tmp_path / "a_partial").symlink_to(tmp_path / "other")
    with pytest.raises(UnsafeCheckpointError, match="a_partial"):
        files.read("f")


def test_a_snapshot_by_hard_links_is_read_only_when_the_user_says_the_links_are_his(tmp_path, monkeypatch):
    """``cp -al ck backup`` gives every file of ``ck`` a second link: refused by default with a
    message saying how to read it; with ``MODELPARALLEL_ALLOW_HARD_LINKS=1`` the file is read
    (from its descriptor, as any other); symlinks and FIFOs stay refused."""
    from modelparallel.checkpoint.safety.safe_open import HARD_LINKS_ENV

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "model.pt").write_bytes(_saved({"w": torch.ones(3)}))
    os.mkfifo(tmp_path / "ck" / "fifo.pt")
    (tmp_path / "ck" / "link.pt").symlink_to(tmp_path / "ck" / "model.pt")
    (tmp_path / "backup").mkdir()
    os.link(tmp_path / "ck" / "model.pt", tmp_path / "backup" / "model.pt")
    monkeypatch.delenv(HARD_LINKS_ENV, raising=False)
    with pytest.raises(UnsafeCheckpointError, match=f"2 hard links.*set {HARD_LINKS_ENV}=1"):
        open_inside(tmp_path / "ck", "model.pt")
    monkeypatch.setenv(HARD_LINKS_ENV, "1")
    for root in ("ck", "backup"):
        fd = open_inside(tmp_path / root, "model.pt")
        try:
            assert torch.equal(single_file._load_descriptor(fd, tmp_path / root / "model.pt")["w"], torch.ones(3))
        finally:
            os.close(fd)
    for name in ("fifo.pt", "link.pt"):
        with pytest.raises(UnsafeCheckpointError, match=name):
            open_inside(tmp_path / "ck", name)
