"""Neighbouring deferred tensors write-protected by one walk (``pages._runs``, ``MERGE_GAP``).

The tensors of a save lie side by side (views of one flat parameter, neighbouring ``malloc``
mappings); protecting each costs a walk and a TLB flush of its own, so marks of one mapping close
together are protected as one range, the pages between them included. A failure means the merged
range changed an answer: a write between two tensors (in pages neither holds) failing the save,
a write to one tensor failing its neighbour or going unseen, a range left protected after the
copy, or neighbours still protected one walk each. One process; skipped where the kernel gives no
write tracking (as in ``test_checkpoint_page_watch.py``).
"""

import pytest
import torch

from modelparallel.checkpoint.background import pages
from modelparallel.checkpoint.background.pages import MERGE_GAP, PAGE, PageWatch
from modelparallel.checkpoint.background.stager import StagedTensorChanged, Stager

FLOATS_PER_PAGE = PAGE // 4
N = 200 * FLOATS_PER_PAGE  # 800 kB of floats: above the per-tensor floor


def _watch() -> PageWatch | None:
    watch = PageWatch.open()
    if watch is not None:
        watch.min_save_bytes = 0  # these saves are under the per-save floor
    return watch


needs_watch = pytest.mark.skipif(_watch() is None, reason="no asynchronous write-protect on this machine")


def _save(edit, walks: list, **tensors) -> list[str]:
    """Defer ``tensors``, seal, ``edit()``, copy; the tensors the failure names ([] if none).
    ``walks`` gets each protected range."""
    stager = Stager()
    stager.pages = _watch()
    real = stager.pages._protect

    def counted(lo, hi, on=True):
        if on:
            walks.append((lo, hi))
        return real(lo, hi, on)

    stager.pages._protect = counted
    stager.begin()
    for name, t in tensors.items():
        stager.defer(name, t, t, stager.buffer((name,), t))
    stager.seal()
    edit()
    try:
        stager.copy_deferred()
        return []
    except StagedTensorChanged as e:
        return str(e).split("staged: ")[1].split(". ")[0].split(", ")
    finally:
        stager.settle()
        assert stager.pages.protected == [], "a range outlived the copy"


def _flip(t: torch.Tensor, i: int) -> None:
    t.data[i] = -t.data[i] - 1


@needs_watch
def test_neighbours_are_protected_together_and_still_answer_alone():
    gap = FLOATS_PER_PAGE + 5  # a page and a bit between them: held by neither (within MERGE_GAP at any alignment)
    flat = torch.randn(2 * N + gap + 8)
    a, b = flat[3:N], flat[N + gap:2 * N + gap]
    inside_gap = N + gap // 2
    walks: list = []
    assert _save(lambda: _flip(flat, inside_gap), walks, a=a, b=b) == [], "a write between the tensors"
    assert len(walks) == 1, f"two neighbours protected by {len(walks)} walks"
    assert _save(lambda: _flip(b, N // 2), [], a=a, b=b) == ["b"]
    assert _save(lambda: _flip(a, N // 2), [], a=a, b=b) == ["a"]
    assert _save(lambda: (_flip(a, 5 * FLOATS_PER_PAGE), _flip(b, 7 * FLOATS_PER_PAGE)), [], a=a, b=b) == ["a", "b"]


@needs_watch
def test_tensors_far_apart_are_protected_apart():
    far = MERGE_GAP // 4 + 4 * FLOATS_PER_PAGE  # more than the gap joined
    flat = torch.randn(2 * N + far)
    a, b = flat[:N], flat[N + far:]
    walks: list = []
    assert _save(lambda: _flip(flat, N + far // 2), walks, a=a, b=b) == []
    assert len(walks) == 2 and all(hi - lo < N * 4 for lo, hi in walks), walks
    assert _save(lambda: _flip(b, 1000), [], a=a, b=b) == ["b"]


def test_runs_join_only_marks_of_one_mapping_close_together():
    """The cut itself, on made-up marks: (lo, hi) and the mappings each lies in."""

    class Mark:
        def __init__(self, lo, hi):
            self.lo, self.hi = lo, hi

    one, other = (0, 1 << 30, True), (1 << 30, 1 << 31, True)
    m = [Mark(PAGE, 10 * PAGE), Mark(10 * PAGE + MERGE_GAP, 20 * PAGE + MERGE_GAP),  # joined: at the gap
         Mark(21 * PAGE + 2 * MERGE_GAP, 30 * PAGE + 2 * MERGE_GAP),  # apart: past it
         Mark(40 * PAGE + 2 * MERGE_GAP, 50 * PAGE + 2 * MERGE_GAP),  # apart: two mappings
         Mark(50 * PAGE + 2 * MERGE_GAP, 60 * PAGE + 2 * MERGE_GAP)]
    located = [(m[0], [one]), (m[1], [one]), (m[2], [one]), (m[3], [one, other]), (m[4], [one])]
    assert [[x.lo for x in run] for run in pages._runs(located)] == [[m[0].lo, m[1].lo], [m[2].lo], [m[3].lo],
                                                                      [m[4].lo]]


@needs_watch
def test_a_small_tensor_joins_a_large_neighbours_walk_and_is_read_when_alone():
    small = 40 * FLOATS_PER_PAGE  # 160 kB: under MIN_BYTES, protected only beside a larger tensor
    assert small * 4 < pages.MIN_BYTES <= N * 4
    flat = torch.randn(N + small + 8)
    big, beside = flat[:N], flat[N + 3:N + 3 + small]
    walks: list = []
    assert _save(lambda: _flip(beside, small // 2), walks, big=big, beside=beside) == ["beside"]
    assert len(walks) == 1 and walks[0][1] - walks[0][0] > N * 4, "the small tensor is not in the large one's walk"
    alone = torch.randn(small)
    walks = []
    assert _save(lambda: _flip(alone, small // 2), walks, alone=alone) == ["alone"], "read at the call"
    assert walks == [], "a small tensor alone was protected by a walk of its own"
