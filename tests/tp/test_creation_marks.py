"""``CreationMarks``: the innermost open block marks modules built inside it, explicit marks win,
and a module built by another thread while a block is open is not marked by it."""

import threading

from torch import nn

from modelparallel.tp.creation_marks import CreationMarks


def _child(parent: nn.Module, name: str) -> nn.Module:
    setattr(parent, name, nn.Linear(2, 2))  # assigning a child fires the registration hook
    return getattr(parent, name)


def test_innermost_block_marks_and_explicit_marks_stay():
    marks = CreationMarks("_test_mark")
    root = nn.Module()
    with marks.marking("outer"):
        outer = _child(root, "a")
        with marks.marking("inner"):
            inner = _child(root, "b")
            kept = nn.Linear(2, 2)
            kept._test_mark = "mine"
            root.c = kept
        after = _child(root, "d")
    outside = _child(root, "e")
    got = (outer._test_mark, inner._test_mark, kept._test_mark, after._test_mark)
    assert got == ("outer", "inner", "mine", "outer")
    assert not hasattr(outside, "_test_mark")


def test_another_thread_is_not_marked_by_an_open_block():
    marks = CreationMarks("_test_mark")
    built, started, release = {}, threading.Event(), threading.Event()

    def other():
        started.wait()
        built["other"] = _child(nn.Module(), "x")
        release.set()

    thread = threading.Thread(target=other)
    thread.start()
    with marks.marking("main"):
        started.set()
        release.wait(10)
        mine = _child(nn.Module(), "y")
    thread.join()
    assert mine._test_mark == "main"
    assert not hasattr(built["other"], "_test_mark")
