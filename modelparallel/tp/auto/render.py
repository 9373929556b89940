"""An automatic plan written out: as text for a person, and as a model file for
``modelparallel/models/`` (the ``SPEC``, ``TABLE`` and ``ARCHITECTURE`` record an architecture file exports).

The key table is read off the model itself: its state-dict keys with the block index made the
``{}`` of a template, split into the base model's and the head's, the packed weights' keys from
the plan, and HF's own tie declaration (``_tied_weights_keys``).
"""

from __future__ import annotations

import re

from torch import nn

from ..layout import base_prefix
from ..plan import ArchSpec, ModulePlan, packed_keys
from .structure import find_blocks


def _template(key: str, lists: list[str]) -> str:
    """``key`` with the block index after a block list's path made ``{}`` (``layers.3.x`` -> ``layers.{}.x``)."""
    for path in lists:
        if key.startswith(path + "."):
            return path + "." + re.sub(r"^\d+", "{}", key[len(path) + 1:])
    return key


def key_table_fields(model: nn.Module, spec: ArchSpec) -> dict:
    """The ``KeyTable`` arguments of ``model`` (any device; meta is enough) under ``spec``."""
    prefix = base_prefix(model)
    lists = sorted({b.rsplit(".", 1)[0] for b in find_blocks(model)}, key=len, reverse=True)
    base, head = [], []
    for key in model.state_dict():
        key = _template(key, lists)
        inner = key[len(prefix) + 1:] if prefix and key.startswith(prefix + ".") else None
        target, entry = (base, inner) if inner is not None else (head, key)
        if entry not in target:
            target.append(entry)
    tied = getattr(model, "_tied_weights_keys", None)
    return {"arch": spec.model_type, "base_prefix": prefix, "base_keys": tuple(base), "head_keys": tuple(head),
            "packed": packed_keys(spec.base.packed), "tied": dict(tied) if isinstance(tied, dict) else {}}


def _plan_lines(name: str, plan: ModulePlan, indent: str) -> list[str]:
    out = [f"{indent}{name}=ModulePlan(", f"{indent}    rules={{"]
    out += [f"{indent}        {k!r}: {v!r}," for k, v in plan.rules.items()]
    out.append(f"{indent}    }},")
    for field in ("packed", "per_rank_attrs", "optional_rules", "tied_holders", "shared_inputs", "kv_heads"):
        value = getattr(plan, field)
        if value:
            out.append(f"{indent}    {field}={value!r},")
    out.append(f"{indent}),")
    return out


def model_file(model: nn.Module, spec: ArchSpec, tp: int) -> str:
    """Python source of a ``modelparallel/models/<arch>.py`` holding ``spec`` and ``model``'s key
    table (loading the file runs nothing but these definitions)."""
    table = key_table_fields(model, spec)
    lines = [
        f'"""{type(model).__name__} (model_type {spec.model_type!r}): the automatic tensor-parallel plan, written by',
        f"``modelparallel plan`` (each pair's split simulated at TP {tp}). Review it, then keep it as",
        'modelparallel/models/<arch>.py: the registry finds it there like any built-in architecture.',
        '"""',
        "",
        "from ._translate import KeyTable",
        "from ..tp.plan import ArchSpec, KVHeads, ModulePlan, Packed, SharedInput  # noqa: F401 - as the plan needs",
        "from ._architecture import Architecture",
        "",
        "SPEC = ArchSpec(",
        f"    model_type={spec.model_type!r},",
        *_plan_lines("base", spec.base, "    "),
        *_plan_lines("head", spec.head, "    "),
        f"    divisible_config={spec.divisible_config!r},",
        f"    loss={spec.loss!r},",
        f"    sequence_parallel={spec.sequence_parallel!r},",
        ")",
        "",
        "TABLE = KeyTable(",
        *(f"    {k}={v!r}," for k, v in table.items()),
        ")",
        "",
        "ARCHITECTURE = Architecture(SPEC, TABLE)",
        "",
    ]
    return "\n".join(lines)


def describe(spec: ArchSpec, tp: int) -> str:
    """The plan as a person reads it: each rule, then what else the plan sets."""
    base, head = spec.base, spec.head
    rows = [(glob, style) for glob, style in base.rules.items()] + [(g, s) for g, s in head.rules.items()]
    width = max((len(g) for g, _ in rows), default=0)
    lines = [f"tensor-parallel plan for model_type {spec.model_type!r} at TP {tp}:"]
    lines += [f"  {glob:<{width}}  {style}" + (f" ({base.packed[glob].chunks} chunks)" if glob in base.packed else "")
              for glob, style in rows]
    for glob, attrs in base.per_rank_attrs.items():
        lines.append(f"  per rank: {glob}.{{{', '.join(attrs)}}} / TP")
    for glob, shared in base.shared_inputs.items():
        what = f"argument {shared.arg!r}" if shared.arg else f"the output of {shared.output_of}"
        lines.append(f"  one input all-reduce (backward) for the column layers under {glob}: {what}")
    for glob, kv in base.kv_heads.items():
        lines.append(f"  KV heads of {glob} ({', '.join(kv.kv)}) replicated when TP does not divide "
                     f"{kv.kv_heads}" + (f"; {kv.groups} set per rank" if kv.groups else ""))
    lines.append(f"  the degree must divide: {', '.join(spec.divisible_config) or 'nothing'}; LM loss: {spec.loss}")
    return "\n".join(lines)
