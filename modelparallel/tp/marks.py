"""Which modules get distributed: the ``tensor_parallelism`` context, ``set_tensor_parallelism`` and
``tp_register_with_module``.

Marks live on the modules themselves (``_mp_tp``) and registrations on the user's module class
(``_mp_tp_registration``), so the library keeps no global state for them. A module's mark is its
own or that of its nearest marked ancestor; an unmarked model is distributed whole.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.nn.modules.module import register_module_module_registration_hook

from .plan import ModulePlan


@dataclass(frozen=True)
class Mark:
    enabled: bool
    strict: bool = False


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, strict: bool = False, **unsupported: Any):
    """Mark modules created inside this block for (or, with ``enabled=False``, against) tensor
    parallelism; ``DistributedModel`` then shards the marked ones.

    Args:
        enabled: distribute the modules created here.
        strict: raise, instead of logging, when a marked model has no plan or registration.

    Raises:
        NotImplementedError: for SageMaker keyword options this library does not implement.
    """
    if unsupported:
        raise NotImplementedError(f"tensor_parallelism options not implemented: {sorted(unsupported)}")
    mark = Mark(enabled, strict)

    def tag(parent: nn.Module, name: str, child: nn.Module):
        if child is not None and "_mp_tp" not in child.__dict__:
            child._mp_tp = mark

    handle = register_module_module_registration_hook(tag)
    try:
        yield
    finally:
        handle.remove()


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, strict: bool = False) -> None:
    """Switch tensor parallelism on or off for ``module`` and all its submodules after creation
    (overriding marks they got from ``tensor_parallelism`` blocks)."""
    mark = Mark(enabled, strict)
    for sub in module.modules():
        sub._mp_tp = mark


def mark_of(model: nn.Module, path: str) -> Mark | None:
    """The mark governing the submodule at ``path``: its own or its nearest marked ancestor's."""
    segs = path.split(".") if path else []
    for i in range(len(segs), -1, -1):
        mark = model.get_submodule(".".join(segs[:i])).__dict__.get("_mp_tp")
        if mark is not None:
            return mark
    return None


def is_enabled(model: nn.Module, path: str) -> bool:
    mark = mark_of(model, path)
    return True if mark is None else mark.enabled


def is_strict(model: nn.Module) -> bool:
    """True when any mark in ``model`` asked for strict mode."""
    return any(getattr(m.__dict__.get("_mp_tp"), "strict", False) for m in model.modules())


@dataclass(frozen=True)
class Registration:
    """How to distribute every instance of a user's module class.

    Exactly one of ``plan`` (rules relative to the instance), ``style`` (a PyTorch ParallelStyle
    for the whole instance) or ``factory`` (``factory(module, tp_mesh) -> new module``) is set.
    """

    plan: ModulePlan | None = None
    style: ParallelStyle | None = None
    factory: Callable[..., nn.Module] | None = None
    init_hook: Callable[..., None] | None = None
    forward_hook: Callable[..., tuple] | None = None
    return_hook: Callable[..., Any] | None = None


def tp_register_with_module(module_cls: type, plan_or_dist_module, init_hook=None, forward_hook=None,
                            return_hook=None) -> None:
    """Make instances of ``module_cls`` distributable by ``DistributedModel``.

    Args:
        module_cls: the user's ``nn.Module`` subclass.
        plan_or_dist_module: a ``ModulePlan``, or a dict ``{submodule glob: style name}``, or a
            PyTorch ``ParallelStyle`` for the whole module, or a callable ``(module, tp_mesh) ->
            nn.Module`` returning the distributed replacement (e.g. a distributed module class).
        init_hook: ``init_hook(module, tp_mesh)`` run after sharding, for per-rank attributes.
        forward_hook: ``forward_hook(*args, **kwargs) -> (args, kwargs)`` run before forward.
        return_hook: ``return_hook(outputs) -> outputs`` run after forward.

    Raises:
        TypeError: if ``module_cls`` is not a module class or the plan is of an unknown kind.
    """
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise TypeError(f"tp_register_with_module needs an nn.Module subclass, got {module_cls!r}")
    hooks = dict(init_hook=init_hook, forward_hook=forward_hook, return_hook=return_hook)
    if isinstance(plan_or_dist_module, dict):
        plan_or_dist_module = ModulePlan(rules=dict(plan_or_dist_module))
    if isinstance(plan_or_dist_module, ModulePlan):
        reg = Registration(plan=plan_or_dist_module, **hooks)
    elif isinstance(plan_or_dist_module, ParallelStyle):
        reg = Registration(style=plan_or_dist_module, **hooks)
    elif callable(plan_or_dist_module):
        reg = Registration(factory=plan_or_dist_module, **hooks)
    else:
        raise TypeError(f"cannot register {module_cls.__name__} with {plan_or_dist_module!r}: expected a "
                        "ModulePlan, a dict of rules, a ParallelStyle or a callable")
    module_cls._mp_tp_registration = reg


def registration_of(module: nn.Module) -> Registration | None:
    return type(module).__dict__.get("_mp_tp_registration")


def install_hooks(module: nn.Module, reg: Registration) -> None:
    """Attach a registration's forward and return hooks to one distributed instance."""
    if reg.forward_hook is not None:
        def pre(mod, args, kwargs):
            return reg.forward_hook(*args, **kwargs)
        module.register_forward_pre_hook(pre, with_kwargs=True)
    if reg.return_hook is not None:
        module.register_forward_hook(lambda mod, args, out: reg.return_hook(out))
