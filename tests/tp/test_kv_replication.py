"""KV-head replication: tensor parallelism beyond (or not dividing) the key/value heads of
grouped-query attention equals one process, and its checkpoints reshard to any degree.

A failure in ``heads_for_rank`` means a rank computes KV heads its query heads do not read
(modelparallel/tp/replicated.py). Logits right but k/v gradients wrong: the gradient of a KV
head shared by several ranks is not summed over them (``f`` on the replicated weight). A resume
test failing with the single-degree tests passing: the replicated weight's checkpoint entry is
not HF's global tensor (it must not depend on the degree).
"""

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate
from transformers import LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from state_helpers import train_steps
from modelparallel.tp.replicated import heads_for_rank
from reference import assert_close, assert_grads_match, build_pair, training_rtol

VOCAB = 101


def test_heads_for_rank_gives_each_rank_the_kv_heads_its_query_heads_read():
    # 8 query heads, 2 KV heads (4 query heads each), TP 4: two ranks per KV head
    assert [heads_for_rank(8, 2, 4, r) for r in range(4)] == [([0], 2), ([0], 2), ([1], 2), ([1], 2)]
    # one KV head (multi-query) at TP 2: both ranks hold it
    assert [heads_for_rank(4, 1, 2, r) for r in range(2)] == [([0], 2), ([0], 2)]
    # 12 query heads, 3 KV heads, TP 4: 3 query heads per rank straddle KV groups of 4 -> one copy per query head
    assert [heads_for_rank(12, 3, 4, r)[0] for r in range(4)] == [[0, 0, 0], [0, 1, 1], [1, 1, 2], [2, 2, 2]]
    assert {heads_for_rank(12, 3, 4, r)[1] for r in range(4)} == {1}
    # the degree dividing the KV heads: whole KV groups, as plain column parallelism gives
    assert [heads_for_rank(8, 4, 2, r) for r in range(2)] == [([0, 1], 2), ([2, 3], 2)]
    with pytest.raises(ValueError, match="must divide the query heads"):
        heads_for_rank(6, 2, 4, 0)


def _config(heads, kv_heads, attn="eager"):
    config = LlamaConfig(hidden_size=16 * heads, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=32, vocab_size=VOCAB,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = attn
    return config


def check_exact(tp, heads, kv_heads, attn):
    """Logits, loss, every gradient and greedy generation against one process; returns this
    rank's KV heads."""
    ref, model = build_pair(LlamaForCausalLM, _config(heads, kv_heads, attn), tp)
    k_proj = model.module.model.layers[0].self_attn.k_proj
    assert isinstance(k_proj.weight, DTensor) and k_proj.weight.placements == (Replicate(),)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    want, got = ref(ids, attention_mask=mask, labels=ids), model(ids, attention_mask=mask, labels=ids)
    assert_close(got.logits, want.logits, what="logits")
    assert_close(got.loss, want.loss, what="loss")
    want.loss.backward()
    model.backward(got.loss)
    assert_grads_match(ref, model, rerun=lambda m: m(ids, attention_mask=mask, labels=ids).loss)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=mask)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    return k_proj.__dict__["_mp_kv_heads"]


CASES = {  # name -> (tp, heads, kv heads, attention)
    "gqa_2kv_tp4": (4, 8, 2, "eager"),
    "mqa_tp2_sdpa": (2, 4, 1, "sdpa"),
    "mqa_tp4": (4, 4, 1, "eager"),
    "12heads_3kv_tp4_straddling": (4, 12, 3, "sdpa"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_replicated_kv_heads_equal_one_process(case):
    tp, heads, kv_heads, attn = CASES[case]
    got = harness.run(tp, check_exact, tp, heads, kv_heads, attn)
    assert got == [tuple(heads_for_rank(heads, kv_heads, tp, r)[0]) for r in range(tp)]


def _batch(step):
    return (torch.arange(24).reshape(2, 12) * (step + 7) + step) % VOCAB


def _train(model, optimizer, steps):
    return train_steps(model, optimizer, [_batch(step) for step in steps])


def _init(tp):
    smp.init({"tensor_parallel_degree": tp, "random_seed": 0, "prescaled_batch": True})


def _build():
    torch.manual_seed(0)
    model = smp.DistributedModel(LlamaForCausalLM(_config(8, 2)))
    return model, smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def train_and_save(tp, path):
    _init(tp)
    model, optimizer = _build()
    losses = _train(model, optimizer, range(2))
    smp.save_checkpoint(path, "step2", user_content={"step": 2})
    return losses


def resume_and_train(tp, path):
    _init(tp)
    smp.resume_from_checkpoint(path)  # applied when the model and optimizer are created
    model, optimizer = _build()
    return _train(model, optimizer, range(2, 4))


def one_process_losses():
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        ids = _batch(step)
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("save_tp,load_tp", [(4, 2), (2, 4), (4, 1)])
def test_resume_across_degrees_with_replicated_kv_heads(tmp_path, save_tp, load_tp):
    """2 KV heads: replicated at TP 4, whole per rank at TP 2 and 1; the checkpoint is the same."""
    first = harness.run(save_tp, train_and_save, save_tp, str(tmp_path))[0]
    then = harness.run(load_tp, resume_and_train, load_tp, str(tmp_path))[0]
    want = one_process_losses()
    for step, (got, ref) in enumerate(zip(first + then, want)):
        assert abs(got - ref) / abs(ref) < training_rtol(step), f"step {step}: {got} vs one process {ref}"
