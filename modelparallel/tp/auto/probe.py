"""One recorded forward of the proxy: what every module received and returned, which sizes the
modules inside the blocks read while computing, and the autograd graph linking them.

Three records, all taken with hooks on the proxy alone (the user's model is never touched):

* ``calls``: per module path, its first call's inputs (detached copies, to replay the module
  alone) and its output (the live tensor, whose ``grad_fn`` marks it in the graph);
* ``reads``: per module inside a block, the integer attributes its forward read, its own
  (``num_heads``) or its config's (``config.num_attention_heads``): the sizes a sharded module
  may have to hold per rank;
* the graph: ``producers(path)`` walks back from a linear layer's input to the nearest linear
  layers whose outputs it was computed from, the dataflow the Megatron pairs are read from.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

LINEAR = (nn.Linear, Conv1D)


@dataclass
class Call:
    """A module's first call: inputs (detached copies, to replay it; and the live objects, to
    know which tensor it read) and output (live, in the graph)."""

    args: tuple
    kwargs: dict
    output: Any
    input: torch.Tensor | None  # the live first tensor argument (a linear layer's input)
    live: tuple = ((), {})
    value: Any = None  # a detached copy of the output as returned (later in-place ops do not reach it)


@dataclass
class Probe:
    model: nn.Module
    attention: str | None = None  # the attention implementation the forward ran
    calls: dict[str, Call] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    reads: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    consumers: dict = field(default_factory=lambda: defaultdict(list))  # graph node -> nodes reading it
    region_params: dict[str, list] = field(default_factory=dict)  # linear path -> parameters used upstream of it

    def module(self, path: str) -> nn.Module:
        return self.model.get_submodule(path)

    def out_node(self, path: str):
        out = self.calls[path].output
        return out.grad_fn if isinstance(out, torch.Tensor) else None

    def producers(self, path: str, stops: dict) -> set[str]:
        """The linear layers (paths, from ``stops``: graph node -> path) nearest upstream of
        ``path``'s input; records each node's consumers on the way, and the parameters met
        before reaching those layers (``region_params``)."""
        start = self.calls[path].input
        node = start.grad_fn if isinstance(start, torch.Tensor) else None
        seen, found, stack, params = set(), set(), [node], []
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in stops:
                found.add(stops[node])
                continue
            if hasattr(node, "variable"):  # AccumulateGrad: a parameter read on the way
                params.append(node.variable)
            for nxt, _ in node.next_functions:
                if nxt is not None:
                    self.consumers[nxt].append(node)
                    stack.append(nxt)
        self.region_params[path] = params
        return found


def _copy(value):
    """``value`` with every tensor detached and copied (containers followed)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*map(_copy, value))
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def _first_tensor(args, kwargs):
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


class _ReadingView:
    """A config stand-in recording which integer attributes a module reads from it."""

    def __init__(self, base, log: set):
        self.__dict__.update(_mp_base=base, _mp_log=log)

    def __getattr__(self, name):
        value = getattr(self.__dict__["_mp_base"], name)
        if type(value) is int:
            self.__dict__["_mp_log"].add(f"config.{name}")
        return value


def _reading_class(cls: type) -> type:
    """``cls`` with an ``__getattribute__`` that records integer instance attributes read: one
    subclass per class, made once and kept on ``cls`` itself (its own ``__dict__``)."""
    made = cls.__dict__.get("_mp_reading_class")
    if made is None:
        def __getattribute__(self, name):
            value = object.__getattribute__(self, name)
            own = object.__getattribute__(self, "__dict__")
            if name in own and type(value) is int and "_mp_read_log" in own:
                own["_mp_read_log"].add(name)
            return value
        made = type(f"Reading{cls.__name__}", (cls,), {"__getattribute__": __getattribute__})
        setattr(cls, "_mp_reading_class", made)
    return made


def _watch_reads(probe: Probe, paths: list[str]) -> list:
    """Make the modules at ``paths`` record their reads; returns what ``_unwatch`` restores."""
    undo = []
    for path in paths:
        module, log = probe.module(path), probe.reads[path]
        undo.append((module, type(module), module.__dict__.get("config")))
        module.__dict__["_mp_read_log"] = log
        if "config" in module.__dict__:
            module.__dict__["config"] = _ReadingView(module.__dict__["config"], log)
        module.__class__ = _reading_class(type(module))
    return undo


def _unwatch(undo: list) -> None:
    for module, cls, config in undo:
        module.__class__ = cls
        module.__dict__.pop("_mp_read_log", None)
        if config is not None:
            module.__dict__["config"] = config


def set_attention(model: nn.Module, name: str | None) -> None:
    """Run ``model``'s attention with implementation ``name`` from now on (HF's own switch)."""
    if name is not None and getattr(model.config, "_attn_implementation", None) != name:
        model.set_attn_implementation(name)


def run_probe(model: nn.Module, ids: torch.Tensor, watched: list[str], attention: str | None = None) -> Probe:
    """Run ``model`` (the proxy) once on ``ids`` with gradients on, and with the attention
    implementation ``attention`` (default: the model's), recording calls of every module and the
    reads of the modules at ``watched``."""
    set_attention(model, attention)
    probe = Probe(model, getattr(model.config, "_attn_implementation", None))
    handles = []
    for path, module in model.named_modules():
        def pre(mod, args, kwargs, path=path):
            probe.counts[path] += 1
            if path not in probe.calls:
                probe.calls[path] = Call(_copy(args), _copy(kwargs), None, _first_tensor(args, kwargs), (args, kwargs))

        def post(mod, args, kwargs, output, path=path):
            if probe.calls[path].output is None:
                probe.calls[path].output, probe.calls[path].value = output, _copy(output)
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    undo = _watch_reads(probe, watched)
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    try:
        with torch.enable_grad():
            model(input_ids=ids, **kwargs)
    finally:
        _unwatch(undo)
        for h in handles:
            h.remove()
    return probe
