"""The one walker: checks a model's plans against the model, then shards it in place.

Nothing is touched until the whole plan has been checked: rules that match nothing, module types
a style cannot shard, sizes not divisible by the degree, linear layers inside a planned block that
no rule covers, and tied weights split between sharded and replicated holders all raise one
``ValueError`` naming every module path and number at fault. First, ``substitute`` puts
distributed modules in place of registered and marked ones (their plans are then collected like
any other); a distributed module's plan is collected from the module itself (``tp_plan``).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from transformers.pytorch_utils import Conv1D

from . import marks, model_checks, per_rank, sequence
from .kv_heads import collect_kv
from .layout import base_prefix, shard_range, tied_parameters
from .loss import install_vocab_parallel_loss
from .local import install_shared_input
from .plan import (VOCAB_STYLES, ArchSpec, ModulePlan, Packed, SharedInput, block_prefix, first_match, glob_match,
                   join, packing, to_glob, without_styles)
from .styles import ALLOWS_UNEVEN, NOT_SPLIT, SUPPORTED_TYPES, build_style, packed_problem, sharded_size
from .substitute import substitute

logger = logging.getLogger("modelparallel")

_SHARDABLE = (nn.Linear, Conv1D, nn.Embedding)


@dataclass
class Assignment:
    path: str
    module: nn.Module
    style: str
    chunks: int = 1
    registered: bool = False
    packed: Packed | None = None
    prebuilt: object = None  # a style built from the plan's data (kv_replicated), used as is


@dataclass
class Work:
    """Everything the walker will do, gathered (and checked) before doing any of it."""

    assignments: list[Assignment] = field(default_factory=list)
    rewrites: list[tuple[str, nn.Module, str, int]] = field(default_factory=list)
    registered: list[tuple[str, nn.Module, marks.Registration]] = field(default_factory=list)
    holders: set[tuple[int, str]] = field(default_factory=set)
    shared: list[tuple[str, nn.Module, SharedInput]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    loss: str | None = None  # the architecture's LM loss kind for this head class (None: by class name)


def _check_size(a: Assignment, tp: int, problems: list[str]) -> None:
    if a.style in NOT_SPLIT:
        return
    what, n = sharded_size(a.style, a.module, a.chunks)
    if a.style in ALLOWS_UNEVEN:
        first, last = shard_range(n, tp, 0), shard_range(n, tp, tp - 1)
        if last[0] == last[1]:
            problems.append(f"{a.path}: {what} = {n} is too small for tensor_parallel_degree {tp} "
                            f"(a shard of {first[1] - first[0]} leaves the last rank empty)")
    elif n % tp:
        problems.append(f"{a.path}: {what} = {n} is not divisible by tensor_parallel_degree {tp}")


def _collect_plan(model, plan: ModulePlan, prefix: str, tp: int, work: Work, skip: tuple[str, ...],
                  registered: bool = False):
    """Match one plan's rules under ``prefix`` and check every match (rule ``""`` is the module
    at ``prefix`` itself)."""
    root = model.get_submodule(prefix)
    rel_modules = dict(root.named_modules())
    def live(rel):
        full = join(prefix, rel)
        return marks.is_enabled(model, full) and not any(full.startswith(s + ".") for s in skip)

    for rule, style in plan.rules.items():
        matched = [rel for rel in rel_modules if (rel or not rule) and glob_match(rule, rel)]
        if not matched and rule not in plan.optional_rules:
            work.problems.append(f"rule {rule!r} -> {style!r} matches no module in "
                                 f"{type(root).__name__}{' at ' + prefix if prefix else ''}")
        for rel in filter(live, matched):
            module, path = rel_modules[rel], join(prefix, rel)
            if not isinstance(module, SUPPORTED_TYPES.get(style, ())):
                work.problems.append(f"{path}: style {style!r} cannot shard a {type(module).__name__}")
                continue
            packed = packing(plan, rel)
            a = Assignment(path, module, style, packed.chunks if packed else 1, registered, packed)
            problem = packed and packed_problem(path, module, packed)
            if problem:
                work.problems.append(problem)
            _check_size(a, tp, work.problems)
            work.assignments.append(a)
    for glob, attrs in plan.per_rank_attrs.items():
        for rel in filter(live, [r for r in rel_modules if glob_match(glob, r)]):
            for attr in attrs:
                value = per_rank.read(rel_modules[rel], attr)
                if value % tp:
                    work.problems.append(f"{join(prefix, rel)}.{attr} = {value} is not divisible by "
                                         f"tensor_parallel_degree {tp}")
                work.rewrites.append((join(prefix, rel), rel_modules[rel], attr, value // tp))
    _collect_holders(plan, rel_modules, work)
    collect_kv(plan, prefix, rel_modules, getattr(model, "config", None), tp, live, work)
    _collect_shared(plan, prefix, rel_modules, live, work)
    blocks = {b for b in map(block_prefix, plan.rules) if b}
    for rel, module in rel_modules.items():
        in_block = any(glob_match(b, ".".join(rel.split(".")[: len(b.split("."))])) for b in blocks)
        covered = first_match(plan.rules, rel) or first_match(plan.replicated, rel)
        if in_block and isinstance(module, _SHARDABLE) and live(rel) and not covered:
            work.problems.append(f"{join(prefix, rel)} ({type(module).__name__}) is inside a planned block "
                                 "but no rule covers it")


_READS_SHARED = ("colwise", "packed_colwise", "kv_replicated")


def _below(path: str, other: str) -> bool:
    """True when module ``other`` sits strictly below module ``path`` ("" is the root)."""
    return other != path and (not path or other.startswith(path + "."))


def _collect_shared(plan: ModulePlan, prefix: str, rel_modules: dict[str, nn.Module], live, work: Work) -> None:
    """Match and check a plan's shared-input rules: the argument or child must exist and
    column-parallel layers must sit below."""
    for glob, shared in plan.shared_inputs.items():
        matched = [rel for rel in rel_modules if glob_match(glob, rel)]
        if not matched:
            work.problems.append(f"shared input rule {glob!r} matches no module")
        for rel in filter(live, matched):
            module, path = rel_modules[rel], join(prefix, rel)
            if bool(shared.arg) == bool(shared.output_of):
                work.problems.append(f"{path}: a SharedInput names exactly one of arg and output_of")
            elif shared.arg and shared.arg not in inspect.signature(module.forward).parameters:
                work.problems.append(f"{path}: {type(module).__name__}.forward has no argument {shared.arg!r}")
            elif shared.output_of and join(rel, shared.output_of) not in rel_modules:
                work.problems.append(f"{path}: no child {shared.output_of!r} for the shared input")
            elif not any(_below(path, a.path) and a.style in _READS_SHARED for a in work.assignments):
                work.problems.append(f"{path}: shared input rule but no column-parallel layer below it")
            else:
                work.shared.append((path, module, shared))


def _shared_input_apply(work: Work, tp_mesh: DeviceMesh, split: list[str]) -> None:
    """Apply ``f`` once per shared input (the sequence all-gather inside the ``split`` blocks);
    the column-parallel layers below skip their own."""
    for path, module, shared in work.shared:
        install_shared_input(module, shared, tp_mesh, sequence_parallel=sequence.inside(path, split))
        for a in work.assignments:
            if _below(path, a.path) and a.style in _READS_SHARED:
                a.module._mp_shared_input = True


def _collect_holders(plan: ModulePlan, rel_modules: dict[str, nn.Module], work: Work) -> None:
    """Record the parameters a plan declares as mere holders of a tie (``module.param`` globs)."""
    for rel, module in rel_modules.items():
        for name in module._parameters:
            if first_match(plan.tied_holders, join(rel, name)):
                work.holders.add((id(module), name))


def _check_config(model: nn.Module, spec: ArchSpec, tp: int, problems: list[str]) -> None:
    model_checks.refuse_unsupported(model, spec, tp)
    problems.extend(model_checks.attention_problems(model))
    for attr in spec.divisible_config:
        value = getattr(model.config, attr, None)
        if value is not None and value % tp:
            problems.append(f"{type(model.config).__name__}.{attr} = {value} is not divisible by "
                            f"tensor_parallel_degree {tp} (each rank must hold whole heads)")


def collect(model: nn.Module, spec: ArchSpec | None, tp: int) -> Work:
    """Gather and check everything the walker would do to ``model``; modify nothing."""
    work = Work()
    outer: list[str] = []  # user-registered modules: the outermost one shards its whole subtree
    for path, module in model.named_modules():
        reg = marks.registration_of(module)
        if reg is None or not marks.is_enabled(model, path) or any(o == "" or path.startswith(o + ".") for o in outer):
            continue
        work.registered.append((path, module, reg))
        if reg.plan is not None:
            _collect_plan(model, reg.plan, path, tp, work, (), registered=True)
        if "_mp_tp_registration" in type(module).__dict__:
            outer.append(path)
    skip = tuple(path for path, _, _ in work.registered)
    if spec is not None and marks.is_enabled(model, ""):
        _check_config(model, spec, tp, work.problems)
        work.loss = spec.loss_for(type(model))
        _collect_plan(model, spec.base, base_prefix(model), tp, work, skip)
        _collect_plan(model, spec.head, "", tp, work, skip)
        work.problems.extend(model_checks.vocab_problems(model, work.assignments))
    _check_ties(model, work)
    return work


def _check_ties(model: nn.Module, work: Work) -> None:
    styled = {id(a.module): a.style for a in work.assignments}
    for group in tied_parameters(model):
        styles = {styled.get(id(mod)) for _, mod, name in group if (id(mod), name) not in work.holders}
        if len(styles) > 1 and None in styles:
            paths = ", ".join(join(p, n) for p, _, n in group)
            work.problems.append(f"tied parameters {paths} would be split between sharded and replicated "
                                 "modules; plan all of them or none")


def _retie(groups) -> None:
    """Point every holder of a tie at one parameter: the sharded one if sharding replaced any."""
    for group in groups:
        keep = next((t for t in (getattr(m, n) for _, m, n in group) if isinstance(t, DTensor)),
                    getattr(group[0][1], group[0][2]))
        for mpath, mod, name in group:
            other = getattr(mod, name)
            if isinstance(other, DTensor) and other.placements != keep.placements:
                raise ValueError(f"tied parameter {join(mpath, name)} sharded as {other.placements}, "
                                 f"its tie as {keep.placements}")
            setattr(mod, name, keep)


def _apply_registered(model: nn.Module, tp_mesh: DeviceMesh, path: str, module: nn.Module, reg) -> None:
    if reg.style is not None:
        parallelize_module(module, tp_mesh, reg.style)
    elif reg.factory is not None:
        if not path:
            raise ValueError("a factory registration cannot replace the top-level model itself")
        parent, _, name = path.rpartition(".")
        module = reg.factory(module, tp_mesh)
        setattr(model.get_submodule(parent), name, module)
    if reg.init_hook is not None:
        reg.init_hook(module, tp_mesh)
    marks.install_hooks(module, reg)


def apply(model: nn.Module, tp_mesh: DeviceMesh, work: Work, split: list[tuple[str, nn.Module]] = ()) -> None:
    """Carry out checked ``work``: shard, rewrite per-rank sizes, restore ties, install the loss;
    with ``split`` blocks, sequence parallelism inside them."""
    groups = tied_parameters(model)
    for a in work.assignments:
        parallelize_module(a.module, tp_mesh, a.prebuilt or build_style(a.style, a.module, a.packed or a.chunks))
    if split:
        sequence.apply(list(split), tp_mesh, [(a.path, a.module, a.style) for a in work.assignments],
                       lambda m: parallelize_module(m, tp_mesh, build_style("replicated_grad_sum", m)))
    _shared_input_apply(work, tp_mesh, [p for p, _ in split])
    for _, module, attr, value in work.rewrites:
        per_rank.write(module, attr, value)
    for path, module, reg in work.registered:
        _apply_registered(model, tp_mesh, path, module, reg)
    _retie(groups)
    if any(a.style == "vocab_colwise" and not a.registered for a in work.assignments):
        install_vocab_parallel_loss(model, work.loss)


def replicated_paths(model: nn.Module, work: Work) -> list[str]:
    """Globbed paths of modules with their own parameters that stay whole on every rank."""
    sharded = {a.path for a in work.assignments}
    under = [p for p, _, _ in work.registered]
    out = []
    for path, mod in model.named_modules():
        own = any(p is not None and not isinstance(p, DTensor) for p in mod._parameters.values())
        if own and path not in sharded and not any(path == u or path.startswith(u + ".") for u in under):
            out.append(to_glob(path))
    return sorted(set(out))


def parallelize(model: nn.Module, tp_mesh: DeviceMesh, spec: ArchSpec | None,
                sequence_parallel: bool = False) -> list[str]:
    """Check, then shard ``model`` in place over ``tp_mesh``; return the replicated module globs.
    ``sequence_parallel`` (at a degree > 1): Megatron's sequence parallelism in the plan's blocks.

    Raises:
        ValueError: naming every problem, before any tensor is touched.
        NotImplementedError: sequence parallelism of a model whose plan is not known to run under it.
    """
    tp = tp_mesh.size()
    if spec is not None and marks.option(model, "distribute_embedding") is False:
        spec = without_styles(spec, VOCAB_STYLES)  # asked for explicitly: vocabulary layers whole
    substitute(model, lambda module: collect(module, None, tp).problems,
               whole_model=spec is not None and marks.is_enabled(model, ""))
    work = collect(model, spec, tp)
    if spec is None and not work.registered and marks.is_enabled(model, ""):
        msg = (f"{type(model).__name__} (model_type {getattr(getattr(model, 'config', None), 'model_type', '?')!r}) "
               "has no tensor-parallel plan and no tp_register_with_module registration")
        if marks.is_strict(model):
            raise ValueError(msg + "; tensor_parallelism(strict=True) refuses to keep it replicated")
        logger.warning("%s: it stays replicated on every rank", msg)
    split = []
    if sequence_parallel and tp > 1:
        model_checks.refuse_sequence_parallel(model, spec)
        split = sequence.blocks(model, spec)
        work.problems += sequence.problems(split)
    if work.problems:
        raise ValueError("cannot apply the tensor-parallel plan:\n  - " + "\n  - ".join(work.problems))
    apply(model, tp_mesh, work, split)
    return replicated_paths(model, work)
