"""Every built-in decoder under context parallelism equals one Hugging Face process on the whole
sequences: logits (gathered back), loss (the mean of the ranks' shares), every gradient (averaged
over the context ranks), and five AdamW steps; at C=2 and C=4, with both communication types, and
composed with tensor parallelism (C=2 x T=2).

Llama runs grouped-query attention (4 query heads, 2 key/value heads), GPT-2 learned positions,
GPT-J partial rotary embeddings, GPT-Neo unscaled attention with local (windowed) layers, Mistral
a sliding window shorter than a chunk pair. Labels hold ignored (-100) tokens, some at chunk
boundaries.

Where to look: every architecture wrong -> context/inputs.py (positions, shifted labels, the
loss share) or attention.py; one architecture -> its CONTEXT in models/<arch>.py and
context/hf.py (the interface function or the method adapter); only with TP -> parallelize.py's
order; only the training steps -> the gradient average over the data x context ranks.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import (GPT2Config, GPT2LMHeadModel, GPTJConfig, GPTJForCausalLM, GPTNeoConfig,
                          GPTNeoForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM)

import harness
import modelparallel as smp
from modelparallel import runtime
from reference import _assert_module_grads_match, assert_close, training_rtol

VOCAB = 96  # divisible by 2: TP shards are even (FSDP1 over uneven TP shards is another matter)
SEQ = 16  # 2 x C chunks at C = 2 and 4
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama():
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=32, vocab_size=VOCAB, **TOKENS)


def _mistral():
    return MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, sliding_window=5, vocab_size=VOCAB,
                         **TOKENS)


def _gpt2():
    return GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_by_inverse_layer_idx=True, **TOKENS)


def _gptj():
    return GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32, vocab_size=VOCAB,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **TOKENS)


def _gptneo():
    return GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                        window_size=3, max_position_embeddings=32, vocab_size=VOCAB, resid_dropout=0.0,
                        embed_dropout=0.0, attention_dropout=0.0, **TOKENS)


ARCHS = {"llama": (LlamaForCausalLM, _llama), "mistral": (MistralForCausalLM, _mistral),
         "gpt2": (GPT2LMHeadModel, _gpt2), "gptj": (GPTJForCausalLM, _gptj), "gptneo": (GPTNeoForCausalLM, _gptneo)}


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [2, SEQ] and labels with ignored tokens, one at a chunk boundary at C = 2."""
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, 4] = labels[1, 9] = labels[1, 12] = -100  # 4: the first token of chunk 1 at C = 2
    return ids, labels


def pair(arch: str, config: dict, comm: str = "p2p"):
    """(reference HF model, the same model transformed under ``config``)."""
    smp.init(config)
    cls, make = ARCHS[arch]
    torch.manual_seed(0)
    ref = cls(make())
    return ref, smp.transform(copy.deepcopy(ref), cp_comm_type=comm)


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    return smp.gather_sequence(logits.full_tensor() if isinstance(logits, DTensor) else logits)


def cp_mean(t: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over the context-parallel group."""
    t = t.detach().clone()
    dist.all_reduce(t, group=smp.get_cp_process_group())
    return t / smp.cp_size()


def average_grads(model: torch.nn.Module) -> None:
    """Average gradients over the data x context ranks, as the caller's data parallelism would."""
    group = runtime.current().group(runtime.DP_CP_GROUP)
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=group)
            g /= smp.cp_size() * smp.rdp_size()


def check_forward_backward(arch: str, cp: int, tp: int, comm: str):
    ref, model = pair(arch, {"context_parallel_degree": cp, "tensor_parallel_degree": tp}, comm)
    ids, labels = batch(1)
    want = ref(ids, labels=labels)
    mine = smp.get_batch_for_cp_rank((ids, labels))
    got = model(input_ids=mine[0], labels=mine[1])
    assert got.logits.shape[1] == SEQ // cp
    assert_close(full_logits(got.logits), want.logits, f"{arch} logits", terms=SEQ)
    assert_close(cp_mean(got.loss), want.loss, f"{arch} loss")
    want.loss.backward()
    got.loss.backward()
    average_grads(model)
    ref_ids, ref_labels = ids, labels
    _assert_module_grads_match(ref, model, rerun=lambda m: m(ref_ids, labels=ref_labels).loss)
    plain = model(input_ids=mine[0]).logits  # without labels: no loss, plain logits
    assert type(plain) is torch.Tensor
    assert_close(smp.gather_sequence(plain), want.logits, f"{arch} logits without labels", terms=SEQ)


def check_training(arch: str, cp: int, tp: int, comm: str, steps: int = 5):
    ref, model = pair(arch, {"context_parallel_degree": cp, "tensor_parallel_degree": tp}, comm)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        ids, labels = batch(100 + step)
        want = ref(ids, labels=labels).loss
        want.backward()
        mine = smp.get_batch_for_cp_rank((ids, labels))
        loss = model(input_ids=mine[0], labels=mine[1]).loss
        loss.backward()
        average_grads(model)
        for opt_ in (opt_ref, opt):
            opt_.step()
            opt_.zero_grad()
        mean = cp_mean(loss).item()
        rel = abs(mean - want.item()) / abs(want.item())
        assert rel < training_rtol(step), f"{arch} step {step}: loss {mean} vs one process {want.item()}"


CASES = [pytest.param("llama", 2, 1, "p2p", marks=pytest.mark.smoke), ("llama", 2, 1, "all_gather"), ("llama", 4, 1, "p2p"), ("llama", 4, 1, "all_gather"),
         ("gpt2", 2, 1, "p2p"), ("gpt2", 4, 1, "all_gather"), ("gptj", 2, 1, "p2p"), ("gptneo", 2, 1, "p2p"),
         ("gptneo", 4, 1, "p2p"), ("mistral", 2, 1, "all_gather"), ("mistral", 4, 1, "p2p"),
         ("llama", 2, 2, "p2p"), ("gpt2", 2, 2, "all_gather")]


@pytest.mark.parametrize("arch, cp, tp, comm", CASES)
def test_forward_backward_equal_one_process(arch, cp, tp, comm):
    harness.run(cp * tp, check_forward_backward, arch, cp, tp, comm)


@pytest.mark.parametrize("arch, cp, tp, comm", [("llama", 2, 1, "p2p"), ("gpt2", 2, 1, "all_gather"),
                                                ("llama", 2, 2, "all_gather")])
def test_five_adamw_steps_equal_one_process(arch, cp, tp, comm):
    harness.run(cp * tp, check_training, arch, cp, tp, comm)
