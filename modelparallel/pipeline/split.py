"""Cutting a Hugging Face model into pipeline stages, from its architecture's data.

An architecture says where its repeated blocks are and which base-model modules run before
them (embeddings) and after them (final norm, pooler): ``PipelineSplit`` in
``models/<arch>.py``. Stage ``s`` of ``S`` keeps a contiguous range of blocks; the first stage
also the embeddings, the last the final modules and everything of the head model outside the
base model (LM head, classifier). Parameter-free base-model modules (rotary tables, dropout)
stay on every stage. With ``V`` virtual stages per rank (``pipeline_virtual_stages``) there are
``S = P x V`` stages on ``P`` pipeline ranks and rank ``r`` runs stages ``r, r + P, ...``: the
first stage is on rank 0 and the last on rank ``P - 1``, as without them.

Nothing is traced and the HF forward is not rewritten: every stage runs the model's own
``forward`` on the microbatch's inputs (masks, position ids and rotary tables are computed
locally from them). Modules of other stages are replaced by ``Elsewhere`` stubs holding no
parameters: a stub of an embedding returns zeros of the embedding's output shape (the first
local block's input is then swapped for the activation received from the previous stage), a
stub of a final module raises if called (the stage's forward ends after its last block). Blocks
of other stages are removed from their ``ModuleList`` (the others keep their indices, so
parameter names are those of the whole model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..tp.layout import base_prefix, tie_groups
from ..tp.plan import join


@dataclass(frozen=True)
class PipelineSplit:
    """Where an architecture cuts into stages (paths relative to the base model).

    Attributes:
        blocks: the ``nn.ModuleList`` of repeated blocks (``h``, ``layers``, ``encoder.layer``).
        first: modules that run before the blocks, kept by the first stage (embeddings).
        last: modules that run after the blocks, kept by the last stage with the head model's
            own modules (final norm, pooler).
    """

    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...] = ()


def hf_pipeline_split(model: nn.Module) -> PipelineSplit | None:
    """HF's ``base_model_pp_plan`` of ``model`` as a ``PipelineSplit``: the one ``nn.ModuleList``
    among its entries is the blocks, the entries with parameters before it run on the first
    stage, those after it on the last (parameter-free ones, such as dropout, stay on every
    stage). None where the model has no such plan (or no config) or the plan has no single list
    of blocks."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
    base = getattr(model, "base_model", model)
    names = [n for n in plan if isinstance(getattr(base, n, None), nn.Module)]
    lists = [i for i, n in enumerate(names) if isinstance(getattr(base, n), nn.ModuleList)]
    if len(names) != len(plan) or len(lists) != 1:
        return None
    held = [n for n in names if next(getattr(base, n).parameters(), None) is not None]
    cut = lists[0]
    return PipelineSplit(blocks=names[cut], first=tuple(n for n in names[:cut] if n in held),
                         last=tuple(n for n in names[cut + 1:] if n in held))


@dataclass
class Stage:
    """This rank's part of a split model (kept on the model as ``_mp_stage``): one stage, or
    with virtual stages several.

    Attributes:
        index, count: this rank's place in the pipeline and the number of pipeline ranks.
        ranges: the blocks ``[start, stop)`` of every stage (``count x virtual`` of them; stage
            ``s`` runs on rank ``s % count``).
        blocks: the blocks of each of this rank's stages (``stages``), in order.
        owner: every key of the whole model's state dict -> the pipeline rank holding it (a
            tensor every rank holds, such as a rotary buffer: -1).
        ties: a key whose tensor is also held, under another key, by an earlier rank (GPT-2's
            ``lm_head.weight`` on the last rank) -> that key (``transformer.wte.weight``): the
            two are one weight, stored once, their gradients summed.
        shapes: every key -> (shape, dtype) in the whole model, before tensor parallelism.
        block_list: the model's ``ModuleList`` of blocks (this rank's blocks only, after the split).
    """

    index: int
    count: int
    ranges: tuple[tuple[int, int], ...]
    blocks: list[list[nn.Module]] = field(repr=False)
    owner: dict[str, int] = field(repr=False)
    ties: dict[str, str] = field(repr=False)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(repr=False)
    block_list: nn.ModuleList | None = field(default=None, repr=False)

    @property
    def virtual(self) -> int:
        """Stages per rank (1: no virtual stages)."""
        return len(self.ranges) // self.count

    @property
    def stages(self) -> tuple[int, ...]:
        """This rank's stages, in order: ``index``, ``index + count``, ..."""
        return tuple(range(self.index, len(self.ranges), self.count))

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def holds(self, key: str) -> bool:
        """Whether this rank holds ``key`` (its own, shared by every stage, or a tie's copy)."""
        return self.owner.get(key) in (self.index, -1) or key in self.ties


class Elsewhere(nn.Module):
    """Stands in for a module that lives on another pipeline stage; holds no parameters.

    ``kind`` "embedding": returns zeros of the replaced embedding's output shape (input shape +
    ``dim`` for an index tensor, the shape of a floating input), so the base model's code before
    the blocks runs unchanged; the first local block then gets the received activation.
    ``kind`` "final": must never run (the stage's forward ends after its last block); "pass"
    (a model called whole, ``whole.py``): returns its first tensor input, so the base model's
    forward runs to its end and returns this stage's last hidden states.
    """

    def __init__(self, path: str, stage: int, kind: str, dim: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.path, self.stage, self.kind, self.dim, self.dtype = path, stage, kind, dim, dtype

    def forward(self, *args, **kwargs):
        if self.kind == "pass":
            return next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        if self.kind != "embedding":
            raise RuntimeError(f"{self.path} lives on pipeline stage {self.stage}; it cannot run here")
        x = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if x is None:
            raise RuntimeError(f"{self.path} (on pipeline stage {self.stage}): no tensor input to size the stand-in")
        shape = tuple(x.shape) if x.is_floating_point() else (*x.shape, self.dim)
        return torch.zeros(shape, dtype=self.dtype, device=x.device)

    def extra_repr(self) -> str:
        return f"{self.path!r} on stage {self.stage}"


def blocks_of(model: nn.Module, split: PipelineSplit) -> tuple[str, nn.ModuleList]:
    """(path, ModuleList) of the model's blocks.

    Raises:
        ValueError: if the path does not name a ``ModuleList`` of the model.
    """
    path = join(base_prefix(model), split.blocks)
    try:
        blocks = model.get_submodule(path)
    except AttributeError:
        blocks = None
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: the pipeline split names blocks at {path!r}, which is not a "
                         "ModuleList of the model")
    return path, blocks


def present(model: nn.Module, path: str) -> bool:
    """Whether ``path`` names a module of ``model`` (optional parts, such as a BERT model's
    pooler, may be absent)."""
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def regions(model: nn.Module, split: PipelineSplit) -> tuple[list[str], list[str]]:
    """Module paths of the first stage's own modules and of the last stage's (those present)."""
    base = base_prefix(model)
    first = [join(base, p) for p in split.first if present(model, join(base, p))]
    last = [join(base, p) for p in split.last if present(model, join(base, p))]
    if base:  # the head model's own modules (LM head, classifier) come after the base model
        last += [name for name, _ in model.named_children() if name != base]
    return first, last


def _rank_of_key(key: str, block_path: str, block_rank: dict[int, int], first, last, count: int) -> int:
    if key.startswith(block_path + "."):
        return block_rank[int(key[len(block_path) + 1:].split(".")[0])]
    if any(key.startswith(p + ".") for p in first):
        return 0
    if any(key.startswith(p + ".") for p in last):
        return count - 1
    return -1


def describe(model: nn.Module, split: PipelineSplit, ranges: tuple[tuple[int, int], ...], index: int,
             count: int | None = None) -> Stage:
    """Rank ``index``'s record of the whole (not yet split) ``model``, with nothing changed:
    ``ranges`` are every stage's blocks, run by ``count`` pipeline ranks (default: one stage
    each; fewer: stage ``s`` on rank ``s % count``).

    Raises:
        ValueError: naming a parameter outside the blocks, the first and the last modules (it
            would have to live on every stage).
    """
    count = count or len(ranges)
    block_path, blocks = blocks_of(model, split)
    block_rank = {b: s % count for s, (lo, hi) in enumerate(ranges) for b in range(lo, hi)}
    first, last = regions(model, split)
    entries = model.state_dict(keep_vars=True)
    owner = {k: _rank_of_key(k, block_path, block_rank, first, last, count) for k in entries}
    params = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    stray = sorted(k for k, s in owner.items() if s == -1 and k in params)
    if stray:
        raise ValueError(f"{type(model).__name__}: parameters {stray} are neither in the blocks ({block_path}) nor "
                         "in the modules the pipeline split places on the first or last stage")
    ties = {}
    for keys in tie_groups(entries.items()):
        stages = [owner[k] for k in keys]
        keep = keys[stages.index(min(stages))]
        ties.update({k: keep for k, s in zip(keys, stages) if s != owner[keep]})
    shapes = {k: (tuple(t.shape), t.dtype) for k, t in entries.items()}
    local = [[blocks[i] for i in range(*ranges[s])] for s in range(index, len(ranges), count)]
    return Stage(index, count, ranges, local, owner, ties, shapes, blocks)


def _floating_dtype(module: nn.Module) -> torch.dtype:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())


def apply(model: nn.Module, split: PipelineSplit, stage: Stage, hidden_size: int) -> None:
    """Cut ``model`` down to ``stage`` in place: other ranks' blocks removed, their embeddings
    and final modules replaced by ``Elsewhere`` stubs; ``model._mp_stage`` records the stage."""
    _, blocks = blocks_of(model, split)
    mine = {i for s in stage.stages for i in range(*stage.ranges[s])}
    every = list(blocks)
    _set_aside(blocks, EVERY_BLOCK, every, every)
    for i in range(len(blocks)):
        if i not in mine:
            del blocks._modules[str(i)]
    first, last = regions(model, split)
    if not stage.is_first:
        for path in first:
            module = model.get_submodule(path)
            dim = module.embedding_dim if isinstance(module, nn.Embedding) else hidden_size
            stub = Elsewhere(path, 0, "embedding", dim, _floating_dtype(module))
            _set_aside(stub, ORIGINAL, module, [module])
            _replace(model, path, stub)
    if not stage.is_last:
        for path in last:
            stub = Elsewhere(path, len(stage.ranges) - 1, "final")
            original = model.get_submodule(path)
            _set_aside(stub, ORIGINAL, original, [original])
            _replace(model, path, stub)
    model._mp_stage = stage


EVERY_BLOCK, ORIGINAL = "_mp_every_block", "_mp_original"
"""Where ``apply`` keeps the modules it removed (``_set_aside``): on the blocks' ``ModuleList``,
every block in order; on an ``Elsewhere`` stub, the module it replaced."""


def eager_named_children(mod: nn.Module) -> list[tuple[str, nn.Module]]:
    """``mod``'s children as the whole model had them before the split: the set-aside blocks and
    replaced modules in their places (those on meta only; ``mod.named_children()`` otherwise)."""
    every = mod.__dict__.get(EVERY_BLOCK)
    if every is not None:
        return [(str(i), block) for i, block in enumerate(every)]
    return [(name, child.__dict__.get(ORIGINAL, child)) for name, child in mod.named_children()]


def _set_aside(holder: nn.Module, key: str, value, modules: list[nn.Module]) -> None:
    """Keep ``value`` (the ``modules`` the split removes) on ``holder``, outside the module tree (no
    registration: nothing iterates, moves or saves them), when they hold no memory (every tensor
    on meta): delayed initialization replays their random draws where the eager build made them,
    so each stage's modules get the values the whole model would (``materialize.init_engine``).
    Real modules are not kept: their memory is freed with them."""
    if all(t.is_meta for m in modules for t in (*m.parameters(), *m.buffers())):
        holder.__dict__[key] = value


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, new)


def stage_within(module: nn.Module) -> Stage | None:
    """The stage of the split model ``module`` is or wraps (an FSDP unit around it), or None."""
    return next((m._mp_stage for m in module.modules() if getattr(m, "_mp_stage", None) is not None), None)


def saved_names(module: nn.Module) -> dict[str, str]:
    """This rank's keys that a checkpoint stores under another key: a weight tied across ranks
    is stored once, under its first rank's key (GPT-2's ``lm_head.weight`` on the last stage
    -> ``transformer.wte.weight``). Empty for a model that is not split."""
    stage = getattr(module, "_mp_stage", None)
    return dict(stage.ties) if stage is not None else {}


def elsewhere(module: nn.Module) -> set[str]:
    """Keys of the whole model that other pipeline ranks hold: a checkpoint's entries for them
    are expected, not unexpected, and this rank does not read them."""
    stage = getattr(module, "_mp_stage", None)
    if stage is None:
        return set()
    return {k for k in stage.owner if not stage.holds(k)}
