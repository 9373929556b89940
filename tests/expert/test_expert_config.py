"""``MoEConfig`` (SageMaker v2's ``torch.sagemaker.moe.moe_config.MoEConfig``): every field and
value is honoured or refused by name, before any collective.

A failure here means modelparallel/expert/config.py accepts a value it cannot honour (or refuses
one it honours), or its messages stopped naming the field.
"""

import pytest

from modelparallel.expert.config import LOAD_BALANCING, MoEConfig


def test_sagemaker_fields_and_defaults():
    config = MoEConfig(smp_moe=True, random_seed=12345, moe_load_balancing="sinkhorn", global_token_shuffle=False,
                       moe_all_to_all_dispatcher=True, moe_aux_loss_coeff=0.001, moe_z_loss_coeff=0.001,
                       use_cpu_initialization=False)
    assert config == MoEConfig()
    assert LOAD_BALANCING == ("aux_loss", "sinkhorn", "balanced", "none")
    for value in ("aux_loss", "sinkhorn", "none"):
        assert MoEConfig(moe_load_balancing=value).moe_load_balancing == value


@pytest.mark.parametrize("kwargs, error, fragment", [
    (dict(moe_load_balancing="balanced"), NotImplementedError, "moe_load_balancing='balanced'"),
    (dict(global_token_shuffle=True), NotImplementedError, "global_token_shuffle=True"),
    (dict(moe_load_balancing="topk"), ValueError, "moe_load_balancing='topk': expected one of"),
    (dict(moe_z_loss_coeff=-0.1), ValueError, "moe_z_loss_coeff=-0.1 must be >= 0"),
    (dict(moe_aux_loss_coeff="0.1"), ValueError, "moe_aux_loss_coeff='0.1' must be a number"),
    (dict(smp_moe=1), ValueError, "smp_moe=1 must be a bool"),
    (dict(random_seed=1.5), ValueError, "random_seed=1.5 must be an int"),
])
def test_refused_by_name(kwargs, error, fragment):
    with pytest.raises(error) as info:
        MoEConfig(**kwargs)
    assert fragment in str(info.value), str(info.value)
