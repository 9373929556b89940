"""One load-report type for every load: it unpacks like torch's pair and keeps its shape mismatches.

A failure means ``LoadReport`` (modelparallel/materialize/state_dict.py) lost a field on the way
between ranks (reports travel through ``all_gather_object``) or no longer unpacks as
``missing, unexpected = model.load_state_dict(...)`` does for a plain ``nn.Module``.
"""

import pickle

import torch
from torch import nn

import modelparallel as smp
from modelparallel.checkpoint import LoadReport
from modelparallel.materialize.state_dict import load_state_dict


def test_unpacks_like_torchs_pair():
    module, state = nn.Linear(2, 2), {"weight": torch.zeros(2, 2), "extra": torch.zeros(1)}
    theirs = nn.Linear(2, 2).load_state_dict(state, strict=False)
    ours = load_state_dict(module, state, strict=False)
    missing, unexpected = ours
    assert (missing, unexpected) == tuple(theirs) == (["bias"], ["extra"])
    assert (ours.missing_keys, ours.unexpected_keys) == (theirs.missing_keys, theirs.unexpected_keys)
    assert ours.mismatched_shapes == []


def test_mismatches_survive_pickling_and_count_in_equality():
    report = LoadReport(["a"], [], ["w: checkpoint (2,), model (3,)"])
    back = pickle.loads(pickle.dumps(report))
    assert back == report and back.mismatched_shapes == ["w: checkpoint (2,), model (3,)"]
    assert back.mismatched_keys == {"w"}
    assert report != LoadReport(["a"], [])
    assert "mismatched_shapes=['w: checkpoint (2,), model (3,)']" in repr(report)
    assert report.problems("model") == ["model: missing keys (in the model, not in the checkpoint): ['a']",
                                        "model: shape mismatch w: checkpoint (2,), model (3,)"]


def test_the_api_names_one_type():
    assert smp.checkpoint.LoadReport is LoadReport
