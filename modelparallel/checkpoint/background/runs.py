"""Neighbouring watched tensors write-protected by one walk of the page tables.

Each ``PAGEMAP_SCAN`` walk that write-protects a range costs about 15 microseconds besides its
pages (the system call, a TLB flush; 2-core VM: 66 tensors of 63 MB protected one by one in
1.8 ms, as one range in 0.8 ms), and a save's tensors lie side by side: views of one flat
parameter, ``malloc``'s neighbouring mappings. So marks (``pages.Protected``, in address order)
at most ``MERGE_GAP`` apart, in one mapping or in mappings that follow each other without a hole
(both registered, as every mapping the watch trusts is private anonymous memory), are cut into
one ``Run`` and protected together, the pages between them included. That changes no answer:
each mark asks only about its own whole pages, and a write to a page in between costs the writer
one fault until the protections are cleared.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

MERGE_GAP = 4 * mmap.PAGESIZE
"""Marks at most this far apart are protected by one walk."""


@dataclass
class Run:
    """Marks protected by one walk of ``[lo, hi)``, and the mappings (start, end, trusted) it
    lies in, in address order, each following the last without a hole."""

    marks: list
    vmas: list
    lo: int
    hi: int

    @property
    def alone(self) -> bool:
        """Whether a mark of it pays for a walk of its own (``Protected.alone``); a run of small
        tensors only is read instead."""
        return any(m.alone for m in self.marks)

    def spans(self):
        """(mapping, lo, hi): the part of the run in each of its mappings, to register."""
        for vma in self.vmas:
            lo, hi = max(self.lo, vma[0]), min(self.hi, vma[1])
            if lo < hi:
                yield vma[:2], lo, hi


def cut(located: list) -> list[Run]:
    """``located`` (marks in address order, each with the mappings covering its bytes, or None
    where one is not trusted: left out) cut into runs."""
    runs: list[Run] = []
    for mark, vmas in located:
        if vmas is None:
            continue
        last = runs[-1] if runs else None
        if last is not None and mark.lo - last.hi <= MERGE_GAP and _follows(last.vmas[-1], vmas[0]):
            last.marks.append(mark)
            last.vmas.extend(v for v in vmas if v[0] >= last.vmas[-1][1])
            last.hi = max(last.hi, mark.hi)
        else:
            runs.append(Run([mark], list(vmas), mark.lo, mark.hi))
    return runs


def _follows(last: tuple, first: tuple) -> bool:
    """Whether a mark starting in mapping ``first`` continues a run ending in ``last``: the same
    mapping, or the next one, without a hole between."""
    return last[:2] == first[:2] or last[1] == first[0]
