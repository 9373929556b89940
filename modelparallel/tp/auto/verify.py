"""The automatic plan checked where it will run: sharded by the one walker over the real TP ranks,
the proxy must compute the unsharded proxy's logits and every gradient, up to rounding.

A collective: every rank builds the same proxy and reference, shards its copy, runs one forward
and backward on the same random batch, and compares the gathered logits and gradients with the
reference's. The tolerance is ``tolerance.excess``'s rounding bound; a gradient that is zero in
exact arithmetic (a key bias under softmax) holds rounding noise only, so the distance of the
fp32 reference from an fp64 twin of it is allowed on top (four times, as two fp32 evaluations
that close to exact differ by at most twice it). Every rank reaches the same verdict from the same
gathered numbers; the verdict is also agreed by one all-reduce, so a failure ends every rank with
the same error, which names the first module whose output or gradient differs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ... import devices
from ..plan import ArchSpec
from .proxy import build_proxy, on_cpu, probe_ids
from .tolerance import excess

NOISE_FACTOR = 4


@dataclass
class Mismatch:
    what: str  # "logits" or "gradient of <parameter>"
    worst: float
    allowed: float


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _objective(model: nn.Module, ids: torch.Tensor):
    """(output, scalar to differentiate): the LM loss on ``ids`` if the model computes one, else
    a fixed weighting of its first output."""
    out = model(input_ids=ids, labels=ids) if _takes_labels(model) else model(input_ids=ids)
    loss = getattr(out, "loss", None)
    if loss is None:
        first = _full(out[0])
        weights = torch.randn(first.shape, generator=torch.Generator().manual_seed(2), dtype=first.dtype)
        loss = (first * weights).sum()
    return out, loss


def _takes_labels(model: nn.Module) -> bool:
    import inspect

    return "labels" in inspect.signature(model.forward).parameters


def _terms(model: nn.Module, ids: torch.Tensor) -> int:
    sizes = [ids.numel()] + [s for p in model.parameters() for s in p.shape]
    return max(sizes)


def _noise(reference: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """Per parameter, how far the fp32 reference's gradient is from an fp64 twin's."""
    twin = copy.deepcopy(reference).double()
    twin.zero_grad(set_to_none=True)
    _objective(twin, ids)[1].backward()
    exact = dict(twin.named_parameters())
    noise = {}
    for name, p in reference.named_parameters():
        g = exact[name].grad
        if p.grad is not None and g is not None and torch.isfinite(g).all():
            noise[name] = (p.grad.double() - g).abs().max().item()
    return noise


def compare(reference: nn.Module, sharded: nn.Module, ids: torch.Tensor) -> Mismatch | None:
    """Run both (the sharded one on every rank) and return the first difference beyond rounding."""
    want, want_loss = _objective(reference, ids)
    got, got_loss = _objective(sharded, ids)
    terms = _terms(reference, ids)
    logits = getattr(want, "logits", None)
    if logits is not None:
        worst, allowed = excess(_full(got.logits), logits, terms)
        if not worst <= allowed:
            return Mismatch("logits", worst, allowed)
    want_loss.backward()
    got_loss.backward()
    noise = _noise(reference, ids)
    mine = dict(sharded.named_parameters())
    for name, p in reference.named_parameters():
        if p.grad is None:
            continue
        grad = mine[name].grad
        if grad is None:
            return Mismatch(f"gradient of {name} (none on the sharded model)", float("inf"), 0.0)
        worst, allowed = excess(_full(grad).reshape(p.grad.shape), p.grad, terms,
                                NOISE_FACTOR * noise.get(name, 0.0))
        if not worst <= allowed:
            return Mismatch(f"gradient of {name}", worst, allowed)
    return None


def _first_diverging(reference: nn.Module, sharded: nn.Module, ids: torch.Tensor) -> str | None:
    """The first module (in the reference's call order) whose whole output differs."""
    outputs = {}

    def record(store):
        def hook(module, args, output):
            if isinstance(output, tuple):
                output = output[0] if output else None
            if isinstance(output, torch.Tensor) and not isinstance(output, DTensor):
                store.setdefault(module._mp_verify_path, output.detach().clone())
        return hook

    handles = []
    for tag, model in (("want", reference), ("got", sharded)):
        outputs[tag] = {}
        for path, module in model.named_modules():
            module.__dict__["_mp_verify_path"] = path
            handles.append(module.register_forward_hook(record(outputs[tag])))
    try:
        with torch.no_grad():
            _objective(reference, ids)
            _objective(sharded, ids)
    finally:
        for h in handles:
            h.remove()
    terms = _terms(reference, ids)
    for path, want in outputs["want"].items():
        got = outputs["got"].get(path)
        if path and got is not None and got.shape == want.shape:
            worst, allowed = excess(got, want, terms)
            if not worst <= allowed:
                return path
    return None


@on_cpu
def verify(model: nn.Module, spec: ArchSpec, tp_mesh: DeviceMesh, parallelize, seq: int = 8) -> Mismatch | None:
    """Shard a proxy of ``model`` with ``spec`` (``parallelize(module, tp_mesh, spec)``: the walker)
    and compare it with the unsharded proxy on a probe batch of ``seq`` tokens a row. A collective
    over all ranks; the same result on every rank. Returns the first difference, with the module
    it appears in, or None."""
    reference = build_proxy(model)
    sharded = copy.deepcopy(reference)
    parallelize(sharded, tp_mesh, spec)
    ids = probe_ids(reference.config, seq=seq)
    try:
        found = compare(reference, sharded, ids)
    except Exception as e:  # noqa: BLE001 - a plan whose sharded forward fails is a wrong plan (every rank alike)
        found = Mismatch(f"the sharded forward or backward ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
                         float("inf"), 0.0)
    flag = torch.tensor([0.0 if found is None else 1.0], device=devices.for_group())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and found is None:
        found = Mismatch("another rank's comparison", float("inf"), 0.0)
    if found is not None and found.worst != float("inf"):
        where = _first_diverging(reference, sharded, ids)
        if where:
            found.what += f" (first differing output: {where})"
    return found
