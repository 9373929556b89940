"""Expert parallelism applied to a model: check everything, then shard every experts module.

The architecture's ``ExpertLayout`` names the experts and router modules. Every problem (an
unknown MoE layout, experts not found, a number of experts the degree does not divide, an experts
module of another layout) is gathered and raised as one ``ValueError`` naming the module, the
numbers and the degree, before any tensor is touched or any collective runs.

With expert tensor parallelism (``expert_tensor_parallel`` at TP > 1) the experts are sharded
over the 2-D ``("ep", "tp")`` mesh (``style.PLACEMENTS``), so their intermediate size must divide
by the tensor-parallel degree; refused under ``sequence_parallel`` (each rank of the group would
hold other tokens at the MoE layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from .config import MoEConfig
from ..tp.layout import base_prefix
from ..tp.plan import glob_match, join, to_glob
from .layout import ExpertLayout
from .routing import apply_routing
from .style import WEIGHTS, ExpertParallel

_HF_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False}
"""HF's experts-layout flags (set by ``use_experts_implementation``) the dispatching forward
computes: gated, fused [gate | up] on dim 1, no bias, weights stored [E, out, in]."""


def _paths(model: nn.Module, layout: ExpertLayout) -> list[str]:
    return [path for path, _ in _matches(model, layout.experts)]


def _matches(model: nn.Module, glob: str) -> list[tuple[str, nn.Module]]:
    prefix = base_prefix(model)
    return [(path, m) for path, m in model.named_modules()
            if glob_match(join(prefix, glob), path)]


def _experts_problems(path: str, module: nn.Module, num_experts: int, tp: int) -> list[str]:
    problems = []
    for name in WEIGHTS:
        p = getattr(module, name, None)
        if not isinstance(p, nn.Parameter) or p.dim() != 3 or p.shape[0] != num_experts:
            shape = tuple(p.shape) if isinstance(p, nn.Parameter) else None
            problems.append(f"{path} ({type(module).__name__}).{name}: expected a [{num_experts}, ...] stacked "
                            f"parameter, found {shape}")
        elif isinstance(p, DTensor):
            problems.append(f"{path}.{name} is already distributed ({p.placements}); apply parallelism once")
    problems += _tensor_parallel_problems(path, module, tp) if not problems else []
    flags = {k: getattr(module, k) for k, want in _HF_FLAGS.items() if getattr(module, k, want) != want}
    if flags:
        problems.append(f"{path} ({type(module).__name__}): experts layout {flags} is not the gated, fused, "
                        f"untransposed, bias-free one expert parallelism computes")
    return problems


def _tensor_parallel_problems(path: str, module: nn.Module, tp: int) -> list[str]:
    """Why the experts of ``module`` cannot split over ``tp`` tensor-parallel ranks, if they cannot."""
    inter = module.down_proj.shape[2]
    if tp == 1 or (inter % tp == 0 and module.gate_up_proj.shape[1] == 2 * inter):
        return []
    return [f"{path} ({type(module).__name__}): expert_tensor_parallel needs the experts' intermediate size "
            f"{inter} (gate_up_proj {tuple(module.gate_up_proj.shape)}) divisible by tensor_parallel_degree {tp}"]


def collect(model: nn.Module, layout: ExpertLayout, ep: int, moe: MoEConfig | None,
            tp: int = 1) -> tuple[list, list]:
    """(experts modules, routers) of ``model`` by ``layout``, every problem raised at once.

    Raises:
        ValueError: naming each experts module, count or degree at fault.
    """
    config = model.config
    name = f"{type(model).__name__} (model_type {config.model_type!r})"
    num_experts = getattr(config, layout.num_experts, None)
    experts, routers = _matches(model, layout.experts), _matches(model, layout.router)
    problems = []
    if not experts:
        problems.append(f"{name}: no module matches the experts glob {layout.experts!r}")
    if not isinstance(num_experts, int) or num_experts < 1:
        problems.append(f"{name}: config.{layout.num_experts} = {num_experts!r} is not a number of experts")
    elif num_experts % ep:
        problems.append(f"{type(config).__name__}.{layout.num_experts} = {num_experts} is not divisible by "
                        f"expert_parallel_degree {ep} (each rank holds num_experts / {ep} whole experts)")
    else:
        for path, module in experts:
            problems += _experts_problems(path, module, num_experts, tp)
    needs_routers = moe is not None and (moe.moe_load_balancing == "sinkhorn" or moe.moe_z_loss_coeff > 0)
    if needs_routers and len(routers) != len(experts):
        problems.append(f"{name}: {len(routers)} routers match {layout.router!r} for {len(experts)} experts modules")
    if problems:
        raise ValueError("cannot apply expert parallelism:\n  - " + "\n  - ".join(problems))
    return [m for _, m in experts], [m for _, m in routers]


def unknown_layout(model: nn.Module, known: tuple[str, ...], why: str) -> ValueError:
    """The error for a model whose expert layout the library does not know."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return ValueError(f"{why}, but {type(model).__name__} (model_type {model_type!r}) has no built-in expert "
                      f"layout; the MoE architectures built in are {', '.join(known)} (modelparallel/models/)")


@dataclass
class ExpertWork:
    """What expert parallelism will do to one model, checked."""

    model: nn.Module
    experts: list[nn.Module]
    routers: list[nn.Module]
    moe: MoEConfig | None
    tp: int = 1
    """The expert tensor-parallel degree: 1, or the TP degree with ``expert_tensor_parallel``."""
    paths: tuple[str, ...] = ()
    """The experts modules' paths, layer indices as ``*`` (as the TP walker reports modules)."""

    def still_replicated(self, replicated: list[str]) -> list[str]:
        """``replicated`` (paths the TP walker left whole on every TP rank) without the experts
        modules when expert tensor parallelism splits them over "tp"."""
        return [p for p in replicated if self.tp == 1 or p not in self.paths]

    def within(self, model: nn.Module) -> ExpertWork:
        """The work on the modules still in ``model``: a pipeline stage keeps its own layers only,
        and the experts of the others, dropped with their layers, are never sharded."""
        here = {id(m) for m in model.modules()}
        return ExpertWork(self.model, [m for m in self.experts if id(m) in here],
                          [m for m in self.routers if id(m) in here], self.moe)


def check_experts(model: nn.Module, ep: int, layout: ExpertLayout | None, moe: MoEConfig | None,
                  known: tuple[str, ...] = (), tp: int = 1, sequence_parallel: bool = False) -> ExpertWork | None:
    """Check expert parallelism at degree ``ep`` and ``moe``'s options against ``model``; change
    nothing. None when there is nothing to do (degree 1 without a ``MoEConfig``, or
    ``smp_moe=False``).

    Args:
        model: the top-level HF model (real or on meta).
        ep: ``expert_parallel_degree``.
        layout: the architecture's ``ExpertLayout``, or None if it has none.
        moe: SageMaker's ``MoEConfig`` given to ``transform``, or None (the model's own routing).
        known: the model types that have a layout, for the error message.
        tp: the expert tensor-parallel degree (1: each TP group holds its experts whole).
        sequence_parallel: whether the hidden states reach the MoE layers split over "tp".

    Raises:
        ValueError: expert parallelism or MoE options asked for a model they do not fit (see
            ``collect``).
        NotImplementedError: expert tensor parallelism under sequence parallelism.
    """
    if tp > 1 and sequence_parallel:
        raise NotImplementedError("expert_tensor_parallel with sequence_parallel (the experts' tensor-parallel "
                                  "ranks would hold different tokens); use one of them")
    if moe is not None and not moe.smp_moe:
        if ep > 1 or tp > 1:
            raise ValueError(f"MoEConfig(smp_moe=False) keeps Hugging Face's own MoE layers, which cannot run "
                             f"expert_parallel_degree {ep} or expert_tensor_parallel at degree {tp}; use "
                             f"smp_moe=True or degree 1")
        return None
    if ep == 1 and tp == 1 and moe is None:
        return None
    if layout is None:
        asked = f"expert_parallel_degree {ep}" if ep > 1 else \
            f"expert_tensor_parallel at degree {tp}" if tp > 1 else "a MoEConfig was given"
        raise unknown_layout(model, known, asked)
    experts, routers = collect(model, layout, ep, moe, tp)
    return ExpertWork(model, experts, routers, moe, tp, tuple({to_glob(p) for p in _paths(model, layout)}))


def apply_experts(work: ExpertWork | None, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None) -> None:
    """Carry out checked ``work``: shard every experts module over ``ep_mesh`` (when it has more
    than one rank), or over ``ep_tp_mesh`` (the 2-D ``("ep", "tp")`` mesh) with expert tensor
    parallelism, and apply the routing options."""
    if work is None:
        return
    moe = work.moe
    style = ExpertParallel(all_to_all=moe.moe_all_to_all_dispatcher if moe is not None else True)
    if work.tp > 1:
        for module in work.experts:
            style.apply(module, ep_tp_mesh)
    elif ep_mesh.size() > 1:
        for module in work.experts:
            parallelize_module(module, ep_mesh, style)
    if moe is not None:
        apply_routing(work.model, work.routers, moe.moe_load_balancing, moe.moe_aux_loss_coeff,
                      moe.moe_z_loss_coeff)
