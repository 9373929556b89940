"""Forged or damaged checkpoint files found by review: each is refused before anything live
changes, on every rank alike, with a message naming the file (and the key) at fault.

A failure means a check runs too late (after the model or optimizer changed: see
modelparallel/checkpoint/load/optim_part.py ``plan_load``), or an error lost the file's name. 2 ranks,
TP=2 where collectives matter.
"""

import io
import os
import tempfile
from pathlib import Path

import torch

import harness
import modelparallel as smp
from ckpt_helpers import changed, error_of, on_rank0, refresh_manifest, rewrite_metadata, snapshot

MASTER = "fp16_states.transformer.h.0.mlp.c_fc.weight.master"


def _masters(optimizer) -> dict:
    return {f"master{i}": (m.to_local() if hasattr(m, "to_local") else m).detach().clone()
            for i, (p, m) in enumerate(optimizer.master_weights.params_and_masters()) if m is not p}


def forge_scalar(part: Path, key: str) -> None:
    """What a forger with write access does: store ``key`` as a consistent 0-dim tensor (its
    bytes appended to a data file, metadata and storage index pointing at them)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    data = io.BytesIO()
    torch.save(torch.tensor(1.0), data)
    target = part / "__0_0.distcp"
    offset = target.stat().st_size
    with open(target, "ab") as f:
        f.write(data.getvalue())

    def forge(md):
        entry = md.state_dict_metadata[key]
        entry.size = torch.Size([])
        entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]
        for index in [i for i in md.storage_data if i.fqn == key]:
            del md.storage_data[index]
        md.storage_data[MetadataIndex(key, torch.Size([]))] = _StorageInfo(target.name, offset, len(data.getvalue()))

    rewrite_metadata(part / ".metadata", forge)


def forged_master(path: str, journal_dir: str) -> dict:
    """An fp16 job's checkpoint whose fp32 master has shape () in the optimizer's metadata (the
    manifest recomputed, as a forger would): each staging mode refuses it, changing nothing."""
    from test_checkpoint_side_effects import build, step

    model, optimizer = build(0, True)
    step(model, optimizer, 0)
    smp.save_checkpoint(path, "a")
    directory = Path(path) / "a_partial"

    on_rank0(lambda: (forge_scalar(directory / "optimizer", MASTER), refresh_manifest(directory)))
    return resume_each_way(path, "a", journal_dir)


def resume_each_way(path: str, tag: str, journal_dir: str) -> dict:
    """A model that took another step resumes checkpoint ``tag`` staged in memory and through the
    journal (in ``journal_dir``, in buckets of 4 KiB): per mode its error, and (``"<mode> changed"``)
    what of its model, optimizer and fp32 masters changed."""
    from test_checkpoint_side_effects import build, step

    out = {}
    for mode in ("memory", "journal"):
        model, optimizer = build(1, True)
        step(model, optimizer, 1)
        before = {**snapshot(model, optimizer), **_masters(optimizer)}
        tempfile.tempdir = journal_dir
        try:
            out[mode] = error_of(smp.resume_from_checkpoint, path, tag, staging=mode, staging_bucket=1 << 12)
        finally:
            tempfile.tempdir = None
        out[f"{mode} changed"] = changed(before, {**snapshot(model, optimizer), **_masters(optimizer)})
    return out


def test_a_forged_master_shape_is_refused_before_anything_changes(tmp_path):
    results = harness.run(2, forged_master, str(tmp_path / "ck"), str(tmp_path))
    for mode in ("memory", "journal"):
        assert results[0][mode] == results[1][mode], results
        msg = results[0][mode]
        assert MASTER in msg and "a_partial/optimizer/.metadata" in msg and "()" in msg, msg
        for r in results:
            assert r[f"{mode} changed"] == [], (mode, r[f"{mode} changed"][:5])


def _drop_entries(part: Path, prefixes: tuple[str, ...]) -> None:
    """Remove every entry whose key starts with one of ``prefixes`` from a part's metadata (what
    a checkpoint missing a pipeline stage's share looks like)."""
    def drop(md):
        for key in [k for k in md.state_dict_metadata if k.startswith(prefixes)]:
            del md.state_dict_metadata[key]
        for index in [i for i in md.storage_data if i.fqn.startswith(prefixes)]:
            del md.storage_data[index]

    rewrite_metadata(part / ".metadata", drop)


DROPPED = "transformer.h.0.mlp.c_fc.weight"


def missing_entries(path: str) -> dict:
    """Without the loss scaler's state and one parameter's slots (a parameter may have none):
    ``strict=True`` names the scaler's, ``strict=False`` loads the rest, keeps the live scaler
    and reports it missing."""
    from ckpt_helpers import build

    model, optimizer = build()
    smp.save_checkpoint(path, "a")
    want = snapshot(model, optimizer)
    directory = Path(path) / "a_partial"
    on_rank0(lambda: (_drop_entries(directory / "optimizer", ("loss_scaler.", f"optimizer.state.{DROPPED}.")),
                      refresh_manifest(directory)))
    model, optimizer = build(seed=3)
    scale = optimizer.loss_scaler.state_dict()
    strict = error_of(smp.resume_from_checkpoint, path, "a")
    smp.resume_from_checkpoint(path, "a", strict=False)
    got = snapshot(model, optimizer)
    return {"strict": strict, "report": smp.last_load_report()["optimizer"].missing_keys,
            "scale kept": optimizer.loss_scaler.state_dict() == scale,
            "differ": [k for k in changed(want, got) if DROPPED not in k and not k.startswith("scaler/")]}


def test_strict_false_tolerates_a_missing_loss_scaler_and_slots(tmp_path):
    for r in harness.run(2, missing_entries, str(tmp_path)):
        assert "loss_scaler.loss_scale" in r["strict"] and "missing" in r["strict"], r["strict"]
        assert r["report"] == ["loss_scaler.loss_scale"], r["report"]
        assert r["scale kept"] and r["differ"] == [], r


def interrupted_journal_resume(path: str, journal_dir: str) -> dict:
    """Ctrl-C on rank 0 while the optimizer part is read through the undo journal (the model
    already overwritten in place): rank 0 gets ``KeyboardInterrupt`` itself, rank 1 an error
    naming it, and both get back the state they had before the resume."""
    from ckpt_helpers import build
    from modelparallel.checkpoint.load import fastread

    model, optimizer = build()
    smp.save_checkpoint(path, "a")
    model, optimizer = build(seed=3)
    before = snapshot(model, optimizer)
    read_chunk, seen = fastread.FastReader._read_chunk, []

    def interrupted(self, reader, *args):
        if "/optimizer/" in str(reader.path) and smp.rank() == 0:
            seen.append(reader.path)
            if len(seen) == 3:
                raise KeyboardInterrupt
        return read_chunk(self, reader, *args)

    fastread.FastReader._read_chunk = interrupted
    tempfile.tempdir = journal_dir
    try:
        smp.resume_from_checkpoint(path, "a", staging="journal", staging_bucket=1 << 10)
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    except Exception as e:  # noqa: BLE001 - the test reads it
        outcome = f"{type(e).__name__}: {e}"
    finally:
        fastread.FastReader._read_chunk = read_chunk
        tempfile.tempdir = None
    smp.barrier()  # both ranks are done with their journals (they share journal_dir)
    return {"outcome": outcome, "changed": changed(before, snapshot(model, optimizer)),
            "journals": sorted(os.listdir(journal_dir))}


def test_ctrl_c_during_a_journal_resume_stays_a_keyboard_interrupt(tmp_path):
    (tmp_path / "j").mkdir()
    results = harness.run(2, interrupted_journal_resume, str(tmp_path / "ck"), str(tmp_path / "j"))
    assert results[0]["outcome"] == "KeyboardInterrupt", results[0]["outcome"]
    assert "KeyboardInterrupt" in results[1]["outcome"] and "rank 0" in results[1]["outcome"], results[1]
    for r in results:
        assert r["changed"] == [], r["changed"][:5]
    assert all(r["journals"] == [] for r in results), "the undo journals are deleted"


def truncated_single_file(path: str) -> dict:
    """A single-file full checkpoint cut short: the resume fails on every rank alike, naming
    the file, and the model is unchanged."""
    from ckpt_helpers import build

    model, optimizer = build()
    smp.save_checkpoint(path, "fullmodel.pt", partial=False)
    f = Path(path) / "fullmodel.pt"
    on_rank0(lambda: os.truncate(f, f.stat().st_size // 2))
    model, optimizer = build(seed=3)
    before = snapshot(model)
    msg = error_of(smp.resume_from_checkpoint, path, "fullmodel.pt", partial=False, load_optimizer=False)
    return {"msg": msg, "changed": changed(before, snapshot(model))}


def test_a_truncated_single_file_names_it(tmp_path):
    results = harness.run(2, truncated_single_file, str(tmp_path))
    assert results[0]["msg"] == results[1]["msg"], results
    assert f"{tmp_path / 'fullmodel.pt'}: not a readable torch.save file" in results[0]["msg"], results[0]["msg"]
    assert all(r["changed"] == [] for r in results), results
