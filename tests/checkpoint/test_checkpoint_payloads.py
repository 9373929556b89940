"""No code runs from a checkpoint: crafted files through every entry point, on every rank.

Each scenario plants a pickle whose loading would create a marker directory (``os.makedirs``)
in a place a loader reads, recomputes the manifest's checksums as a forger would, and calls an
entry point: ``resume_from_checkpoint`` (partial user content, DCP metadata, optimizer
hyperparameters; full checkpoint user content; SageMaker's single ``fullmodel.pt``), the legacy
``smp.load``, ``train --resume``'s resume step, and ``modelparallel inspect``. A failure means a
loader unpickled freely (modelparallel/checkpoint/safety/safe_load.py, fastread.SafeLoadPlanner,
parts.read_user_content, legacy.load): the marker exists, or the error does not name the file.
Paths that leave the checkpoint directory (manifest entries, ``newest``, tags, symlinks) are
refused too.
"""

import argparse
import json
import os
import pickle
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import harness
import modelparallel as smp
from modelparallel.checkpoint.safety import commit


class Payload:
    """Unpickling this creates ``marker`` (a directory): proof that a loader ran file content."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker, 0o777, True))


def build(seed: int = 0):
    smp.init({"tensor_parallel_degree": 2, "random_seed": seed})
    cfg = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=8, bos_token_id=0, eos_token_id=0)
    model = smp.DistributedModel(GPT2LMHeadModel(cfg))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.arange(8).reshape(1, 8) % 64
    model.backward(model(ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def refresh_checksums(directory: Path, **changes) -> None:
    """What a forger does: recompute every listed file's size and CRC32, apply ``changes``."""
    m = json.loads((directory / commit.MANIFEST).read_text())
    m["files"] = {f: commit.file_checksum(directory / f) for f in commit.data_files(directory)}
    if "user_content" in m:
        m["user_content"].update(commit.file_checksum(directory.parent / m["user_content"]["file"]))
    m.update(changes)
    (directory / commit.MANIFEST).write_text(json.dumps(m))


def error_of(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{getattr(fn, '__name__', fn)} loaded a crafted checkpoint without error")


def craft_partial(path: str, marker: str) -> dict:
    """On 2 ranks: three crafted partial checkpoints, each resumed; returns each error message."""
    root = Path(path)
    model, optimizer = build()
    # 1. user content: saved with the opt-in, then the manifest's flag cleared by the forger
    smp.save_checkpoint(root / "uc", "t", user_content={"x": Payload(marker)}, trust_user_content=True)
    # 2. a hyperparameter entry of the optimizer part (DCP stores non-tensors as pickles)
    optimizer.optimizer.param_groups[0]["evil"] = Payload(marker)
    smp.save_checkpoint(root / "opt", "t")
    del optimizer.optimizer.param_groups[0]["evil"]
    # 3. DCP's .metadata of the model part
    smp.save_checkpoint(root / "meta", "t")
    # 4. saved with the opt-in and left as is: refused without the opt-in at load
    smp.save_checkpoint(root / "trusted", "t", user_content={"x": Payload(marker)}, trust_user_content=True)
    if smp.rank() == 0:
        refresh_checksums(root / "uc" / "t_partial", user_content_trusted=False)
        meta = root / "meta" / "t_partial" / "model" / ".metadata"
        md = pickle.loads(meta.read_bytes())  # our own file, written just now
        md.storage_meta = Payload(marker)
        meta.write_bytes(pickle.dumps(md))
        refresh_checksums(root / "meta" / "t_partial")
    smp.barrier()
    msgs = {name: error_of(smp.resume_from_checkpoint, root / name) for name in ("uc", "opt", "meta", "trusted")}
    assert not os.path.exists(marker), "a payload ran"
    return msgs


def test_payloads_in_partial_checkpoints_never_run(tmp_path):
    marker = str(tmp_path / "PWNED")
    for msgs in harness.run(2, craft_partial, str(tmp_path), marker):
        assert "user_content.pt: refused to load" in msgs["uc"], msgs["uc"]
        assert "optimizer.param_groups.0.evil" in msgs["opt"] and "refused" in msgs["opt"], msgs["opt"]
        assert "model/.metadata" in msgs["meta"] and "refused to load os.makedirs" in msgs["meta"], msgs["meta"]
        assert "saved with trust_user_content=True" in msgs["trusted"], msgs["trusted"]
    assert not os.path.exists(marker)
    inspect_crafted(tmp_path, marker)


def craft_full_and_legacy(path: str, marker: str) -> dict:
    """Full checkpoint user content, single-file fullmodel.pt, legacy smp.load, train --resume."""
    from modelparallel.cli import train_job

    root = Path(path)
    model, optimizer = build()
    smp.save_checkpoint(root / "full", "t", partial=False, user_content=Payload(marker), trust_user_content=True)
    smp.save_checkpoint(root / "run" / "checkpoints", "step1", user_content={"step": 1})
    if smp.rank() == 0:
        refresh_checksums(root / "full" / "t", user_content_trusted=False)
        (root / "single").mkdir()
        torch.save({"transformer.wte.weight": Payload(marker)}, root / "single" / "fullmodel.pt")
        torch.save({"state": Payload(marker)}, root / "legacy.pt_0_0")
        torch.save({"state": Payload(marker)}, root / "legacy.pt_0_1")
        torch.save({"step": Payload(marker)}, root / "run" / "checkpoints" / "step1_partial" / "user_content.pt")
        refresh_checksums(root / "run" / "checkpoints" / "step1_partial")
    smp.barrier()
    msgs = {"full": error_of(smp.resume_from_checkpoint, root / "full", partial=False),
            "single": error_of(smp.resume_from_checkpoint, root / "single", tag="fullmodel.pt", partial=False),
            "legacy": error_of(smp.load, str(root / "legacy.pt")),
            "train --resume": error_of(train_job.resume_run,
                                       argparse.Namespace(out=root / "run", resume_tag="step1", steps=9), None)}
    assert not os.path.exists(marker), "a payload ran"
    return msgs


def test_payloads_in_full_single_file_legacy_and_train_resume_never_run(tmp_path):
    marker = str(tmp_path / "PWNED")
    for msgs in harness.run(2, craft_full_and_legacy, str(tmp_path), marker):
        assert "user_content_t: refused to load" in msgs["full"], msgs["full"]
        assert "fullmodel.pt: refused to load" in msgs["single"], msgs["single"]
        assert "legacy.pt_0_" in msgs["legacy"] and "refused to load" in msgs["legacy"], msgs["legacy"]
        assert "user_content.pt: refused to load" in msgs["train --resume"], msgs["train --resume"]
    assert not os.path.exists(marker)


def escape(path: str, outside: str) -> dict:
    """Manifest paths, ``newest``, tags and symlinks that leave the checkpoint directory."""
    root = Path(path)
    model, optimizer = build()
    smp.save_checkpoint(root / "full", "t", partial=False, user_content={"a": 1})
    smp.save_checkpoint(root / "p", "t")
    if smp.rank() == 0:
        torch.save({"secret": 1}, outside)
        m = json.loads((root / "full" / "t" / commit.MANIFEST).read_text())
        m["user_content"]["file"] = outside  # absolute path
        (root / "full" / "t" / commit.MANIFEST).write_text(json.dumps(m))
        (root / "p" / "newest").write_text("../p/t_partial\n")
        (root / "p" / "link_partial").symlink_to(Path(outside).parent)
    smp.barrier()
    msgs = {"manifest abs": error_of(smp.resume_from_checkpoint, root / "full", partial=False),
            "newest ..": error_of(smp.resume_from_checkpoint, root / "p"),
            "tag ..": error_of(smp.resume_from_checkpoint, root / "p", tag="../p/t"),
            "symlink": error_of(smp.resume_from_checkpoint, root / "p", tag="link")}
    return msgs


def test_paths_may_not_leave_the_checkpoint_directory(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    for msgs in harness.run(2, escape, str(tmp_path / "ck"), str(tmp_path / "elsewhere" / "x.pt")):
        assert "user_content" in msgs["manifest abs"] and "malformed manifest" in msgs["manifest abs"], msgs
        assert "newest names '../p/t_partial'" in msgs["newest .."], msgs["newest .."]
        assert "not a checkpoint name" in msgs["tag .."], msgs["tag .."]
        assert "'link_partial' is a symlink" in msgs["symlink"], msgs["symlink"]


def inspect_crafted(root: Path, marker: str) -> None:
    """``modelparallel inspect`` reads manifests (JSON) and checksums only: checkpoints with a
    payload in a pickled file are listed (checksums ok: the forger recomputed them), and the
    payload does not run."""
    from modelparallel.cli import main

    for name in ("uc", "opt", "meta"):
        assert main(["inspect", str(root / name)]) == 0
    assert not os.path.exists(marker)
