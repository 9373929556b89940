"""SageMaker's registration form: a user's module class registered with a distributed module
class, its instances replaced in place at wrapping time.

Registering wraps the class's ``__init__`` so every later instance records its constructor
arguments (``_mp_init_args``); the replacement is built from them through the ``init_hook``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable


from .marks import Registration


def check_pair(value: Any, hook: str, owner: str) -> tuple[tuple, dict]:
    """``value`` as ``(args, kwargs)``, or a ``TypeError`` naming the hook and the class."""
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], dict)
    try:
        args = tuple(value[0]) if ok else None
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(f"{hook} of {owner} must return (args, kwargs): an iterable of positional arguments "
                        f"and a dict of keyword arguments, got {value!r}")
    return args, dict(value[1])


def _signature(fn: Callable, drop_self: bool) -> list[tuple]:
    params = list(inspect.signature(fn).parameters.values())[1 if drop_self else 0:]
    return [(p.name, p.kind, p.default) for p in params]


def check_hook_signature(hook: Callable | None, method: Callable, hook_name: str, where: str) -> None:
    """Refuse a hook whose signature differs from ``method``'s without ``self`` (names, order,
    kinds and defaults)."""
    if hook is None:
        return
    want, got = _signature(method, True), _signature(hook, False)
    if want != got:
        fmt = lambda sig: "(" + ", ".join(n if d is inspect.Parameter.empty else f"{n}={d!r}" for n, _, d in sig) + ")"
        raise TypeError(f"{hook_name} signature {fmt(got)} must match {where} {fmt(want)} exactly (without self)")


def _record_init_args(module_cls: type) -> None:
    """Wrap ``module_cls.__init__`` (once) so instances keep their constructor arguments."""
    if getattr(module_cls.__dict__.get("__init__"), "_mp_records", False):
        return
    init = module_cls.__init__

    @functools.wraps(init)
    def recording_init(self, *args, **kwargs):
        if "_mp_init_args" not in self.__dict__:
            self.__dict__["_mp_init_args"] = (args, kwargs)
        init(self, *args, **kwargs)

    recording_init._mp_records = True
    module_cls.__init__ = recording_init


def dist_registration(module_cls: type, dist_module: type, init_hook=None, forward_hook=None,
                      return_hook=None) -> Registration:
    """Check a SageMaker-form registration and prepare ``module_cls`` to record its arguments.

    Raises:
        TypeError: naming the class or the hook at fault.
    """
    from .modules import DistributedModule

    if not issubclass(dist_module, DistributedModule):
        raise TypeError(f"cannot register {module_cls.__name__} with {dist_module.__name__}: it is not an "
                        "smp.nn.DistributedModule subclass (register a plan, a ParallelStyle or a function "
                        "(module, tp_mesh) -> module to shard the module itself)")
    for name, hook in (("init_hook", init_hook), ("forward_hook", forward_hook), ("return_hook", return_hook)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{name} for {module_cls.__name__} must be callable, got {hook!r}")
    check_hook_signature(init_hook, module_cls.__init__, "init_hook", f"{module_cls.__name__}.__init__")
    check_hook_signature(forward_hook, module_cls.forward, "forward_hook", f"{module_cls.__name__}.forward")
    _record_init_args(module_cls)
    return Registration(dist_module=dist_module, init_hook=init_hook, forward_hook=forward_hook,
                        return_hook=return_hook)
