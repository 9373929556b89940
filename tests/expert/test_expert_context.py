"""Expert parallelism with context parallelism equals one HF process on the whole batch.

ep 2 x cp 2 at world 4: the two data-parallel ranks split the rows and form one expert-parallel
group (each holds 2 of the 4 experts); each one's context-parallel pair splits its sequences
and holds the same experts. Tokens travel to their experts within the expert-parallel group at
one context-parallel position; dense gradients are averaged over the 4 data x context ranks,
expert gradients over the 2 ranks holding the same experts (the context-parallel pair). HF's
router without the auxiliary loss routes each token on its own, so the split changes nothing.

Where to look: expert gradients off by a factor of 2 -> the experts' replica mesh
(``Topology.expert_replica_mesh``, "edp" x "cp") in model_grads.py's averaging, training/fsdp.py or
sagemaker/v2/fsdp1.py; a hang or a shape error in the dispatch -> the all-to-all must stay on
``Topology.ep_mesh`` (one cp position).
"""

import copy
import functools

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

import harness
import modelparallel as smp
from modelparallel.expert import is_expert_parallel
from moe_reference import VOCAB, mixtral_config
from reference import context_replicas_train_like_one_process

SEQ, ROWS, STEPS = 16, 4, 3
CONFIG = {"expert_parallel_degree": 2, "context_parallel_degree": 2}
OPTIMIZERS = {"sgd": functools.partial(torch.optim.SGD, lr=0.5), "adamw": functools.partial(torch.optim.AdamW, lr=1e-2)}


def _reference() -> MixtralForCausalLM:
    config = mixtral_config()
    config.output_router_logits = False  # HF's router alone: each token routed on its own
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(70 + step))


def train_like_one_process(ref, model, optimizer, backward, make_opt, grads_of=None):
    """``make_opt`` on one process against ``model`` on every layout's share of the same batches;
    with ``grads_of`` (the parallelized module) the first step's gradients too."""
    context_replicas_train_like_one_process(ref, make_opt(ref.parameters()), model, optimizer, backward,
                                            [_batch(s) for s in range(STEPS)], grads_of)


def check_v1(optimizer: str, config: dict):
    smp.init({**CONFIG, **config})
    assert smp.rdp_size() == 2 and smp.state.ep_size == 2 and smp.cp_size() == 2
    ref = _reference()
    model = smp.DistributedModel(copy.deepcopy(ref))
    opt = smp.DistributedOptimizer(OPTIMIZERS[optimizer](model.parameters()))
    train_like_one_process(ref, model, opt, model.backward, OPTIMIZERS[optimizer], grads_of=model.module)


@pytest.mark.parametrize("optimizer, config", [
    ("sgd", {}),  # replicated: DistributedModel's averages over dp x cp and over the experts' cp pair
    ("adamw", {"sharded_data_parallel_degree": 4}),  # FSDP2: experts sharded over their cp pair
], ids=["sgd_replicated", "adamw_fsdp2"])
def test_v1(optimizer, config):
    harness.run(4, check_v1, optimizer, config)


def check_v2(fsdp: str, optimizer: str):
    smp.init(CONFIG)
    ref = _reference()
    model = smp.transform(copy.deepcopy(ref))
    grads_of = None
    if fsdp == "fsdp1":  # as v2 scripts call it: no mesh; the experts are set apart and sharded
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MixtralDecoderLayer})
        model = FSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
    else:  # the experts over the ranks holding them, the rest over every data x context rank
        for experts in [m for m in model.modules() if is_expert_parallel(m)]:
            fully_shard(experts, mesh=smp.expert_dp_mesh())
        for layer in model.model.layers:
            fully_shard(layer, mesh=smp.dp_mesh())
        fully_shard(model, mesh=smp.dp_mesh())
        grads_of = model
    opt = OPTIMIZERS[optimizer](model.parameters())
    train_like_one_process(ref, model, opt, lambda loss: loss.backward(), OPTIMIZERS[optimizer], grads_of)


@pytest.mark.parametrize("fsdp, optimizer", [("fsdp1", "adamw"), ("fsdp2", "sgd")])
def test_v2(fsdp, optimizer):
    harness.run(4, check_v2, fsdp, optimizer)
