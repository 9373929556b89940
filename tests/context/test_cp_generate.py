"""``generate`` under context parallelism equals one Hugging Face process: greedy tokens and every
step's scores, GPT-2 and Llama at C=2 (Llama also at C=2 x T=2), a left-padded batch.

The prompt runs context-parallel (each rank its part), the cache is then gathered whole on every
rank and the new tokens are decoded on every rank alike (``context/decode.py``). A cache that does
not keep every token (Mistral's sliding-window layers) and a prompt that does not split into 2C
chunks are refused on every rank.

Where to look: the first token wrong -> the prompt's last logits (``decode._last_logits``) or the
split of generate's position ids; later tokens wrong -> the gathered cache's order
(``finish_prefill``) or ``decode_attention``'s causal offset and padding.
"""

import copy

import pytest
import torch

import harness
import modelparallel as smp
from reference import assert_close
from test_models import VOCAB, pair

NEW = 6


def prompt():
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def check_generate(arch: str, tp: int, comm: str):
    ref, model = pair(arch, {"context_parallel_degree": 2, "tensor_parallel_degree": tp}, comm)
    ref.eval()
    model.eval()
    ids, mask = prompt()
    options = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_scores=True,
                   return_dict_in_generate=True)
    want = ref.generate(ids, attention_mask=mask, **options)
    got = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.scores, want.scores)):
        assert_close(a, b, f"{arch} scores of new token {step}")
    return got.sequences.tolist()


@pytest.mark.parametrize("arch, tp, comm", [("gpt2", 1, "p2p"), ("llama", 1, "all_gather"), ("llama", 2, "p2p")])
def test_generate_equals_one_process(arch, tp, comm):
    out = harness.run(2 * tp, check_generate, arch, tp, comm)
    assert all(o == out[0] for o in out)


def check_refused():
    smp.init({"context_parallel_degree": 2})
    errors = {}
    for arch, length in (("mistral", 8), ("llama", 6)):
        _, model = pair(arch, {"context_parallel_degree": 2})
        try:
            model.generate(prompt()[0][:, :length], max_new_tokens=2, do_sample=False, pad_token_id=0)
            errors[arch] = "none"
        except (NotImplementedError, ValueError) as e:
            errors[arch] = f"{type(e).__name__}: {e}"
    return errors


def test_sliding_window_cache_and_odd_prompt_are_refused():
    out = harness.run(2, check_refused)
    assert out[0] == out[1]
    assert "NotImplementedError: a key/value cache of DynamicSlidingWindowLayer" in out[0]["mistral"], out
    assert "ValueError: prompt length 6 is not divisible by 2 x context_parallel_degree = 4" in out[0]["llama"], out
