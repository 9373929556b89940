"""The commit's fallback where the file system cannot swap two directories atomically
(``renameat2(RENAME_EXCHANGE)`` fails, as on NFS and other network file systems): the old
checkpoint is renamed aside, then the new one into place. A failure of the second rename left the
old one only as ``.mp-trash-...`` (the save raised, and the next save deleted it as a leftover);
a crash between the two renames did the same. Now the failed rename puts the old one back, and
the next save (v1 ``clean_leftovers``, v2 ``directory.remove_leftovers``) restores a whole copy
left aside instead of deleting it; a half-deleted one is still removed.

In one process, on fake checkpoints. A failure points at ``commit.commit_dir`` or
``manifest.restore_swapped_out``.
"""

from __future__ import annotations

import os

import pytest

from modelparallel.checkpoint.safety import commit
from modelparallel.distributed.checkpoint import directory


def _staged(root, name: str, content: bytes):
    staging = root / commit.hidden_name("staging", commit.new_nonce(), name)
    staging.mkdir()
    (staging / "data.bin").write_bytes(content)
    commit.write_manifest(staging, {"saved_at_ns": 1, "format": "modelparallel-dcp",
                                    "files": {"data.bin": commit.file_checksum(staging / "data.bin")}})
    return staging


def test_a_failed_second_rename_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    commit.commit_dir(_staged(tmp_path, "ck", b"old"), tmp_path / "ck")
    staging = _staged(tmp_path, "ck", b"new")
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    real = os.rename

    def rename(src, dst):
        if str(src) == str(staging):
            raise OSError(5, "Input/output error", str(src))
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        commit.commit_dir(staging, tmp_path / "ck")
    assert (tmp_path / "ck" / "data.bin").read_bytes() == b"old"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".mp-trash-")], os.listdir(tmp_path)


@pytest.mark.parametrize("cleaner", ["v1 clean_leftovers", "v2 remove_leftovers"])
def test_a_whole_copy_left_aside_is_restored_a_half_deleted_one_removed(tmp_path, cleaner):
    commit.commit_dir(_staged(tmp_path, "ck", b"old"), tmp_path / "ck")
    commit.commit_dir(_staged(tmp_path, "gone", b"x"), tmp_path / "gone")
    # a crash between the fallback's two renames: the old checkpoint aside, nothing under its name
    os.rename(tmp_path / "ck", tmp_path / commit.hidden_name("trash", commit.new_nonce(), "ck"))
    half = tmp_path / commit.hidden_name("trash", commit.new_nonce(), "gone")
    os.rename(tmp_path / "gone", half)
    (half / "data.bin").unlink()  # a deletion interrupted half-way: not a checkpoint any more
    if cleaner.startswith("v1"):
        commit.clean_leftovers(tmp_path)
    else:
        directory.remove_leftovers(tmp_path / "ck")
        directory.remove_leftovers(tmp_path / "gone")
    assert (tmp_path / "ck" / "data.bin").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["ck"], os.listdir(tmp_path)


def test_a_load_of_a_checkpoint_left_aside_names_the_copy_and_changes_nothing(tmp_path):
    """Until the next save restores it, a load says where the copy is (v2 and v1's lookup), and
    moves nothing: loading is read-only."""
    from modelparallel.checkpoint.api import locate

    commit.commit_dir(_staged(tmp_path, "ck", b"old"), tmp_path / "ck")
    aside = commit.hidden_name("trash", commit.new_nonce(), "ck")
    os.rename(tmp_path / "ck", tmp_path / aside)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"left a copy of it aside as {aside}"):
        directory.checkpoint_files(tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match=f"left a copy of it aside as {aside}"):
        locate(tmp_path, "ck", partial=False)
    assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(FileNotFoundError) as missing:  # nothing aside: no such note
        directory.checkpoint_files(tmp_path / "other")
    assert "aside" not in str(missing.value)
