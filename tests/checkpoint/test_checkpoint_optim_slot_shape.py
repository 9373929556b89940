"""An optimizer slot saved at a shape other than its parameter's, while the model part matches:
refused before anything live changes, naming the slot's key
(modelparallel/checkpoint/load/optim_plan.py ``plan_load``).

When the model exists before the optimizer, ``check_optimizer_names`` compares the optimizer
part with the model first; when both exist as the resume is called, that comparison is skipped
and ``plan_load`` is the only check. A failure means such a slot is read into a tensor of the
saved shape and installed (the next step fails or, worse, broadcasts), or the refusal came after
the model or optimizer changed. 2 ranks, TP=2, staged in memory and through the undo journal.
With ``strict=False`` the parameter gets none of its saved state (a step finding ``exp_avg_sq``
without ``exp_avg`` raises KeyError): it starts afresh, as a parameter without saved state does.
"""

from pathlib import Path

import torch

import harness
import modelparallel as smp
from modelparallel import runtime
from ckpt_helpers import changed, on_rank0, refresh_manifest, rewrite_metadata, snapshot

PARAM = "transformer.h.0.mlp.c_fc.weight"
SLOT = f"optimizer.state.{PARAM}.exp_avg"


def transpose_entry(part: Path, key: str) -> None:
    """What a forger with write access does: record ``key`` at its transposed shape (its chunks'
    offsets and sizes too); the data bytes stay where they are."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    def flip(s):
        return None if s is None else torch.Size(reversed(s))

    def forge(md):
        entry = md.state_dict_metadata[key]
        entry.size = flip(entry.size)
        entry.chunks = [ChunkStorageMetadata(offsets=flip(c.offsets), sizes=flip(c.sizes)) for c in entry.chunks]
        for index in [i for i in md.storage_data if i.fqn == key]:
            md.storage_data[MetadataIndex(key, flip(index.offset), index.index)] = md.storage_data.pop(index)

    rewrite_metadata(part / ".metadata", forge)


def forged_slot(path: str, journal_dir: str) -> dict:
    """An fp16 job's checkpoint whose ``SLOT`` is recorded transposed (manifest recomputed):
    resumed by a job whose model and optimizer already exist, in each staging mode."""
    from test_checkpoint_forged import resume_each_way
    from test_checkpoint_side_effects import build, step

    model, optimizer = build(0, True)
    step(model, optimizer, 0)
    shape = tuple(dict(model.module.named_parameters())[PARAM].shape)
    smp.save_checkpoint(path, "a")
    directory = Path(path) / "a_partial"
    on_rank0(lambda: (transpose_entry(directory / "optimizer", SLOT), refresh_manifest(directory)))
    return {"shape": shape, **resume_each_way(path, "a", journal_dir)}


def test_a_slot_at_another_shape_than_its_parameter_is_refused_before_anything_changes(tmp_path):
    results = harness.run(2, forged_slot, str(tmp_path / "ck"), str(tmp_path))
    shape = results[0]["shape"]
    assert len(shape) == 2 and shape[0] != shape[1], shape  # transposing changes it
    expected = f"{SLOT}: checkpoint {tuple(reversed(shape))}, model {shape}"
    for mode in ("memory", "journal"):
        assert results[0][mode] == results[1][mode], results
        assert expected in results[0][mode], (expected, results[0][mode])
        for r in results:
            assert r[f"{mode} changed"] == [], (mode, r[f"{mode} changed"][:5])


def forged_slot_not_strict(path: str) -> dict:
    """The same forged checkpoint of an fp32 job, resumed with ``strict=False``: what changed
    against the saved state, the report, and the step counts after one more step."""
    from test_checkpoint_side_effects import build, step

    model, optimizer = build(0, False)
    step(model, optimizer, 0)
    smp.save_checkpoint(path, "a")
    want = snapshot(model, optimizer)
    directory = Path(path) / "a_partial"
    on_rank0(lambda: (transpose_entry(directory / "optimizer", SLOT), refresh_manifest(directory)))
    model, optimizer = build(1, False)
    step(model, optimizer, 1)
    live = snapshot(model, optimizer)
    smp.resume_from_checkpoint(path, "a", strict=False, staging="memory")
    got = snapshot(model, optimizer)
    step(model, optimizer, 2)  # raised KeyError('exp_avg') when the parameter kept its other slots
    steps = {n: float(optimizer.optimizer.state[p]["step"]) for n, p in model.module.named_parameters()}
    # staged: a copy of each live slot the load replaces, none of the parameter starting afresh
    others = sum(v.nbytes for k, v in live.items() if k.startswith("optim/") and not k.startswith(f"optim/{PARAM}/"))
    return {"changed": changed(want, got), "saved": want, "report": smp.last_load_report()["optimizer"],
            "steps": steps, "staged": runtime.current().resume.costs["optimizer"].in_memory, "others": others}


def test_strict_false_starts_that_parameters_state_afresh_and_loads_the_rest(tmp_path):
    for r in harness.run(2, forged_slot_not_strict, str(tmp_path / "ck")):
        ours = sorted(k for k in r["saved"] if k.startswith(f"optim/{PARAM}/"))
        assert f"optim/{PARAM}/exp_avg" in ours and r["changed"] == ours, r["changed"]
        assert [m.partition(":")[0] for m in r["report"].mismatched_shapes] == [SLOT], r["report"]
        saved_step = {k.split("/")[1]: float(v) for k, v in r["saved"].items() if k.endswith("/step")}
        for name, count in r["steps"].items():
            assert count == (1 if name == PARAM else saved_step[name] + 1), (name, count)
        assert r["staged"] == r["others"], (r["staged"], r["others"])
