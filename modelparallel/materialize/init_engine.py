"""The initialization engine behind ``DelayedParamIniter``: give a meta-device model's tensors
storage and run the model's own initialization on them, module by module.

Sharded parameters are initialized at their full size one module at a time and sliced, so a seed
gives the same model at every TP degree, and the same as HF's eager ``initialize_weights()`` when
modules are visited in HF's order (``init_all``). Used by the public ``DelayedParamIniter`` (an
FSDP ``param_init_fn``), by ``DistributedModel`` for models built in a delayed-init context, and
by the checkpoint loader for buffers a checkpoint does not hold.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..pipeline.split import eager_named_children
from ..tp.layout import copy_shard, local_part, tied_parameters
from . import hf_init, meta

logger = logging.getLogger("modelparallel")

__all__ = ["InitEngine"]


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class InitEngine:
    """Initialize the meta parameters and buffers of ``model`` in place, module by module.

    Args:
        model: a model built on the meta device, sharded or not; tensors already holding data
            are left untouched.
        init_method_using_config: ``fn(module)`` initializing one module's own parameters and
            buffers. Default: the HF model's ``_init_weights`` (which also recomputes rotary
            ``inv_freq``, position ids and causal masks), else each module's ``reset_parameters``.
        verbose: log each module as it is initialized.
        device: where materialized tensors live.
    """

    def __init__(self, model: nn.Module, init_method_using_config: Callable[[nn.Module], None] | None = None,
                 verbose: bool = False, device: torch.device = torch.device("cpu")):
        self.model = model
        self.device = device
        self.init_fn = init_method_using_config or hf_init.default_init_fn(model)
        self.verbose = verbose
        self.ties = [[(mod, name) for _, mod, name in group] for group in tied_parameters(model)]
        self._unwritten: set[str] = set()
        self._mine: dict[int, str] = {}
        self._names = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
        self._live = set(self._names)
        """The modules of ``model`` (at pipeline degree > 1 the others, set aside by the split, are
        initialized only for their random draws, then put back on meta: ``_eager_children``)."""
        self._eager = True
        self._live_tensors = {id(t) for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values())
                              if t is not None}

    # ---- step 1: materialize and initialize one module --------------------------------------

    def get_param_init_fn(self) -> Callable[[nn.Module], None]:
        """``fn(module)``: give ``module``'s own meta tensors storage and initialize them. HF inits
        that re-initialize a direct child's tensor from the parent (GPT-2's scaled ``c_proj``)
        are honoured when the child was materialized first, as in HF's order (``init_all``)."""
        return self._init_module

    def _init_module(self, module: nn.Module) -> None:
        path = self._names.get(id(module), type(module).__name__)
        tables = (module._parameters, module._buffers)
        own = [(tb, n) for tb in tables for n, t in tb.items() if meta.is_meta(t)]
        # a tie materialized by an earlier holder: HF's eager build draws for it here too (before
        # tying, on a separate tensor) and discards the draw; do the same to keep the RNG stream
        again = [(tb, n) for tb in tables for n, t in tb.items() if t is not None and id(t) in self._mine]
        meta.materialize(module, self.device, recurse=False)
        for table, name in own:
            self._mine[id(table[name])] = _join(path, name)
        children = [(tb, n) for child in self._eager_children(module) for tb in (child._parameters, child._buffers)
                    for n, t in tb.items() if t is not None and id(t) in self._mine]
        slots = [(tb, n, "own") for tb, n in own] + [(tb, n, "discard") for tb, n in again]
        slots += [(tb, n, "child") for tb, n in children]
        if slots:
            self._run(module, slots)
        if self.verbose and own:
            logger.info("modelparallel: initialized %s (%s)", path or "<root>", ", ".join(n for _, n in own))

    def _run(self, module: nn.Module, slots) -> None:
        """Call the init method with every slot swapped for the tensor it should write, then put
        the real tensors back and copy each written shard in."""
        targets = [table[name] for table, name, _ in slots]
        scratch = [self._scratch(table, name, kind == "discard") for table, name, kind in slots]
        versions = [s._version for s in scratch]
        try:
            self.init_fn(module)
        finally:
            for (table, name, _), target in zip(slots, targets):
                table[name] = target
        for (_, _, kind), target, full, version in zip(slots, targets, scratch, versions):
            qname = self._mine[id(target)]
            if kind == "discard":
                continue
            if full._version == version:
                if kind == "own" and id(module) in self._live:
                    self._unwritten.add(qname)
                continue
            self._unwritten.discard(qname)
            if isinstance(target, DTensor):
                copy_shard(target, full.detach().to(target.dtype))
            elif full is not target:
                with torch.no_grad():
                    target.copy_(full)

    @staticmethod
    def _scratch(table: dict, name: str, separate: bool) -> torch.Tensor:
        """The tensor the init method writes: a sharded (or ``separate``) tensor is replaced, for
        the call, by a plain full-size one (so HF's init draws the same numbers as for the
        unsharded model, at any TP degree); a plain tensor is written where it is. A float16 or
        bfloat16 tensor is drawn in float32 and rounded, as an eager fp32 model cast to half: the
        numbers a half-precision ``normal_`` draws differ between PyTorch releases."""
        t = table[name]
        low = t.dtype in (torch.float16, torch.bfloat16)
        if not (separate or low or isinstance(t, DTensor)):
            return t
        full = torch.empty(t.shape, dtype=torch.float32 if low else t.dtype, device=local_part(t).device)
        table[name] = nn.Parameter(full, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else full
        return table[name]

    def _replay_draws(self, mod: nn.Module) -> None:
        """Draw, and discard, what ``mod``'s constructor drew (``nn.Linear``'s kaiming init), on
        the device the model is materialized on: each device has its own generator, and the
        eager build there advanced that one."""
        if not callable(getattr(mod, "reset_parameters", None)) or not mod._parameters:
            return
        saved = dict(mod._parameters)
        try:
            for name, p in saved.items():
                if p is not None:
                    mod._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                                          requires_grad=False)
            with torch.no_grad():
                mod.reset_parameters()
        finally:
            mod._parameters.update(saved)

    def init_all(self, match_eager: bool = True) -> None:
        """Initialize every module in HF's order, then restore ties: each (nested) HF model runs
        its init pass, children before parents, right after it is built, as its ``post_init``
        does in an eager build.

        With ``match_eager``, the random draws of module constructors are replayed (and
        discarded) where the eager build makes them, so after the same ``torch.manual_seed`` the
        model equals HF's eager one wherever constructors draw through ``reset_parameters``
        (``nn.Linear`` / ``nn.Embedding`` models such as Llama; HF's ``Conv1D`` draws in its
        ``__init__``, so GPT-2 matches in distribution only). It costs one more init's compute.
        """
        done: set[int] = set()
        self._eager = match_eager

        def init_pass(mod: nn.Module) -> None:
            children = self._eager_children(mod)
            for child in children:
                init_pass(child)
                if id(child) not in self._live:  # no later init reaches below it
                    self._release([m for m in child.modules() if m is not child])
            if id(mod) not in done:
                done.add(id(mod))
                self._init_module(mod)
            self._release([c for c in children if id(c) not in self._live])  # after the parent's init

        def build(mod: nn.Module) -> None:
            for child in self._eager_children(mod):
                build(child)
            if match_eager:
                self._replay_draws(mod)
            if mod is self.model or hf_init.is_hf_model(mod):
                init_pass(mod)

        build(self.model)
        self.get_post_param_init_fn()(self.model)

    def _eager_children(self, mod: nn.Module) -> list[nn.Module]:
        """``mod``'s children as the eager build made them. At pipeline degree > 1 the split set
        aside, on meta, the blocks and first / last modules other stages hold
        (``pipeline.split.eager_named_children``): with ``match_eager`` they take their places
        again here, so the random draws before and between this stage's modules are the whole
        model's, and each stage's values are the eager model's for the same seed. That costs
        every stage the whole model's draws, and holds each set-aside module's own tensors (full
        size, on the device) until its parent's init: one block at a time, and a set-aside
        embedding or head until the end of its model's pass (a parent's init may redraw its
        children's tensors, as GPT-2's does)."""
        if not self._eager:
            return list(mod.children())
        out = []
        for name, kid in eager_named_children(mod):
            if id(kid) not in self._live:
                self._name_aside(kid, _join(self._names.get(id(mod), ""), name))
            out.append(kid)
        return out

    def _name_aside(self, module: nn.Module, path: str) -> None:
        for sub_path, sub in module.named_modules(prefix=path, remove_duplicate=False):
            self._names.setdefault(id(sub), sub_path)

    def _release(self, modules: list[nn.Module]) -> None:
        """Put the tensors of set-aside ``modules`` back on meta (their values were only drawn to
        keep the random stream), except those the model itself holds (a tie across stages)."""
        for mod in modules:
            for table in (mod._parameters, mod._buffers):
                for name, t in list(table.items()):
                    if t is None or meta.is_meta(t) or id(t) in self._live_tensors:
                        continue
                    self._mine.pop(id(t), None)
                    if isinstance(t, nn.Parameter):
                        torch.utils.swap_tensors(t, nn.Parameter(torch.empty_like(t, device="meta"),
                                                                 requires_grad=t.requires_grad))
                    else:
                        table[name] = torch.empty_like(t, device="meta")

    # ---- step 2: ties ------------------------------------------------------------------------

    def get_post_param_init_fn(self) -> Callable[[nn.Module], None]:
        """``fn(module)``: point every holder of a tie (recorded at construction) at one
        parameter again, in case materialization replaced one of them."""
        def retie(_module: nn.Module | None = None) -> None:
            for group in self.ties:
                keep = getattr(*group[0])
                for mod, name in group[1:]:
                    if getattr(mod, name) is not keep:
                        mod._parameters[name] = keep
        return retie

    # ---- the guard ---------------------------------------------------------------------------

    def count_num_params(self) -> int:
        """Number of parameters of the whole (unsharded) model, each tied tensor counted once."""
        return sum(p.numel() for p in self.model.parameters())

    @contextlib.contextmanager
    def validate_params_and_buffers_inited(self, enabled: bool = True):
        """Run the block (which initializes the model), then raise naming every parameter or
        buffer still on meta or never written by the init method."""
        yield
        if not enabled:
            return
        problems = []
        left = meta.meta_names(self.model)
        if left:
            problems.append(f"still on the meta device: {', '.join(left)}")
        if self._unwritten:
            problems.append("given storage but never written by the init method: "
                            + ", ".join(sorted(self._unwritten)))
        if problems:
            raise meta.MetaTensorError("delayed parameter initialization incomplete:\n  - " + "\n  - ".join(problems))
