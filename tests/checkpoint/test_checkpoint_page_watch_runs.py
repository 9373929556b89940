"""Neighbouring deferred tensors write-protected by one walk (``background/runs.py``).

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

from modelparallel.checkpoint.background import pages, runs
from modelparallel.checkpoint.background.pages import PAGE, PageWatch
from modelparallel.checkpoint.background.runs import MERGE_GAP
from modelparallel.checkpoint.background.stager import Stager
from test_checkpoint_page_watch_edges import _named, _save as save_and_edit

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
    named = _named(save_and_edit(stager, edit, **tensors))
    assert stager.pages.protected == [], "a range outlived the copy"
    return named


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


def test_runs_join_marks_close_together_in_one_mapping_or_the_next():
    """The cut itself, on made-up marks: (lo, hi) and the mappings (start, end, trusted) each
    lies in. Joined: within the gap in one mapping, or across two mappings without a hole; apart:
    past the gap, across a hole between mappings; left out: a mark with no trusted mapping."""

    class Mark:
        def __init__(self, lo, hi):
            self.lo, self.hi, self.alone = lo, hi, True

    one, two = (0, 1 << 20, True), (1 << 20, (1 << 20) + 4 * PAGE, True)
    far = ((1 << 20) + 5 * PAGE, 1 << 22, True)  # a page's hole after ``two``
    g = MERGE_GAP
    assert g >= 4 * PAGE
    m = [Mark(PAGE, 10 * PAGE), Mark(10 * PAGE + g, 20 * PAGE + g),  # at the gap: joined
         Mark(21 * PAGE + 2 * g, 30 * PAGE + 2 * g),  # past it: apart
         Mark(30 * PAGE + 2 * g, (1 << 20) + PAGE),  # into the next mapping, no hole: joined
         Mark((1 << 20) + 5 * PAGE, (1 << 20) + 9 * PAGE),  # within the gap, but after a hole: apart
         Mark((1 << 20) + 9 * PAGE, (1 << 20) + 12 * PAGE)]  # not trusted: left out
    located = [(m[0], [one]), (m[1], [one]), (m[2], [one]), (m[3], [one, two]), (m[4], [far]), (m[5], None)]
    got = [([x.lo for x in r.marks], r.lo, r.hi, [v[:2] for v in r.vmas]) for r in runs.cut(located)]
    assert got == [([m[0].lo, m[1].lo], m[0].lo, m[1].hi, [one[:2]]),
                   ([m[2].lo, m[3].lo], m[2].lo, m[3].hi, [one[:2], two[:2]]),
                   ([m[4].lo], m[4].lo, m[4].hi, [far[:2]])], got


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
