"""Which rank writes an entry several ranks hold (modelparallel/checkpoint/save/planner.py).

A failure means a replicated entry is written twice or not at all (the checkpoint would not
validate or would lose it), or that the shared entries pile up on one rank again (every save
then waits for that rank: DCP's own dedup puts all of them on the last rank).
"""

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from modelparallel.checkpoint.save.planner import ITEM_COST, balanced


def item(name: str, numel: int) -> WriteItem:
    size = torch.Size([numel])
    return WriteItem(index=MetadataIndex(name, torch.Size([0])), type=WriteItemType.TENSOR,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([0]), size),
                                                 properties=TensorProperties(dtype=torch.float32), size=size))


def test_shared_entries_are_written_once_and_spread():
    own = [[item(f"shard.{r}.{i}", 1 << 20) for i in range(4)] for r in range(2)]  # 4 MiB each, equal
    shared = [item(f"ln.{i}", 1024) for i in range(40)]
    plans = [SavePlan(own[r] + shared) for r in range(2)]
    out = balanced(plans)
    written = [it.index.fqn for plan in out for it in plan.items]
    assert sorted(written) == sorted({it.index.fqn for plan in plans for it in plan.items}), "each entry once"
    counts = [sum(it.index.fqn.startswith("ln.") for it in plan.items) for plan in out]
    assert counts == [20, 20], counts
    assert [len([i for i in p.items if i.index.fqn.startswith("shard.")]) for p in out] == [4, 4]


def test_a_shared_entry_goes_to_the_rank_with_less_own_work():
    plans = [SavePlan([item("big.0", 8 << 20), item("w", 1 << 20)]), SavePlan([item("w", 1 << 20)])]
    out = balanced(plans)
    assert [[i.index.fqn for i in p.items] for p in out] == [["big.0"], ["w"]]


def test_entries_held_by_some_ranks_only_stay_with_them():
    plans = [SavePlan([item("a", 10), item("b", 10)]), SavePlan([item("b", 10), item("c", 10)]),
             SavePlan([item("a", 10), item("c", 10)])]
    out = balanced(plans)
    owner = {i.index.fqn: r for r, p in enumerate(out) for i in p.items}
    holders = {"a": {0, 2}, "b": {0, 1}, "c": {1, 2}}
    assert sorted(owner) == ["a", "b", "c"] and all(owner[k] in holders[k] for k in owner), owner
    assert len(set(owner.values())) == 3, f"three shared entries, three ranks, one each: {owner}"
    assert ITEM_COST > 0
