"""Activation checkpointing of a context-parallel model made by SageMaker v2's ``smp.transform``:
PyTorch's ``apply_activation_checkpointing`` applied before ``transform`` (the wrappers set aside
while it shards and put back, ``activations/wrappers.py``) or after it, and Hugging Face's
``gradient_checkpointing_enable`` after it. Each trains like one HF process with the same
checkpointing on whole sequences (losses step by step, every first-step gradient; losses only
under the v2 scripts' FSDP1 call) and runs each block's region twice per step (forward + recompute).

A failure in ``transform`` ("matches no module") means the wrappers were not set aside; one run
per step, that checkpointing silently did nothing (wrappers not put back around the blocks); a
wrong loss or gradient only when checkpointed, that the recompute repeats attention's ring
exchange out of step (context/attention.py).
"""

import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import harness
import modelparallel as smp
from reference import checkpointed_alike, context_replicas_train_like_one_process, count_block_runs

VOCAB, SEQ, ROWS, STEPS = 96, 16, 2, 2
POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})


def _checkpoint(model) -> None:
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))


def checkpointed_context_parallel(when: str, tp: int, comm: str, fsdp: str = "fsdp2"):
    """``when``: "before" (PyTorch's wrappers before ``transform``), "after" (after it), "hf"
    (``gradient_checkpointing_enable`` after it); the reference is checkpointed the same way.
    ``fsdp``: FSDP2 over ``smp.dp_mesh()``, or the v2 scripts' FSDP1 call without a mesh (losses
    only: flat parameters)."""
    smp.init({"context_parallel_degree": 2, "tensor_parallel_degree": tp})
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=32, use_cache=False))
    model = checkpointed_alike(ref, lambda m: smp.transform(m, cp_comm_type=comm), when, _checkpoint)
    runs = count_block_runs(model)
    if fsdp == "fsdp1":  # either averages the gradients over the data x context ranks
        model = FSDP(model, auto_wrap_policy=POLICY, use_orig_params=True, device_id=torch.device("cpu"))
    else:
        for layer in model.model.layers:
            fully_shard(layer, mesh=smp.dp_mesh())
        fully_shard(model, mesh=smp.dp_mesh())
    g = torch.Generator().manual_seed(50)
    batches = [torch.randint(3, VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    context_replicas_train_like_one_process(ref, opt_ref, model, optimizer, lambda loss: loss.backward(), batches,
                                            grads_of=model if fsdp == "fsdp2" else None)
    assert len(runs) == 2 and all(n == 2 * STEPS for n in runs.values()), runs


@pytest.mark.parametrize("when, tp, comm, world, fsdp", [
    ("before", 1, "p2p", 2, "fsdp2"),
    ("before", 2, "all_gather", 4, "fsdp2"),
    ("before", 2, "p2p", 4, "fsdp1"),
    ("after", 1, "p2p", 2, "fsdp2"),
    ("hf", 1, "all_gather", 2, "fsdp2"),
])
def test_checkpointed_context_parallel_trains_like_one_process(when, tp, comm, world, fsdp):
    harness.run(world, checkpointed_context_parallel, when, tp, comm, fsdp)
