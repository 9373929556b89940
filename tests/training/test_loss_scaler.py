"""The loss scalers' rules alone (no collectives, no model): SageMaker's defaults, argument
checks naming the bad key, the minimum scale, hysteresis (``delayed_shift``,
``consecutive_hysteresis``), growth after ``scale_window`` good steps, the static scaler, and
overflow detection without a process group. References are trajectories worked out by hand
from the documented rules.

A failure points at modelparallel/training/loss_scaler.py. (The scalers inside
``DistributedOptimizer``, agreeing over ranks, are tested in tests/test_optimizer.py.)
"""

import pytest
import torch

from modelparallel.training.loss_scaler import DynamicLossScaler, LossScaler


def _run(scaler, outcomes):
    scales = []
    for overflow in outcomes:
        scaler.update_scale(overflow)
        scales.append(scaler.loss_scale)
    return scales


def test_unknown_dynamic_key_named():
    with pytest.raises(ValueError, match="scale_windw"):
        DynamicLossScaler.from_args({"scale_windw": 10, "min_scale": 2.0})


def test_invalid_dynamic_values_listed():
    with pytest.raises(ValueError, match="(?s)scale_factor.*scale_window"):
        DynamicLossScaler.from_args({"scale_factor": 1.0, "scale_window": 0})


def test_defaults_are_sagemakers():
    s = DynamicLossScaler.from_args(None)
    assert (s.loss_scale, s.scale_factor, s.scale_window, s.min_scale, s.delayed_shift,
            s.consecutive_hysteresis) == (2.0 ** 32, 2.0, 1000, 1.0, 1, False)


def test_scale_never_below_min_scale():
    s = DynamicLossScaler(init_scale=8.0, min_scale=2.0)
    assert _run(s, [True] * 4) == [4.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize("consecutive, want", [
    # overflow(hyst 2->1) good overflow: without consecutive_hysteresis the good step does not
    # reset the counter, so the second overflow halves; with it, the counter is back at 2.
    (False, [8.0, 8.0, 4.0]),
    (True, [8.0, 8.0, 8.0]),
])
def test_consecutive_hysteresis(consecutive, want):
    s = DynamicLossScaler(init_scale=8.0, delayed_shift=2, consecutive_hysteresis=consecutive)
    assert _run(s, [True, False, True]) == want


def test_growth_resets_hysteresis():
    # hysteresis 2: overflow (2->1), good, good (window 2: grow to 16, counter back to 2),
    # overflow (2->1, kept), overflow (halves)
    s = DynamicLossScaler(init_scale=8.0, scale_window=2, delayed_shift=2)
    assert _run(s, [True, False, False, True, True]) == [8.0, 8.0, 16.0, 16.0, 8.0]


def test_static_scaler_never_moves_and_round_trips():
    s = LossScaler(4.0)
    assert _run(s, [True, False, True]) == [4.0] * 3
    t = DynamicLossScaler(init_scale=2.0 ** 20)
    t.load_state_dict(s.state_dict())
    assert t.loss_scale == 4.0 and t.good_steps == 0


def test_has_overflow_without_process_group():
    s = LossScaler()
    assert not s.has_overflow([torch.ones(3), None])
    assert s.has_overflow([torch.ones(3), torch.tensor([1.0, float("nan")])])
