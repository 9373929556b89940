"""The jobs the combination tests run on harness ranks (a v1 job at a layout, its state gathered
by Hugging Face name, one step) and the helpers that merge and compare what the ranks return.

Kept apart from the tests so that both combination files (``test_combination_review.py``,
``test_combination_accumulation.py``) run the same tiny models, batches and comparisons.
"""

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import modelparallel as smp
from reference import gathered

VOCAB = 64
LR = {"AdamW": 1e-2, "SGD": 1e-1}
SCALING = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0 ** 8, "scale_window": 2}}
"""fp16's dynamic loss scale, small enough that no step of these tiny models overflows, growing every
second step: the counter of good steps must survive the resume for the scale to grow on time."""


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def _llama():
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=16, tie_word_embeddings=False))


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _batch(step: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (4, 8), generator=torch.Generator().manual_seed(10 + step))


@smp.step
def _train_step(model, ids):
    out = model(ids, labels=ids)
    model.backward(out.loss)
    return out.loss


def _full(t):
    return gathered(t.detach()).clone()


def _job(layout: dict, dtype: str, arch: str, opt_name: str, opt_kwargs: dict, seed: int):
    smp.init({**layout, "fp16": dtype == "fp16", "bf16": dtype == "bf16", "random_seed": seed})
    torch.manual_seed(seed)
    model = smp.DistributedModel(MODELS[arch]())
    inner = getattr(torch.optim, opt_name)(model.parameters(), lr=LR[opt_name], **opt_kwargs)
    opt = smp.DistributedOptimizer(inner, **(SCALING if dtype == "fp16" else {}))
    return model, opt


def _state(model, opt) -> dict:
    """What this rank's stage holds, gathered over its tensor-parallel group (a collective there),
    by Hugging Face name: the stepped fp32 tensor (master or parameter), the model's parameter,
    the optimizer's slots."""
    out = {"params": {}, "stepped": {}, "slots": {}, "scaler": dict(opt.loss_scaler.state_dict())}
    for name, p in model.module.named_parameters():
        master = opt.master_weights.master_of(p)
        out["params"][name] = _full(p)
        out["stepped"][name] = _full(p if master is None else master)
        out["slots"][name] = {k: _full(v) if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
    return out


def _step(model, opt, step: int) -> dict:
    """One step; returns the mean loss over the data-parallel replicas, the gradients the optimizer
    is given (gathered, in the model's dtype, still multiplied by the loss scale), that scale,
    and the state after the step."""
    loss = _train_step(model, _batch(step)).reduce_mean().detach().float()
    dist.all_reduce(loss)
    loss /= dist.get_world_size()
    grads = {n: _full(p.grad) for n, p in model.module.named_parameters()}
    scale = opt.loss_scaler.loss_scale
    opt.step()
    overflow = opt.overflow
    opt.zero_grad()
    return {"loss": loss.item(), "grads": grads, "scale": scale, "overflow": overflow, "after": _state(model, opt)}


def save_then_go_on(path, layout, dtype, arch, opt_name, opt_kwargs, async_save):
    model, opt = _job(layout, dtype, arch, opt_name, opt_kwargs, seed=1)
    for step in range(3):
        _step(model, opt, step)
    smp.save_checkpoint(path, tag="s3", model=model, optimizer=opt, async_save=async_save)
    saved = _state(model, opt)
    for step in range(3, 5):  # changes what an asynchronous save must not see
        _step(model, opt, step)
    smp.wait_for_checkpoints()
    return saved


def resume_and_train(path, layout, dtype, arch, opt_name, opt_kwargs):
    model, opt = _job(layout, dtype, arch, opt_name, opt_kwargs, seed=7)  # other weights: the resume replaces them
    smp.resume_from_checkpoint(path, tag="s3")
    loaded = _state(model, opt)
    return loaded, [_step(model, opt, step) for step in range(3, 5)]


def _merged(per_rank: list[dict]) -> dict:
    """Every stage's part as one dict (ranks of a stage hold the same values): the by-name entries
    united, the rest rank 0's."""
    return {k: ({n: t for r in per_rank for n, t in r[k].items()} if k in BY_NAME else
                _merged([r[k] for r in per_rank]) if k == "after" else v) for k, v in per_rank[0].items()}


BY_NAME = ("params", "stepped", "slots", "grads", "initial", "weights")


def _assert_equal(got, want, what):
    assert got.dtype == want.dtype and torch.equal(got, want), \
        f"{what}: max difference {(got.double() - want.double()).abs().max().item()}"


def _hf(t, like):
    return t.reshape(like.shape)  # packed GPT-2 c_attn [in, 3, out/3] is HF's [in, out] reshaped
