"""``modelparallel.checkpoint.utils``: ``limit_num_subdirs`` and ``SORT_BY_LAST_INT``, as v2
scripts call them after each save.

A failure means retention deletes the wrong checkpoints (an older one kept, the newest deleted,
a symlink or an unmatched directory touched) or deletes on a rank that was not asked to.
"""

import os

import pytest

from modelparallel.checkpoint.utils import SORT_BY_LAST_INT, limit_num_subdirs

REGEX = r"^.*\d+steps$"


def make(root, names):
    for n in names:
        os.makedirs(os.path.join(root, n))
        open(os.path.join(root, n, "x"), "w").close()


def test_sort_by_last_int():
    assert SORT_BY_LAST_INT("llama_v2-120steps") == 120
    assert SORT_BY_LAST_INT("/a/b7/gpt2-3-40steps") == 40
    with pytest.raises(ValueError, match="no integer"):
        SORT_BY_LAST_INT("final")


def test_keeps_newest_by_step_not_by_name(tmp_path):
    make(tmp_path, ["m-9steps", "m-10steps", "m-100steps", "m-11steps", "model", "notes-5"])
    os.symlink(tmp_path / "m-9steps", tmp_path / "m-1000steps")
    removed = limit_num_subdirs(str(tmp_path), 2, sort_fn=SORT_BY_LAST_INT, regex=REGEX, log=True)
    assert sorted(os.path.basename(p) for p in removed) == ["m-10steps", "m-9steps"]
    assert sorted(os.listdir(tmp_path)) == ["m-1000steps", "m-100steps", "m-11steps", "model", "notes-5"]


def test_only_the_logging_rank_deletes(tmp_path):
    make(tmp_path, ["a-1steps", "a-2steps"])
    assert limit_num_subdirs(tmp_path, 1, regex=REGEX, log=False) == []
    assert len(os.listdir(tmp_path)) == 2
    assert [os.path.basename(p) for p in limit_num_subdirs(tmp_path, 1, regex=REGEX, log=True)] == ["a-1steps"]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep at least 1"):
        limit_num_subdirs(tmp_path, 0)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(NotADirectoryError, match="a-file is not a directory"):
        limit_num_subdirs(tmp_path / "a-file", 1)
    assert limit_num_subdirs(tmp_path, None) == []


def test_unorderable_names_are_kept(tmp_path):
    make(tmp_path, ["a-1", "a-2", "latest"])
    limit_num_subdirs(tmp_path, 1, log=True)
    assert sorted(os.listdir(tmp_path)) == ["a-2", "latest"]


def test_a_directory_not_made_yet_holds_nothing_to_delete(tmp_path):
    """Scripts prune before their first save, when the checkpoint directory does not exist."""
    assert limit_num_subdirs(tmp_path / "checkpoints", 2, regex=REGEX, log=True) == []
    assert not (tmp_path / "checkpoints").exists()
