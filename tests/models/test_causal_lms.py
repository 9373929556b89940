"""GPT-J, GPT-Neo and Llama (grouped-query and multi-head, tied and untied heads) under tensor
parallelism equal single-process Hugging Face.

A failure names the architecture; look first at which quantity differs. Logits of one
architecture only -> its plan (modelparallel/models/gptj.py, gptneo.py, llama.py): a rule, or a
cached head count missing from ``per_rank_attrs``. Every architecture -> tp/styles.py. Loss only
-> tp/loss.py. Gradients only -> a style's backward. Collective counts -> the plan's ``shared_inputs`` rules
and tp/local.py (column-parallel siblings must share one input all-reduce).
"""

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode
from transformers import (GPTJConfig, GPTJForCausalLM, GPTNeoConfig, GPTNeoForCausalLM, LlamaConfig,
                          LlamaForCausalLM)

import harness
import modelparallel as smp
from reference import (all_reduces, assert_close, assert_grads_match, assert_same_training, build_pair,
                       comm_counts_by_kind)

VOCAB = 1001  # not divisible by 2 or 4: vocabulary shards are uneven, shapes must stay HF's
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gptj(layers):
    # rotary_dim 8 < head_dim 16: part of every head rotates, part passes through
    return GPTJConfig(n_embd=64, n_layer=layers, n_head=4, rotary_dim=8, n_positions=32, vocab_size=VOCAB,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **TOKENS)


def _gptneo(layers):
    # window 4 < sequence 12, so local layers really differ from global ones
    kinds = [[["global", "local"], layers // 2]] + ([[["global"], 1]] if layers % 2 else [])
    return GPTNeoConfig(hidden_size=64, num_layers=layers, num_heads=4, attention_types=kinds, window_size=4,
                        max_position_embeddings=32, vocab_size=VOCAB, resid_dropout=0.0, embed_dropout=0.0,
                        attention_dropout=0.0, **TOKENS)


def _llama(layers, kv_heads=2, tied=False, attn="eager"):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=kv_heads, max_position_embeddings=32, vocab_size=VOCAB,
                         tie_word_embeddings=tied, **TOKENS)
    config._attn_implementation = attn
    return config


ARCHS = {  # name -> (model class, config(layers), tied LM head, TP degrees that must work)
    "gptj": (GPTJForCausalLM, _gptj, False, (1, 2, 4)),
    "gptneo": (GPTNeoForCausalLM, _gptneo, True, (1, 2, 4)),
    "llama_gqa": (LlamaForCausalLM, _llama, False, (1, 2)),
    "llama_mha_tied_sdpa": (LlamaForCausalLM, lambda n: _llama(n, kv_heads=4, tied=True, attn="sdpa"), True,
                            (1, 2, 4)),
}
CASES = [(arch, tp) for arch, (_, _, _, degrees) in ARCHS.items() for tp in degrees]


def _batch(seed=1, pad=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[1, :3] = 0  # left padding in the second row
    return ids, mask


def _pair(arch, tp, layers=2):
    cls, config, _, _ = ARCHS[arch]
    return build_pair(cls, config(layers), tp)


def _check_forward_backward(arch, tp):
    """Logits, loss, gradients, full state dict and ties against HF, with padding."""
    ref, model = _pair(arch, tp)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    want = ref(ids, attention_mask=mask, labels=labels)
    got = model(ids, attention_mask=mask, labels=labels)
    assert got.logits.shape == want.logits.shape == (2, 12, VOCAB)
    assert_close(got.logits, want.logits, what=f"{arch} logits")
    assert_close(got.loss, want.loss, what=f"{arch} loss")
    want.loss.backward()
    model.backward(got.loss)
    assert_grads_match(ref, model, rerun=lambda m: m(ids, attention_mask=mask, labels=labels).loss)
    if tp > 1:  # the embedding's gradient is this rank's rows only (not a full-size Partial)
        grad = model.module.get_input_embeddings().weight.grad
        rows = torch.empty(VOCAB).chunk(tp)[smp.tp_rank()].numel()
        assert tuple(grad.placements) == (Shard(0),) and grad.to_local().shape == (rows, 64), \
            f"{arch}: embedding gradient {grad.placements}, local {tuple(grad.to_local().shape)}"
    tied = ARCHS[arch][2]
    assert (ref.lm_head.weight is ref.get_input_embeddings().weight) == tied, f"{arch}: HF's tie is not {tied}"
    head, emb = model.module.lm_head.weight, model.module.get_input_embeddings().weight
    assert (head is emb) == tied, f"{arch}: LM head tied={head is emb} after wrapping, HF tied={tied}"
    plain = model(ids, attention_mask=mask).logits
    assert type(plain) is torch.Tensor, "inference logits must be a plain tensor"
    assert_close(plain, want.logits)
    return model


def _check_generate(arch, tp):
    ref, model = _pair(arch, tp)
    ids, mask = _batch(seed=2)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=mask)
    got, want = model.generate(ids, **kw), ref.generate(ids, **kw)
    assert torch.equal(got, want), f"{arch}: generated {got[:, 12:].tolist()}, HF {want[:, 12:].tolist()}"


def _check_training_steps(arch, tp, steps=10):
    ref, model = _pair(arch, tp)
    batches = [_batch(seed=100 + step, pad=False)[0] for step in range(steps)]
    assert_same_training(ref, model, [dict(input_ids=ids, labels=ids) for ids in batches], what=f"{arch} ")


def check_all(arch, tp):
    """Every numeric check of one architecture at one degree, in one harness call (fast)."""
    model = _check_forward_backward(arch, tp)
    if arch == "llama_gqa" and tp == 2:  # per rank: 2 of 4 query heads, 1 of 2 KV heads, 16 rows each
        attn = model.module.model.layers[0].self_attn
        assert attn.q_proj.weight.to_local().shape == (32, 64) and attn.k_proj.weight.to_local().shape == (16, 64)
    _check_generate(arch, tp)
    _check_training_steps(arch, tp)


def collective_counts(arch, layers):
    """Collectives of one forward, and of one backward plus AdamW step, by kind.

    The backward is measured after a forward run outside ``CommDebugMode``: the mode installs
    full backward hooks that hand each module a fresh copy of its input, which would stop
    GPT-J's attention and MLP from sharing their one input all-reduce.
    """
    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})  # same batch on TP ranks
    cls, config, _, _ = ARCHS[arch]
    model = smp.DistributedModel(cls(config(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, _ = _batch(pad=False)
    with CommDebugMode() as fwd:
        model(ids, labels=ids)
    loss = model(ids, labels=ids).loss
    with CommDebugMode() as bwd:
        model.backward(loss)
        opt.step()
    return comm_counts_by_kind(fwd), comm_counts_by_kind(bwd)


@pytest.mark.parametrize("arch,tp", CASES, ids=[f"{a}-tp{t}" for a, t in CASES])
def test_logits_loss_grads_generate_and_training_equal_hf(arch, tp):
    harness.run(tp, check_all, arch, tp)


# all-reduces per layer backward: one per distinct input of column-parallel layers. GPT-J's
# attention and MLP read the same LayerNorm output, so they share one.
BACKWARD_PER_LAYER = {"gptj": 1, "gptneo": 2, "llama_gqa": 2}


@pytest.mark.parametrize("arch", sorted(BACKWARD_PER_LAYER))
def test_allreduces_per_layer_and_no_gather(arch):
    (f2, b2), (f3, b3) = harness.run(2, collective_counts, arch, 2)[0], harness.run(2, collective_counts, arch, 3)[0]
    assert all_reduces(f3) - all_reduces(f2) == 2, (f2, f3)
    assert all_reduces(b3) - all_reduces(b2) == BACKWARD_PER_LAYER[arch], (b2, b3)
    for counts in (f2, b2, f3, b3):
        assert not any("gather" in kind for kind in counts), counts
    # constant part: embedding + 2 small loss all-reduces forward; LM-head input gradient backward
    assert all_reduces(f2) == 2 * 2 + 3 and all_reduces(b2) == 2 * BACKWARD_PER_LAYER[arch] + 1, (f2, b2)
