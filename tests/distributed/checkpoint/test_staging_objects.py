"""The serialized non-tensor entries an asynchronous v2 save reuses from its last save
(``staging.plain_form``, ``staging.stage``'s ``serialized`` cache): reused only for exactly the
same plain value, so what is written always loads back as the value of this save. Compared with
the values themselves, read back with ``torch.load``. One process, no collectives.

A failure means modelparallel/distributed/checkpoint/staging.py reuses bytes of another value
(``1`` for ``True``, ``0.0`` for ``-0.0``, an old learning rate), or serializes objects with its
cache for a planner that serializes them its own way.
"""

import copy
import io
import math

import pytest
import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from modelparallel.checkpoint.background.stager import Stager
from modelparallel.distributed.checkpoint.staging import plain_form, stage


def _stage(state_dict: dict, stager: Stager, planner=None) -> dict:
    """fqn -> the value each non-tensor entry's staged bytes load as."""
    planner = planner or DefaultSavePlanner()
    planner.set_up_planner(state_dict=state_dict, is_coordinator=True)
    plan = planner.create_local_plan()
    staged = stage(planner, plan, stager)
    return {item.index.fqn: torch.load(io.BytesIO(staged[item.index]), weights_only=True)
            for item in plan.items if item.type == WriteItemType.BYTE_IO}


@pytest.mark.parametrize("a, b", [(1, True), (1, 1.0), (0.0, -0.0), ((1, 2), [1, 2]), ("1", 1), (None, False),
                                  (0.1, math.nextafter(0.1, 1.0))])
def test_plain_form_tells_values_apart(a, b):
    assert plain_form(a) is not None and plain_form(b) is not None
    assert plain_form(a) != plain_form(b)
    assert plain_form(a) == plain_form(copy.deepcopy(a))


def test_plain_form_refuses_other_objects():
    for obj in ({"a": 1}, torch.tensor(1.0), object(), (1, {"a": 1}), [1, object()]):
        assert plain_form(obj) is None


def test_reused_only_for_the_same_value():
    stager = Stager()
    lr = _stage({"lr": 0.1, "betas": (0.9, 0.999), "flag": 1, "z": 0.0, "w": torch.ones(3)}, stager)
    assert lr == {"lr": 0.1, "betas": (0.9, 0.999), "flag": 1, "z": 0.0}
    again = {"lr": 0.2, "betas": (0.9, 0.999), "flag": True, "z": -0.0, "w": torch.ones(3)}
    got = _stage(again, stager)
    assert got["lr"] == 0.2 and got["betas"] == (0.9, 0.999)
    assert type(got["flag"]) is bool and got["flag"] is True
    assert math.copysign(1.0, got["z"]) == -1.0
    cached = stager.serialized["betas"][1]
    _stage(again, stager)
    assert stager.serialized["betas"][1] is cached  # the same value: its bytes reused


def test_own_planner_serialization_not_cached():
    class Upper(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            return super().transform_object(write_item, object.upper() if isinstance(object, str) else object)

    stager = Stager()
    assert _stage({"name": "a"}, stager, Upper()) == {"name": "A"}
    assert stager.serialized == {}
