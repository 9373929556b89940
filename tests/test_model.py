"""DistributedModel's state dicts: full and local, loads across TP degrees, and refusals that
leave the model untouched.

A failure means modelparallel/state_dict.py (or DistributedModel's wrappers in model.py) is
wrong. References are untouched single-process HF models.
"""

import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import harness
import modelparallel as smp
from reference import build_pair, assert_close


def cfg():
    return GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=16, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


IDS = torch.arange(20).reshape(2, 10) * 5 % 101


def export_full(tp):
    ref, model = build_pair(GPT2LMHeadModel, cfg(), tp, seed=3)
    sd = model.state_dict()
    only0 = model.state_dict(gather_to_rank0=True)
    assert (only0 == {}) == (smp.rank() != 0)
    hf = ref.state_dict()
    for key, t in sd.items():
        assert t.numel() == hf[key].numel() and torch.equal(t.reshape(hf[key].shape), hf[key]), key
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"], "tied tensor gathered once"
    return sd, ref(IDS).logits.detach()


def load_full(tp, sd, want):
    smp.init({"tensor_parallel_degree": tp, "random_seed": 99})
    model = smp.DistributedModel(GPT2LMHeadModel(cfg()))
    before = model(IDS).logits
    assert not torch.allclose(before, want), "fresh model already equal: the load would prove nothing"
    sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # tie: one key is enough
    result = model.load_state_dict(sd)
    assert result.missing_keys == [] and result.unexpected_keys == [], result  # the tie supplies lm_head
    assert_close(model(IDS).logits, want)


def local_round_trip(tp):
    _, model = build_pair(GPT2LMHeadModel, cfg(), tp, seed=3)
    local = {k: v.clone() for k, v in model.local_state_dict().items()}
    want = model(IDS).logits
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(local, same_partition_load=True)
    torch.testing.assert_close(model(IDS).logits, want)
    try:
        model.load_state_dict(model.state_dict(), same_partition_load=True)
    except ValueError as e:
        return str(e)


def refuse_bad(tp):
    _, model = build_pair(GPT2LMHeadModel, cfg(), tp, seed=3)
    good = model.state_dict()
    want = model(IDS).logits
    bad = {k: torch.zeros_like(v) for k, v in good.items()}
    bad["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(64, 255)
    bad["transformer.h.9.attn.c_attn.weight"] = torch.zeros(1)
    errors = []
    try:
        model.load_state_dict(bad)
    except ValueError as e:
        errors.append(str(e))
    torch.testing.assert_close(model(IDS).logits, want)  # nothing half-loaded
    partial = {k: v for k, v in good.items() if "h.0.ln_1" not in k}
    try:
        model.load_state_dict(partial)
    except ValueError as e:
        errors.append(str(e))
    missing = model.load_state_dict(partial, strict=False).missing_keys
    return errors, missing


def test_full_state_dict_has_hf_values_and_loads_at_any_degree():
    sd, want = harness.run(2, export_full, 2)[0]
    assert tuple(sd["transformer.wte.weight"].shape) == (101, 64), "vocab padding must not leak"
    for tp in (1, 2, 4):
        harness.run(tp, load_full, tp, sd, want)


def test_local_state_dict_same_partition_load():
    for msg in harness.run(2, local_round_trip, 2):
        assert "same_partition_load expects this rank's shard" in msg


def test_bad_state_dicts_refused_without_half_loading():
    (errors, missing) = harness.run(2, refuse_bad, 2)[0]
    assert "transformer.h.1.mlp.c_fc.weight: expected shape (64, 256)" in errors[0]
    assert "found (64, 255)" in errors[0] and "transformer.h.9.attn.c_attn.weight" in errors[0]
    assert "missing keys ['transformer.h.0.ln_1.bias', 'transformer.h.0.ln_1.weight']" in errors[1]
    assert missing == ["transformer.h.0.ln_1.bias", "transformer.h.0.ln_1.weight"]


def dp_tp_training(steps=3):
    """TP=2 x RDP=2: each replica (both its TP ranks) sees half the batch; gradients averaged over
    rdp equal HF's on all. The TP ranks bringing the same rows is the prescaled-batch layout; with
    prescaled_batch false (the default) the group computes on the union of identical halves,
    which has the same mean loss."""
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg())
    model = smp.DistributedModel(copy.deepcopy(ref))
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        batch = (torch.arange(40).reshape(4, 10) * (step + 3)) % 101
        ref(batch, labels=batch).loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        half = batch[2 * smp.rdp_rank(): 2 * smp.rdp_rank() + 2]
        model.backward(model(half, labels=half).loss)
        opt.step()
        opt.zero_grad()
    assert_close(model(IDS).logits, ref(IDS).logits)


def test_data_parallel_replicas_average_gradients():
    harness.run(4, dp_tp_training)
