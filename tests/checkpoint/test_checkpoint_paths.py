"""Paths an attacker with write access to a checkpoint directory controls: every file a load
opens is a regular file the manifest lists, reached inside the checkpoint without a symlink.

Each scenario saves a checkpoint on 2 ranks (TP=2), tampers with it as a forger would (the
manifest's checksums recomputed) and resumes. A failure means a loader opened something it must
not: a FIFO (the load would hang), a file outside the checkpoint (loaded unverified), a symlink;
or a save followed the writer lock's symlink and truncated another file. Look first at
modelparallel/checkpoint/safety/files.py (how a load opens files), manifest.py, lock.py.
"""

import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import harness
import modelparallel as smp
from ckpt_helpers import build, changed, error_of, on_rank0, refresh_manifest, rewrite_metadata, snapshot
from modelparallel.checkpoint.safety import commit


def _point_first_chunk_at(metadata: Path, where: str) -> None:
    def change(md):
        key = next(iter(md.storage_data))
        md.storage_data[key].relative_path = where
    rewrite_metadata(metadata, change)


def dcp_relative_paths(path: str, outside: str) -> dict:
    """A DCP storage entry naming a FIFO inside the checkpoint, ``../x`` and an absolute path."""
    root = Path(path)
    msgs, took = {}, {}
    for case in ("dotdot", "absolute", "fifo"):
        build()
        smp.save_checkpoint(root / case, "t")
        ck = root / case / "t_partial"

        def tamper():
            meta = ck / "model" / ".metadata"
            if case == "fifo":
                os.mkfifo(ck / "model" / "pipe")
                _point_first_chunk_at(meta, "pipe")
            else:
                target = Path(outside) / case
                target.mkdir()
                (target / "__0_0.distcp").write_bytes((ck / "model" / "__0_0.distcp").read_bytes())
                _point_first_chunk_at(meta, f"../../../{Path(outside).name}/{case}/__0_0.distcp" if case == "dotdot"
                                      else str(target / "__0_0.distcp"))
            refresh_manifest(ck)
            if case == "fifo":  # the forger lists it too: the loader must still see it is no file
                m = json.loads((ck / commit.MANIFEST).read_text())
                m["files"]["model/pipe"] = {"size": 0, "crc32": "00000000"}
                (ck / commit.MANIFEST).write_text(json.dumps(m))

        on_rank0(tamper)
        model, optimizer = build(seed=1)
        before = snapshot(model, optimizer)
        start = time.monotonic()
        msgs[case] = error_of(smp.resume_from_checkpoint, root / case)
        took[case] = time.monotonic() - start
        assert changed(before, snapshot(model, optimizer)) == [], f"{case}: a refused load changed the model"
    return {"msgs": msgs, "took": took}


def test_dcp_storage_paths_are_listed_regular_files_inside(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    results = harness.run(2, dcp_relative_paths, str(tmp_path / "ck"), str(tmp_path / "elsewhere"))
    assert results[0]["msgs"] == results[1]["msgs"], "every rank raises the same error"
    msgs = results[0]["msgs"]
    assert "model/pipe" in msgs["fifo"] and "not a regular file" in msgs["fifo"], msgs["fifo"]
    assert "not listed in the manifest" in msgs["dotdot"] and "elsewhere" in msgs["dotdot"], msgs["dotdot"]
    assert "not listed in the manifest" in msgs["absolute"] and "elsewhere" in msgs["absolute"], msgs["absolute"]
    assert max(results[0]["took"].values()) < 30, results[0]["took"]


def symlinked_files(path: str, outside: str) -> dict:
    """A manifest that is a symlink, and a full checkpoint's user content symlinked outside."""
    root = Path(path)
    build()
    smp.save_checkpoint(root, "p")
    smp.save_checkpoint(root, "fullmodel.pt", partial=False, user_content={"a": 1})

    def tamper():
        manifest = root / "p_partial" / commit.MANIFEST
        moved = Path(outside) / "manifest.json"
        moved.write_bytes(manifest.read_bytes())
        manifest.unlink()
        manifest.symlink_to(moved)
        torch.save({"secret": 2}, Path(outside) / "secret.pt")
        torch.save({"transformer.wte.weight": torch.zeros(64, 16)}, root / "single.pt")
        (root / "user_content_single.pt").symlink_to(Path(outside) / "secret.pt")

    on_rank0(tamper)
    return {"manifest": error_of(smp.resume_from_checkpoint, root, "p"),
            "user content": error_of(smp.resume_from_checkpoint, root, "single.pt", partial=False)}


def test_manifest_and_user_content_symlinks_are_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    for msgs in harness.run(2, symlinked_files, str(tmp_path / "ck"), str(tmp_path / "elsewhere")):
        assert f"p_partial/{commit.MANIFEST}" in msgs["manifest"] and "symlink" in msgs["manifest"], msgs
        assert "user_content_single.pt" in msgs["user content"] and "symlink" in msgs["user content"], msgs


def lock_symlink(path: str, victim: str) -> dict:
    root = Path(path)
    build()
    on_rank0(lambda: (root.mkdir(), (root / commit.LOCK).symlink_to(victim)))
    msg = error_of(smp.save_checkpoint, root, "a")
    return {"msg": msg, "listing": sorted(os.listdir(root))}


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for r in harness.run(2, lock_symlink, str(tmp_path / "ck"), str(victim)):
        assert commit.LOCK in r["msg"] and "symlink" in r["msg"], r["msg"]
    assert victim.read_text() == "precious\n", "the save wrote through the lock's symlink"
    assert r["listing"] == [commit.LOCK], "nothing else was written"


def symlinked_tags(path: str) -> dict:
    """A tag directory that is a symlink (even to a checkpoint inside) is refused for loading,
    never replaced by a save, and never deleted or counted by retention."""
    root = Path(path)
    build()
    smp.save_checkpoint(root, "real")
    on_rank0(lambda: (root / "alias_partial").symlink_to(root / "real_partial"))
    msgs = {"resume": error_of(smp.resume_from_checkpoint, root, "alias"),
            "save over": error_of(smp.save_checkpoint, root, "alias")}
    listing = sorted(os.listdir(root))
    smp.barrier()  # every rank has listed before rank 0 starts the next save's staging directory
    smp.save_checkpoint(root, "b", num_kept_partial_checkpoints=1)
    return {"msgs": msgs, "listing": listing, "after": sorted(os.listdir(root)),
            "link": os.path.islink(root / "alias_partial")}


def test_symlinked_tag_directories_are_refused_and_never_followed(tmp_path):
    for r in harness.run(2, symlinked_tags, str(tmp_path)):
        assert "'alias_partial' is a symlink" in r["msgs"]["resume"], r["msgs"]
        assert "'alias_partial' is a symlink" in r["msgs"]["save over"], r["msgs"]
        assert r["msgs"]["save over"].splitlines()[0].count("rank") == 1
        assert r["listing"] == [commit.LOCK, "alias_partial", "newest", "real_partial"], r["listing"]
        assert r["link"] and r["after"] == [commit.LOCK, "alias_partial", "b_partial", "newest"], r["after"]


def test_hf_index_naming_a_shard_outside_the_directory_is_refused(tmp_path):
    """``weight_map`` entries are file names inside the model directory (materialize/loading.py);
    symlinked files stay allowed (the Hugging Face cache links snapshots to its blobs)."""
    from modelparallel.materialize import loading

    model_dir, outside = tmp_path / "model", tmp_path / "elsewhere"
    model_dir.mkdir()
    outside.mkdir()
    save_file({"w": torch.ones(2)}, str(outside / "x.safetensors"))
    save_file({"v": torch.ones(2)}, str(model_dir / "model-1.safetensors"))
    for bad in ("../elsewhere/x.safetensors", str(outside / "x.safetensors"), "sub/../../elsewhere/x.safetensors"):
        index = {"weight_map": {"v": "model-1.safetensors", "w": bad}}
        (model_dir / loading.INDEX).write_text(json.dumps(index))
        try:
            loading.checkpoint_files(model_dir)
        except ValueError as e:
            assert "model.safetensors.index.json" in str(e) and repr(bad) in str(e), str(e)
        else:
            raise AssertionError(f"weight_map entry {bad!r} was followed")
    (model_dir / loading.INDEX).write_text(json.dumps({"weight_map": {"v": "model-1.safetensors"}}))
    (model_dir / "model-1.safetensors").rename(outside / "blob")
    (model_dir / "model-1.safetensors").symlink_to(outside / "blob")
    assert loading.checkpoint_files(model_dir) == {"v": str(model_dir / "model-1.safetensors")}
