"""Before sharding: put distributed modules in place of the modules that should become them.

Walking the model from the top, the outermost supported module on each branch is distributed:
an instance of a class registered with a distributed module class is replaced by one built from
its recorded constructor arguments; an ``nn.Linear`` / ``nn.Embedding`` marked for tensor
parallelism becomes a ``DistributedLinear`` / ``DistributedEmbedding`` (same parameters); a
distributed module created in a block with overrides is rebuilt with them. A candidate whose
sizes the degree does not divide, or whose weight is shared with another module, stays as it is
and the reason is logged once. Everything else (built-in architectures, plan registrations,
distributed modules' own plans) is left to the walker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from . import marks
from .register import check_pair

logger = logging.getLogger("modelparallel")


def _device(module: nn.Module) -> torch.device | None:
    return next((t.device for t in module.parameters()), None)


def _disabled_inside(module: nn.Module) -> bool:
    return any(getattr(m.__dict__.get("_mp_tp"), "enabled", True) is False for m in list(module.modules())[1:])


def _creation_mark(module: nn.Module):
    """The mark of the block a module was built in: a module built at the top of a block is
    nobody's child there, so only its submodules carry the block's mark."""
    return next((m.__dict__["_mp_tp"] for m in module.modules() if "_mp_tp" in m.__dict__), None)


def _held_elsewhere(model: nn.Module, module: nn.Module) -> bool:
    ids = {id(p) for p in module.parameters(recurse=False)}
    return any(id(p) in ids for m in model.modules() if m is not module for p in m.parameters(recurse=False))


class Substitution:
    """One pass over a model; ``probe(module) -> problems`` checks a candidate's plan."""

    def __init__(self, model: nn.Module, probe: Callable[[nn.Module], list[str]], whole_model: bool):
        from .modules import DistributedEmbedding, DistributedLinear, DistributedModule, init_params

        self.model, self.probe, self.whole_model = model, probe, whole_model
        self.kinds = (DistributedModule, DistributedLinear, DistributedEmbedding)
        self.init_params = init_params
        self.kept: list[str] = []
        self.used: set[str] = set()

    def run(self) -> None:
        self._visit("", self.model)
        if self.kept:
            logger.warning("tensor parallelism not enabled for (kept whole on every rank): %s", "; ".join(self.kept))

    def _visit(self, path: str, module: nn.Module) -> None:
        mark = marks.mark_of(self.model, path)
        if (mark is None or mark.enabled) and self._handle(path, module, mark):
            return
        for name, child in list(module.named_children()):
            self._visit(f"{path}.{name}" if path else name, child)

    def _handle(self, path: str, module: nn.Module, mark) -> bool:
        """Distribute ``module`` if it is supported; True when its subtree is taken care of."""
        dist_base, dist_linear, dist_embedding = self.kinds
        reg = type(module).__dict__.get("_mp_tp_registration")
        if mark is None and (reg is not None or isinstance(module, dist_base)):
            mark = _creation_mark(module)
        if isinstance(module, dist_base):
            if mark is not None and mark.overrides and not _disabled_inside(module):
                self._replace(path, module, type(module), None, mark)
            return True
        if reg is not None and reg.dist_module is None:
            return True  # a plan registration: the walker shards it
        if reg is not None:
            return not _disabled_inside(module) and self._replace(path, module, reg.dist_module, reg, mark)
        if not path and self.whole_model:
            return True  # a built-in architecture: its plan covers the model
        explicit = mark is not None and mark.enabled
        if explicit and type(module) in (nn.Linear, nn.Embedding):
            return self._convert(path, module, dist_linear if type(module) is nn.Linear else dist_embedding)
        return False

    def _args(self, path: str, module: nn.Module, dist_cls: type, reg, mark) -> tuple[tuple, dict]:
        recorded = module.__dict__.get("_mp_init_args")
        if recorded is None:
            raise ValueError(f"{path or '<model>'} ({type(module).__name__}) was created before its class was "
                             "registered with tp_register_with_module, so its constructor arguments are unknown; "
                             "register the class before building the model")
        args, kwargs = recorded
        if reg is not None and reg.init_hook is not None:
            args, kwargs = check_pair(reg.init_hook(*args, **kwargs), "init_hook", type(module).__name__)
        accepted = self.init_params(dist_cls)
        dropped = sorted(k for k in kwargs if k not in accepted)
        if dropped:
            logger.info("%s: %s takes no %s; ignored", path or "<model>", dist_cls.__name__, dropped)
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        overrides = {k: v for k, v in (mark.overrides if mark is not None else ()) if k in accepted}
        self.used |= set(overrides)
        return tuple(args), {**kwargs, **overrides}

    def _replace(self, path: str, module: nn.Module, dist_cls: type, reg, mark) -> bool:
        args, kwargs = self._args(path, module, dist_cls, reg, mark)
        with torch.device("meta"):
            candidate = dist_cls(*args, **kwargs)
        problems = self.probe(candidate)
        if problems:
            self.kept.append(f"{path or '<model>'} ({type(module).__name__}): {' / '.join(problems)}")
            return False
        device = _device(module)
        if device is not None and device.type != "meta":
            with torch.device(device):
                candidate = dist_cls(*args, **kwargs)
            self._copy_weights(path, module, candidate)
        candidate.__dict__["_mp_init_args"] = (args, kwargs)
        if "_mp_tp" in module.__dict__:
            candidate._mp_tp = module._mp_tp
        if reg is not None:
            marks.install_hooks(candidate, reg)
        self._put(path, module, candidate)
        return True

    def _copy_weights(self, path: str, old: nn.Module, new: nn.Module) -> None:
        """Keep the old module's weights when its state dict has the new one's layout."""
        old_sd, new_sd = old.state_dict(), new.state_dict()
        if old_sd.keys() == new_sd.keys() and all(old_sd[k].shape == new_sd[k].shape for k in old_sd):
            new.load_state_dict(old_sd)
        elif old_sd:
            logger.info("%s: %s has another parameter layout than %s; it starts from its own initialization",
                        path or "<model>", type(new).__name__, type(old).__name__)

    def _put(self, path: str, old: nn.Module, new: nn.Module) -> None:
        if not path:  # the model itself: it becomes the distributed module
            old.__dict__.clear()
            old.__dict__.update(new.__dict__)
            old.__class__ = new.__class__
            return
        parent, _, name = path.rpartition(".")
        setattr(self.model.get_submodule(parent), name, new)

    def _convert(self, path: str, module: nn.Module, dist_cls: type) -> bool:
        if _held_elsewhere(self.model, module):
            self.kept.append(f"{path} ({type(module).__name__}): its weight is shared with another module")
            return True
        linear = isinstance(module, nn.Linear)
        with torch.device("meta"):
            probe = (dist_cls(module.in_features, module.out_features) if linear
                     else dist_cls(module.num_embeddings, module.embedding_dim))
        problems = self.probe(probe)
        if problems:
            self.kept.append(f"{path} ({type(module).__name__}): {' / '.join(problems)}")
            return True
        if not linear:
            if module.max_norm is not None or module.sparse:
                self.kept.append(f"{path} (Embedding): max_norm / sparse embeddings are not distributed")
                return True
            module.initializer_range = 0.02
        module.__class__ = dist_cls
        return True

    def check_overrides(self) -> None:
        """Refuse overrides no distributed module in the model took."""
        asked = {k for m in self.model.modules() for k, _ in getattr(m.__dict__.get("_mp_tp"), "overrides", ())}
        unused = sorted(asked - self.used)
        if unused:
            raise NotImplementedError(f"tensor_parallelism options {unused} set arguments of smp.nn distributed "
                                      "modules, but no distributed module built for this model takes them")


def substitute(model: nn.Module, probe: Callable[[nn.Module], list[str]], whole_model: bool) -> None:
    """Replace and convert modules of ``model`` in place (see the module docstring).

    Args:
        model: the model, before sharding.
        probe: returns the walker's problems for a candidate distributed module (empty if it fits).
        whole_model: the model has a built-in plan, which covers everything in it.

    Raises:
        ValueError: a registered module created before its registration.
        TypeError: a hook returning something other than ``(args, kwargs)``.
        NotImplementedError: overrides that no distributed module takes.
    """
    sub = Substitution(model, probe, whole_model)
    sub.run()
    sub.check_overrides()
