"""Which modules get distributed: the ``tensor_parallelism`` context, ``set_tensor_parallelism`` and
``tp_register_with_module``.

Marks live on the modules themselves (``_mp_tp``) and registrations on the user's module class
(``_mp_tp_registration``), so the library keeps no global state for them beyond the stack of open
``tensor_parallelism`` blocks. A module's mark is its own or that of its nearest marked ancestor;
an unmarked model is distributed whole.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from .creation_marks import CreationMarks
from .plan import ModulePlan


@dataclass(frozen=True)
class Mark:
    """What a ``tensor_parallelism`` block or ``set_tensor_parallelism`` call asked for.

    ``overrides`` holds keyword arguments for the distributed modules that replace modules in
    its scope; ``options`` the ``model_creation`` options given explicitly.
    """

    enabled: bool
    strict: bool = False
    overrides: tuple = ()
    options: tuple = ()


_KERNEL_OPTIONS = ("fused_softmax", "fused_bias_gelu", "fused_dropout", "zero_init")
"""Options that choose kernels or memory layout only (PyTorch picks its kernels)."""

_CREATION_DEFAULTS = dict(dtype=None, distribute_embedding=False, use_alibi=False, attention_in_fp32=False,
                          query_key_layer_scaling=False, flash_attention=None, delayed_init=True)
"""``model_creation`` options with their defaults: a default value is accepted and does nothing."""

_HONOURED = ("distribute_embedding",)


def _split_options(owner: str, kwargs: dict) -> tuple[tuple, tuple]:
    """Sort keyword options into overrides (distributed-module constructor arguments) and
    creation options; refuse what cannot be honoured, naming it."""
    from .modules import constructor_args

    overrides, options, refused, unknown = {}, {}, [], []
    accepted = constructor_args()
    for key, value in kwargs.items():
        if key in accepted:
            overrides[key] = value
        elif key in _KERNEL_OPTIONS:
            continue
        elif key in _CREATION_DEFAULTS:
            if key in _HONOURED:
                options[key] = value
            elif value != _CREATION_DEFAULTS[key]:
                refused.append(f"{key}={value!r}")
        else:
            unknown.append(key)
    if unknown:
        raise TypeError(f"{owner}: unknown keyword arguments {sorted(unknown)} (neither an smp.nn module "
                        "argument nor a model_creation option)")
    if refused:
        raise NotImplementedError(f"{owner}: options not implemented here: {', '.join(refused)} (use "
                                  "smp.model_creation for creation options)")
    return tuple(sorted(overrides.items())), tuple(sorted(options.items()))


_MARKS = CreationMarks("_mp_tp")


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, strict: bool = False, **kwargs: Any):
    """Mark modules created inside this block for (or, with ``enabled=False``, against) tensor
    parallelism; ``DistributedModel`` then distributes the outermost supported ones. The
    innermost block wins.

    Args:
        enabled: distribute the modules created here.
        strict: raise, instead of logging, when a marked model has no plan or registration.
        kwargs: arguments of the ``smp.nn`` distributed modules that replace modules created
            here (they override the ``init_hook``'s), and ``smp.model_creation`` options: kernel
            choices are accepted, ``distribute_embedding`` is honoured, others only at their
            default.

    Raises:
        TypeError: for an unknown keyword.
        NotImplementedError: for a creation option this block cannot honour.
    """
    overrides, options = _split_options("tensor_parallelism", kwargs)
    with _MARKS.marking(Mark(enabled, strict, overrides, options)):
        yield


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, strict: bool = False, **kwargs: Any) -> None:
    """Switch tensor parallelism on or off for ``module`` and all its submodules after creation
    (overriding marks they got from ``tensor_parallelism`` blocks); ``kwargs`` as
    ``tensor_parallelism``'s."""
    overrides, options = _split_options("set_tensor_parallelism", kwargs)
    mark = Mark(enabled, strict, overrides, options)
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


def option(model: nn.Module, name: str, default: Any = None) -> Any:
    """A ``model_creation`` option given explicitly to a block or call that marked ``model``."""
    for m in model.modules():
        found = dict(getattr(m.__dict__.get("_mp_tp"), "options", ()))
        if name in found:
            return found[name]
    return default


def is_strict(model: nn.Module) -> bool:
    """True when any mark in ``model`` asked for strict mode."""
    return any(getattr(m.__dict__.get("_mp_tp"), "strict", False) for m in model.modules())


@dataclass(frozen=True)
class Registration:
    """How to distribute every instance of a user's module class.

    Exactly one of ``dist_module`` (a distributed module class that replaces each instance,
    built from the instance's recorded constructor arguments), ``plan`` (rules relative to the
    instance), ``style`` (a PyTorch ParallelStyle for the whole instance) or ``factory``
    (``factory(module, tp_mesh) -> new module``) is set.
    """

    plan: ModulePlan | None = None
    style: ParallelStyle | None = None
    factory: Callable[..., nn.Module] | None = None
    init_hook: Callable[..., Any] | None = None
    forward_hook: Callable[..., tuple] | None = None
    return_hook: Callable[..., Any] | None = None
    dist_module: type | None = None


def tp_register_with_module(module_cls: type, dist_module, init_hook=None, forward_hook=None,
                            return_hook=None) -> None:
    """Make instances of ``module_cls`` distributable by ``DistributedModel``.

    Two forms. SageMaker's: ``dist_module`` is an ``smp.nn.DistributedModule`` subclass;
    ``DistributedModel`` replaces each instance in place by ``dist_module(*args, **kwargs)``, with
    ``(args, kwargs) = init_hook(*orig_args, **orig_kwargs)`` from the instance's own constructor
    arguments (identity without a hook), and ``forward_hook(*args, **kwargs) -> (args, kwargs)`` /
    ``return_hook(output) -> output`` translate its calls. This library's extension:
    ``dist_module`` is a ``ModulePlan``, a dict ``{submodule glob: style name}``, a PyTorch
    ``ParallelStyle`` for the whole module, or a function ``(module, tp_mesh) -> nn.Module``; the
    instance is sharded in place and ``init_hook(module, tp_mesh)`` runs afterwards.

    Raises:
        TypeError: if ``module_cls`` is not a module class, ``dist_module`` a module class that is
            not a ``DistributedModule``, a hook's signature differs from the method it translates,
            or the second argument is of an unknown kind.
    """
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise TypeError(f"tp_register_with_module needs an nn.Module subclass, got {module_cls!r}")
    hooks = dict(init_hook=init_hook, forward_hook=forward_hook, return_hook=return_hook)
    if isinstance(dist_module, type) and issubclass(dist_module, nn.Module):
        from . import register

        reg = register.dist_registration(module_cls, dist_module, **hooks)
    elif isinstance(dist_module, dict):
        reg = Registration(plan=ModulePlan(rules=dict(dist_module)), **hooks)
    elif isinstance(dist_module, ModulePlan):
        reg = Registration(plan=dist_module, **hooks)
    elif isinstance(dist_module, ParallelStyle):
        reg = Registration(style=dist_module, **hooks)
    elif callable(dist_module):
        reg = Registration(factory=dist_module, **hooks)
    else:
        raise TypeError(f"cannot register {module_cls.__name__} with {dist_module!r}: expected an "
                        "smp.nn.DistributedModule subclass, a ModulePlan, a dict of rules, a ParallelStyle or a "
                        "function (module, tp_mesh) -> module")
    module_cls._mp_tp_registration = reg


def tp_register(dist_module, init_hook=None, forward_hook=None, return_hook=None):
    """Class decorator form of ``tp_register_with_module``: ``@smp.tp_register(dist_module, ...)``.

    Returns:
        The decorator, which registers the class and returns it unchanged.
    """
    def decorate(module_cls):
        tp_register_with_module(module_cls, dist_module, init_hook, forward_hook, return_hook)
        return module_cls

    return decorate


def registration_of(module: nn.Module) -> Registration | None:
    """The registration of ``module``'s class, or a plan registration for a distributed module
    that carries its own plan."""
    reg = type(module).__dict__.get("_mp_tp_registration")
    if reg is None and isinstance(getattr(type(module), "tp_plan", None), ModulePlan):
        reg = Registration(plan=type(module).tp_plan)
    return reg


def install_hooks(module: nn.Module, reg: Registration) -> None:
    """Attach a registration's forward and return hooks to one distributed instance."""
    if reg.forward_hook is not None:
        def pre(mod, args, kwargs):
            from .register import check_pair

            return check_pair(reg.forward_hook(*args, **kwargs), "forward_hook", type(mod).__name__)
        module.register_forward_pre_hook(pre, with_kwargs=True)
    if reg.return_hook is not None:
        module.register_forward_hook(lambda mod, args, out: reg.return_hook(out))
