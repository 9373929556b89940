"""A v1 resume into parameters a load cannot write, on 2 ranks (TP=2): one still on the meta
device (a delayed-init model not yet materialized: the load "succeeded" and left it unset) or
an expanded view (a bare RuntimeError after the other parameters were already overwritten).
Partial and full checkpoints, staged in memory or through the undo journal, the bad parameter
on both ranks or on rank 1 only: every rank must raise naming the parameter, and no parameter
may change.

A failure points at ``load/staging.py``'s ``unwritable`` (called by ``begin``) or at the
``staging.agreed`` phase around ``begin`` in ``load/partial_load.py`` / ``load/full_load.py``.
"""

import pytest
import torch

import harness
import modelparallel as smp
from ckpt_helpers import build, error_of
from modelparallel.tp.layout import local_part


def resume_into(path: str, kind: str, partial: bool, staging: str, only_rank1: bool) -> tuple[str, list[str]]:
    build()
    smp.save_checkpoint(path, "a", partial=partial)
    model, _ = build(seed=1)
    ln_f = model.module.transformer.ln_f
    if smp.rank() == 1 or not only_rank1:
        w = torch.empty(16, device="meta") if kind == "meta" else torch.zeros(1).expand(16)
        ln_f.weight = torch.nn.Parameter(w)
    before = {k: local_part(v).clone() for k, v in model.module.state_dict().items() if not local_part(v).is_meta}
    msg = error_of(smp.resume_from_checkpoint, path, tag="a", partial=partial, load_optimizer=False,
                   staging=staging)
    after = model.module.state_dict()
    return msg, [k for k in before if not torch.equal(before[k], local_part(after[k]))]


@pytest.mark.parametrize("kind,says", [("meta", "a tensor on the meta device"), ("expanded", "an expanded view")])
def test_a_resume_into_parameters_it_cannot_write_is_refused(tmp_path, kind, says):
    for i, (partial, staging, only_rank1) in enumerate([(True, "memory", False), (False, "memory", True),
                                                        (True, "journal", True), (False, "journal", False)]):
        for msg, changed in harness.run(2, resume_into, str(tmp_path / str(i)), kind, partial, staging, only_rank1):
            assert f"a load cannot write into transformer.ln_f.weight: {says}" in msg, msg
            assert changed == [], f"a refused resume changed {changed}"
