"""Which key/value projections the walker replicates: the degree does not divide the KV heads.

The plan's ``KVHeads`` rules name the attention modules and their k/v projections; here the
walker's checked work is amended for this model and degree: those projections' column-parallel
assignments become ``kv_replicated`` (with the head counts their style needs) and the module's
repeat count becomes the rank's. Everything is decided from the config, before any tensor moves.
"""

from __future__ import annotations

from .plan import ModulePlan, glob_match, join
from .replicated import KVReplicated, heads_for_rank


def collect_kv(plan: ModulePlan, prefix: str, rel_modules: dict, config, tp: int, live, work) -> None:
    """Amend ``work`` (the walker's) for every attention module of ``plan``: the KV head counts it
    holds become the rank's, and when the degree ``tp`` does not divide the KV heads its k/v
    layers are replicated; problems are appended to ``work.problems``."""
    for glob, kv in plan.kv_heads.items():
        heads, kv_heads = getattr(config, kv.heads, None), getattr(config, kv.kv_heads, None)
        if not heads or not kv_heads or heads % tp or heads % kv_heads:
            continue  # a head count the config check refuses
        replicate = kv_heads % tp != 0
        mine, groups = heads_for_rank(heads, kv_heads, tp, 0)  # the same count and repeat on every rank
        for rel in filter(live, [r for r in rel_modules if glob_match(glob, r)]):
            path = join(prefix, rel)
            work.rewrites.extend((path, rel_modules[rel], attr, len(mine)) for attr in kv.counts)
            if not replicate:
                continue
            if kv.groups:
                work.rewrites.append((path, rel_modules[rel], kv.groups, groups))
            for name in kv.kv:
                target = join(path, name)
                found = [a for a in work.assignments if a.path == target]
                if not found or found[0].style != "colwise":
                    work.problems.append(f"{target}: KV heads ({type(config).__name__}.{kv.kv_heads} = {kv_heads}) "
                                         f"not divisible by tensor_parallel_degree {tp} are replicated only for "
                                         "a column-parallel nn.Linear")
                    continue
                found[0].style, found[0].prebuilt = "kv_replicated", KVReplicated(heads, kv_heads)
