"""Shared pieces of the checkpoint tests: a tiny trained GPT-2 at TP=2, a full snapshot of
everything a resume may change (model, optimizer state and hyperparameters, loss scaler), and
helpers to read an error message or act on rank 0 only.

Not a test module: imported by the tests of this directory (and run inside their ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel

import modelparallel as smp
from modelparallel.checkpoint.safety import commit


def cfg(vocab: int = 64, **kw) -> GPT2Config:
    base = dict(n_embd=16, n_layer=1, n_head=2, vocab_size=vocab, n_positions=8, bos_token_id=0, eos_token_id=0)
    return GPT2Config(**{**base, **kw})


def build(seed: int = 0, tp: int = 2, steps: int = 1, optimizer_cls=torch.optim.AdamW, init: bool = True,
          groups: int = 1, **cfg_kw):
    """A DistributedModel and DistributedOptimizer that took ``steps`` steps (so the optimizer
    has state); ``seed`` changes the initial weights; ``groups=2`` gives the optimizer two
    parameter groups (the first parameter, the rest). ``init=False`` builds in the running job
    (each ``smp.init`` makes new process groups, whose threads live as long as the process)."""
    if init:
        smp.init({"tensor_parallel_degree": tp, "random_seed": seed})
    else:
        torch.manual_seed(seed)
    model = smp.DistributedModel(GPT2LMHeadModel(cfg(**cfg_kw)))
    params = list(model.parameters())
    split = [params] if groups == 1 else [params[:1], params[1:]]
    optimizer = smp.DistributedOptimizer(optimizer_cls([{"params": p} for p in split], lr=1e-2))
    vocab = model.module.config.vocab_size
    for step in range(steps):
        ids = (torch.arange(8).reshape(1, 8) * (step + seed + 1)) % vocab
        model.backward(model(ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _local(t):
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(model, optimizer=None) -> dict:
    """This rank's copy of everything a resume may change (no collective): every model tensor,
    every optimizer slot, the hyperparameters and the loss scaler's state."""
    out = {f"model/{k}": _local(v) for k, v in model.module.state_dict(keep_vars=True).items()}
    if optimizer is not None:
        names = {id(p): n for n, p in model.module.named_parameters()}
        for p, slots in optimizer.optimizer.state.items():
            out.update({f"optim/{names[id(p)]}/{k}": _local(v) if isinstance(v, torch.Tensor) else v
                        for k, v in slots.items()})
        for i, group in enumerate(optimizer.optimizer.param_groups):
            out.update({f"group{i}/{k}": v for k, v in group.items() if k != "params"})
        out.update({f"scaler/{k}": v for k, v in optimizer.loss_scaler.state_dict().items()})
    return out


def changed(before: dict, after: dict) -> list[str]:
    """Keys whose value differs (tensors bit for bit), or that appeared or vanished."""
    keys = sorted(set(before) | set(after))

    def same(a, b):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
                and torch.equal(a, b)
        return a == b

    return [k for k in keys if k not in before or k not in after or not same(before[k], after[k])]


def error_of(fn, *args, **kwargs) -> str:
    """``"Type: message"`` of what ``fn`` raises (the test fails if it raises nothing)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the tests read the message
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{getattr(fn, '__name__', fn)} raised nothing")


def on_rank0(fn) -> None:
    """Run ``fn`` on rank 0 only, then wait for it on every rank."""
    if smp.rank() == 0:
        fn()
    smp.barrier()


def refresh_manifest(directory: Path, **changes) -> None:
    """What a forger with write access does: recompute every listed regular file's size and
    CRC32 (and the user content's), then apply ``changes``."""
    m = json.loads((directory / commit.MANIFEST).read_text())
    m["files"] = {f: commit.file_checksum(directory / f) for f in commit.data_files(directory)
                  if (directory / f).is_file() and not (directory / f).is_symlink()}
    if "user_content" in m and (directory.parent / m["user_content"]["file"]).is_file():
        m["user_content"].update(commit.file_checksum(directory.parent / m["user_content"]["file"]))
    m.update(changes)
    (directory / commit.MANIFEST).write_text(json.dumps(m))


def rewrite_metadata(metadata_file: Path, fn) -> None:
    """Apply ``fn`` to a DCP ``.metadata`` (our own file, unpickled freely here) and write it back."""
    import pickle

    md = pickle.loads(metadata_file.read_bytes())
    fn(md)
    metadata_file.write_bytes(pickle.dumps(md))
