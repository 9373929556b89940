"""One device, world size 1: the library against plain PyTorch on the same device and numerics.

Every test runs on "cpu" (gloo) here and on "cuda" (NCCL, ``cuda:0``; marked ``gpu``, skipped
without CUDA) on a GPU machine, with the same body; ``MODELPARALLEL_DEVICE`` picks the device, as
it would for a user. A failure on cuda only means a tensor the library makes is left on the CPU
(look at ``modelparallel/devices.py`` and the call named in the error), or a CUDA-only path
(pinned staging, offload copies, NCCL collectives) changed values. A numerical mismatch on both
means the step itself changed: see tests/test_step.py and tests/training first.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import conftest
import modelparallel as smp
from modelparallel import runtime
from modelparallel.activations import job_offloader
from modelparallel.devices import DEVICE_ENV
from reference import gathered

LR = 0.05
LAYERS = 2
ROOT = Path(__file__).resolve().parents[2]


def tiny():
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)


def build(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny())


def ids_on(device) -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1)).to(device)


def _fresh_world() -> None:
    """Each test starts its own world of one (the device decides NCCL or gloo)."""
    if runtime.is_initialized():
        smp.wait_for_checkpoints()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, request.param)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    _fresh_world()
    yield torch.device("cuda", 0) if request.param == "cuda" else torch.device("cpu")
    _fresh_world()


@smp.step
def train_step(model, ids):
    loss = model(ids, labels=ids).loss
    model.backward(loss)
    return loss


def on(device, tensors) -> None:
    for name, t in tensors:
        assert t.device == device, f"{name} is on {t.device}, not {device}"


# ---- a training step equals plain PyTorch -------------------------------------------------------

def ours(device, dtype: torch.dtype, steps: int, **opt_args):
    """(losses, fp32 weights the optimizer holds, optimizer) of ``steps`` library steps."""
    smp.init({"tensor_parallel_degree": 1, "random_seed": 0, "bf16": dtype == torch.bfloat16,
              "fp16": dtype == torch.float16})
    model = smp.DistributedModel(build())  # built on the CPU; the library moves it
    on(device, model.module.named_parameters())
    on(device, model.module.named_buffers())
    assert runtime.current().device == device and dist.get_backend() == ("nccl" if device.type == "cuda" else "gloo")
    # the foreach kernels are the optimizer tests' subject; a plain loop keeps this one about devices
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, foreach=False), **opt_args)
    losses = []
    for _ in range(steps):
        loss = train_step(model, ids_on(device)).reduce_mean()
        on(device, [("loss", loss)])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    names = {id(p): n for n, p in model.module.named_parameters()}
    masters = {names[id(p)]: gathered(m.detach()).float().cpu() for p, m in opt.master_weights.params_and_masters()} \
        if dtype != torch.float32 else {n: gathered(p.detach()).cpu() for n, p in model.module.named_parameters()}
    return losses, masters, opt


def plain(device, dtype: torch.dtype, steps: int, scale: float = 1.0):
    """The same steps in plain PyTorch: the weights cast to ``dtype``, fp32 master copies of the
    cast weights that SGD updates (as the library does: the masters start from the half-precision
    model it was given), the loss multiplied by ``scale`` before backward, the gradients divided after."""
    model = build().to(device=device, dtype=dtype)
    masters = {n: p.detach().float() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(list(masters.values()), lr=LR, foreach=False)
    losses = []
    for _ in range(steps):
        ids = ids_on(device)
        loss = model(ids, labels=ids).loss
        (loss * scale).backward()
        for n, p in model.named_parameters():
            masters[n].grad = p.grad.float() / scale
            p.grad = None
        opt.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(masters[n])
        losses.append(loss.item())
    return losses, {n: m.detach().cpu() for n, m in masters.items()}


def assert_same_training(got, want, dtype: torch.dtype, steps: int, start: dict | None = None):
    """At TP=1 both run the model's own kernels on the same inputs: the differences are
    reordered sums only. A weight moves by LR x (its gradient) per step; a gradient computed in
    ``dtype`` carries at most one rounding per layer crossed, forward and backward, each up to
    eps(dtype) of the largest gradient, and ~sqrt(hidden) of them add up in a reordered sum."""
    (got_losses, got_w), (want_losses, want_w) = got, want
    eps = torch.finfo(dtype).eps
    for a, b in zip(got_losses, want_losses):
        # the loss carries at most one relative rounding of eps per layer, embedding and head included
        assert abs(a - b) <= (LAYERS + 2) * eps * abs(b), (got_losses, want_losses)
    assert got_w.keys() == want_w.keys()
    for name, w in want_w.items():
        first = start[name] if start is not None else build().get_parameter(name).detach().to(dtype).float()
        moved = (w - first).abs().max().item()  # LR x steps x gradient
        atol = 2 * (LAYERS + 2) * math.sqrt(64) * eps * moved + steps * torch.finfo(torch.float32).eps * w.abs().max()
        torch.testing.assert_close(got_w[name], w, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")
        assert moved > 0, f"{name} never changed: no gradient reached it"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_equals_plain_pytorch(device, dtype):
    got = ours(device, dtype, steps=2)[:2]
    assert_same_training(got, plain(device, dtype, steps=2), dtype, steps=2)


def test_fp16_loss_scaling_equals_plain_pytorch(device):
    scaling = {"static_loss_scale": None, "dynamic_loss_scale": True,
               "dynamic_loss_args": {"init_scale": 2.0 ** 10, "scale_window": 1000}}
    losses, masters, opt = ours(device, torch.float16, steps=2, **scaling)
    assert opt.loss_scaler.loss_scale == 2.0 ** 10
    assert_same_training((losses, masters), plain(device, torch.float16, steps=2, scale=2.0 ** 10),
                         torch.float16, steps=2)


def test_fp16_overflow_skips_the_step_and_halves_the_scale(device):
    """SageMaker's default initial scale (2^32) overflows fp16 gradients on the first step."""
    scaling = {"static_loss_scale": None, "dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0 ** 32}}
    _, masters, opt = ours(device, torch.float16, steps=1, **scaling)
    assert opt.loss_scaler.loss_scale == 2.0 ** 31
    for name, w in masters.items():
        start = build().get_parameter(name).detach().half().float()
        assert torch.equal(w, start), f"{name} changed in a skipped step"


def fsdp2_steps(device, transform: bool, steps: int):
    """(losses, fp32 weights) of ``steps`` SGD steps of FSDP2 with bf16 compute over fp32 weights,
    on ``smp.transform``'s output (a SageMaker v2 script) or on the plain HF model; and the start."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    smp.init({"tensor_parallel_degree": 1, "random_seed": 0})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(tiny())
    start = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    if transform:
        model, mesh = smp.transform(model), smp.dp_mesh()
    else:
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    on(device, model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    losses = []
    for _ in range(steps):
        ids = ids_on(device)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return (losses, {n: gathered(p.detach()).float().cpu() for n, p in model.named_parameters()}), start


def test_v2_transform_with_fsdp2_equals_fsdp2_on_the_plain_model(device):
    got, start = fsdp2_steps(device, transform=True, steps=2)
    _fresh_world()
    want, _ = fsdp2_steps(device, transform=False, steps=2)
    assert_same_training(got, want, torch.bfloat16, steps=2, start=start)


# ---- activation checkpointing and offloading ---------------------------------------------------

@pytest.mark.parametrize("offload", [False, True], ids=["checkpointing", "offload"])
def test_activation_checkpointing_and_offload_keep_gradients(device, offload):
    smp.init({"tensor_parallel_degree": 1, "random_seed": 0, "offload_activations": offload,
              "activation_loading_horizon": 1})
    want = build().to(device)
    model = smp.DistributedModel(copy.deepcopy(want).cpu())
    smp.set_activation_checkpointing(model.module.model.layers)
    ids = ids_on(device)
    want(ids, labels=ids).loss.backward()
    loss = model(ids, labels=ids).loss
    if offload:  # between forward and backward the layers' inputs wait in host memory
        offloader = job_offloader()
        assert offloader is not None and offloader.stored_bytes() >= LAYERS * ids.numel() * 64 * 4
    model.backward(loss)
    for (name, p), q in zip(model.module.named_parameters(), want.parameters()):
        # recomputation replays the same kernels on the same inputs: rounding of reordered sums at most
        tol = 8 * math.sqrt(256) * torch.finfo(torch.float32).eps * q.grad.abs().max()
        torch.testing.assert_close(gathered(p.grad), q.grad, rtol=0, atol=tol, msg=lambda m: f"grad {name}: {m}")
    if offload:
        assert offloader.stored_bytes() == 0, "offloaded activations outlived the backward pass"


# ---- delayed initialization -------------------------------------------------------------------

def test_delayed_init_from_meta_lands_on_the_device_and_equals_eager(device):
    smp.init({"tensor_parallel_degree": 1, "random_seed": 0})
    torch.manual_seed(0)
    with torch.device(device):  # the delayed init draws on the device, from its generator: so does this build
        eager = LlamaForCausalLM(tiny())
    torch.manual_seed(0)
    with smp.delay_param_initialization(enabled=True):
        module = LlamaForCausalLM(tiny())
    assert next(module.parameters()).is_meta
    model = smp.DistributedModel(module)
    on(device, model.module.named_parameters())
    on(device, model.module.named_buffers())
    ids = ids_on(device)
    with torch.no_grad():
        torch.testing.assert_close(gathered(model(ids).logits), eager(ids).logits, rtol=0, atol=0)


# ---- checkpoints from device memory -------------------------------------------------------------

def _snapshot(model, opt) -> dict:
    out = {f"model.{n}": gathered(p.detach()).cpu().clone() for n, p in model.module.named_parameters()}
    for i, state in enumerate(opt.state_dict()["state"].values()):
        out.update({f"opt.{i}.{k}": gathered(v.detach()).cpu().clone() for k, v in state.items() if torch.is_tensor(v)})
    return out


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_checkpoint_from_device_memory_resumes_exactly(device, tmp_path, async_save):
    smp.init({"tensor_parallel_degree": 1, "random_seed": 0})
    model = smp.DistributedModel(build())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))
    train_step(model, ids_on(device))
    opt.step()
    opt.zero_grad()
    smp.save_checkpoint(tmp_path, "a", user_content={"step": 1}, async_save=async_save)
    want = _snapshot(model, opt)
    train_step(model, ids_on(device))  # goes on while an asynchronous save is written: must not leak into it
    opt.step()
    smp.wait_for_checkpoints()
    fresh = smp.DistributedModel(build(seed=5))
    fresh_opt = smp.DistributedOptimizer(torch.optim.AdamW(fresh.parameters(), lr=1e-3, foreach=False))
    before = _snapshot(fresh, fresh_opt)
    assert smp.resume_from_checkpoint(tmp_path, "a") == {"step": 1}
    got = _snapshot(fresh, fresh_opt)
    on(device, fresh.module.named_parameters())
    for key, value in want.items():
        if key.startswith("model."):
            assert not torch.equal(before[key], value), f"{key}: the fresh model already held the saved values"
            assert torch.equal(got[key], value), f"{key}: the resumed value differs from the saved one"
    optim = sorted(k for k in want if k.startswith("opt."))
    assert optim and sorted(k for k in got if k.startswith("opt.")) == optim, (optim, sorted(got))
    for key in optim:
        assert torch.equal(got[key], want[key]), f"{key}: the resumed optimizer state differs from the saved one"
    for name, state in fresh_opt.state_dict()["state"].items():
        on(device, [(f"optimizer state {name}.{k}", v) for k, v in state.items() if torch.is_tensor(v) and v.dim()])


@pytest.mark.parametrize("way", ["snapshot", "live"])
def test_async_saves_stage_device_tensors_without_pinning_in_the_call(device, tmp_path, way):
    """The first asynchronous save stages device tensors by a snapshot on the device (room) or a
    live copy in the background (no room: an edit through ``.data`` before that copy fails the
    save, a snapshot never sees it); the buffers are pinned afterwards, so on a GPU the next save
    copies on a side stream that the step waits for. Each committed save resumes to the values
    of its call, though training went on right after it (host tensors take the same ways here)."""
    import threading
    from modelparallel.checkpoint.api import _saver
    from modelparallel.checkpoint.background.deferred import LIVE, SNAPSHOT, STREAM

    smp.init({"tensor_parallel_degree": 1, "random_seed": 0})
    model = smp.DistributedModel(build())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))
    train_step(model, ids_on(device))
    opt.step()
    stager, kinds = _saver().stager, []
    stager.on_device = lambda t: True  # what a GPU tensor takes (host tensors too, here)
    stager.spare = (lambda dev: 0) if way == "live" else (lambda dev: 1 << 40)  # the device's room, decided here
    way_of = stager._on_device
    stager._on_device = lambda *args: _kept(way_of(*args), kinds)
    first = {SNAPSHOT if way == "snapshot" else LIVE}

    release = threading.Event()
    stager.before_copy = release.wait
    smp.save_checkpoint(tmp_path, "edited", async_save=True)
    model.module.lm_head.weight.data.mul_(2)  # bypasses the version counter
    release.set()
    stager.before_copy = None
    if way == "live":
        with pytest.raises(Exception, match="lm_head.weight"):
            smp.wait_for_checkpoints()
    else:
        smp.wait_for_checkpoints()
    assert set(kinds) == first, kinds

    wanted = {}
    for tag in ("a", "b"):
        kinds.clear()
        smp.save_checkpoint(tmp_path, tag, async_save=True, num_kept_partial_checkpoints=3)
        wanted[tag] = _snapshot(model, opt)
        train_step(model, ids_on(device))
        opt.step()  # waits for a live copy on the host, for a stream copy on the device
        opt.zero_grad()
        smp.wait_for_checkpoints()
        pinned = device.type == "cuda" and (tag == "b" or way == "snapshot")  # after a committed save
        assert set(kinds) == ({STREAM} if pinned else first), (tag, kinds)
        stager.pinner.join()  # the first save's buffers pinned in the background
        assert not stager.pageable, "a device tensor's buffer was left unpinned"
    for tag, want in wanted.items():
        fresh = smp.DistributedModel(build(seed=5))
        fresh_opt = smp.DistributedOptimizer(torch.optim.AdamW(fresh.parameters(), lr=1e-3, foreach=False))
        smp.resume_from_checkpoint(tmp_path, tag)
        got = _snapshot(fresh, fresh_opt)
        for key, value in want.items():
            assert torch.equal(got[key], value), f"{tag} {key}: the resumed value differs from the call's"


def test_host_memory_a_device_writes_by_dma_is_read_at_the_call_not_watched(device):
    """Pinned host memory (a GPU writes it by DMA, past the page tables that write tracking asks)
    is read for its CRC32 at the call; an ordinary host tensor is watched by its pages where the
    kernel tracks writes. Either way a write after the call, here a copy from the device, fails
    the staging, naming the tensor."""
    from modelparallel.checkpoint.background.stager import StagedTensorChanged, Stager

    stager = Stager()
    if stager.pages is not None:
        stager.pages.min_save_bytes = 0  # an 800 kB save: under the floor it would be read anyway
    stager.begin()
    host = torch.randn(200_000)
    host = host.pin_memory() if device.type == "cuda" else host
    buf = stager.buffer(("host",), host)
    stager.defer("host", host, host, buf)
    stager.seal()
    watched = stager.deferred[0].pages is not None
    assert not (watched and device.type == "cuda"), "pinned memory was left to the page flags"
    assert watched == (device.type == "cpu" and stager.pages is not None)
    host.data.copy_(torch.ones(200_000, device=device))  # a DMA write on a GPU
    with pytest.raises(StagedTensorChanged, match="host"):
        stager.copy_deferred()


def _kept(deferred, kinds: list):
    kinds.append(deferred.kind)
    return deferred


# ---- the command line's own job -------------------------------------------------------------------

def test_cli_default_train_runs_on_the_device(device, tmp_path):
    """``modelparallel train`` with its default degree: one rank on a one-GPU machine, two on CPU."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text("def f(x):\n    return x + 1\n" * 400)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({DEVICE_ENV: device.type, "PYTHONPATH": str(ROOT)})
    if device.type == "cuda":  # this process hides the GPUs from the suite's children; not from this one
        env.pop("CUDA_VISIBLE_DEVICES")
        if conftest.VISIBLE_GPUS is not None:
            env["CUDA_VISIBLE_DEVICES"] = conftest.VISIBLE_GPUS
    cmd = [sys.executable, "-m", "modelparallel.cli", "train", "--model", "gpt2-micro", "--data", str(data),
           "--steps", "6", "--seq-len", "32", "--batch-size", "4", "--eval-windows", "2", "--sample-tokens", "4",
           "--save-every", "3", "--out", str(tmp_path / "run")]
    if device.type == "cuda":
        cmd += ["--dtype", "bf16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    want_tp = min(2, conftest.GPUS) if device.type == "cuda" else 2
    assert metrics["tp"] == want_tp and metrics["world_size"] == want_tp, metrics
    assert metrics["device"] == device.type, metrics
    assert all(math.isfinite(x) for x in metrics["loss"]) and len(metrics["loss"]) == 6
    assert math.isfinite(metrics["final_val_loss"])
