"""Exactly what was committed is what loads, by one writer, all or nothing.

A failure means one of these broke (file to read first in parentheses): a file the manifest
does not list loaded unverified, or a malformed manifest gave a raw KeyError naming no file
(commit.read_manifest / verify); a second job could save into a directory another job is
writing (commit.DirectoryLock); a resume that fails part-way changed weights or left a load
pending for the next model (pending.PendingResume); a safetensors file rewritten in place was
read with its old header (safetensors_io.header); ``smp.save`` / ``smp.load`` lost a container
type (legacy, plain.to_plain); SageMaker's single-file ``fullmodel.pt`` resume did not load
the pretrained weights bit for bit (single_file). Multi-rank scenarios run on 2 ranks at TP=2.
"""

import collections
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GPT2LMHeadModel

import harness
from ckpt_helpers import build, cfg, changed, error_of, on_rank0, snapshot
import modelparallel as smp
from modelparallel import runtime
from modelparallel.materialize import safetensors_io
from modelparallel.checkpoint.safety import commit
from reference import as_hf


def manifests_and_unlisted(path: str) -> dict:
    root = Path(path)
    build()
    smp.save_checkpoint(root, "a")
    ck = root / "a_partial"
    good = (ck / commit.MANIFEST).read_text()
    msgs = {}
    on_rank0(lambda: (ck / "model" / "extra.bin").write_bytes(b"x"))
    msgs["unlisted"] = error_of(smp.resume_from_checkpoint, root)
    on_rank0(lambda: (ck / "model" / "extra.bin").unlink())
    for name, text in (("truncated", good[:40]), ("no files", json.dumps({**json.loads(good), "files": None})),
                       ("bad entry", json.dumps({**json.loads(good), "files": {"model/.metadata": {"size": "1"}}}))):
        on_rank0(lambda: (ck / commit.MANIFEST).write_text(text))
        msgs[name] = error_of(smp.resume_from_checkpoint, root)
    on_rank0(lambda: (ck / commit.MANIFEST).write_text(good))
    smp.resume_from_checkpoint(root)  # intact again: loads
    return msgs


def test_unlisted_files_and_malformed_manifests_are_named_errors(tmp_path):
    for msgs in harness.run(2, manifests_and_unlisted, str(tmp_path)):
        assert "model/extra.bin: not listed in the manifest" in msgs["unlisted"], msgs["unlisted"]
        for name in ("truncated", "no files", "bad entry"):
            assert msgs[name].startswith("Checkpoint") and f"a_partial/{commit.MANIFEST}" in msgs[name], msgs[name]
        assert "unreadable manifest" in msgs["truncated"] and "'files'" in msgs["no files"], msgs
        assert "needs an integer 'size'" in msgs["bad entry"], msgs["bad entry"]
    from modelparallel.cli import main

    (tmp_path / "b_partial").mkdir()
    (tmp_path / "b_partial" / commit.MANIFEST).write_text("{")
    assert main(["inspect", str(tmp_path)]) == 1  # b is broken; a is still listed and verified


def one_writer(path: str) -> dict:
    """A save into a directory whose lock another writer holds fails on every rank, naming the
    owner, and touches nothing there; the lock is free again once the holder releases it."""
    root = Path(path)
    build()
    smp.save_checkpoint(root, "a")
    build()  # a new job (smp.init): the first one's lock is released
    other = commit.DirectoryLock(root)
    foreign = root / commit.hidden_name("staging", "0123456789ab", "x_partial")  # the other job's

    def hold():
        other.acquire()
        foreign.mkdir()

    on_rank0(hold)
    msg = error_of(smp.save_checkpoint, root, "b")
    kept = foreign.is_dir()
    on_rank0(other.release)
    smp.save_checkpoint(root, "b")  # the lock is free: saves, and cleans the (now dead) leftovers
    return {"msg": msg, "kept": kept, "after": sorted(os.listdir(root))}


def test_one_writer_per_directory(tmp_path):
    for r in harness.run(2, one_writer, str(tmp_path)):
        assert "being saved into by another job (host=" in r["msg"] and " pid=" in r["msg"], r["msg"]
        assert r["kept"], "a failed save deleted the lock holder's staging directory"
        assert r["after"] == [commit.LOCK, "a_partial", "b_partial", "newest"], r["after"]


def all_or_nothing(path: str) -> dict:
    """Resumes that fail in the optimizer part (immediate) or the model part (deferred) change
    nothing and leave nothing pending."""
    root = Path(path)
    build(groups=2)
    smp.save_checkpoint(root, "two_groups")
    model, optimizer = build(seed=3)
    before = snapshot(model, optimizer)
    msg = error_of(smp.resume_from_checkpoint, root, "two_groups")
    after = snapshot(model, optimizer)
    unchanged = changed(before, after)
    pending = runtime.current().pending_resume
    smp.init({"tensor_parallel_degree": 2, "random_seed": 4})
    smp.resume_from_checkpoint(root, "two_groups")  # deferred: applied when the model exists
    deferred = error_of(smp.DistributedModel, GPT2LMHeadModel(cfg(vocab=66)))  # another vocabulary
    disarmed = runtime.current().pending_resume is None
    return {"msg": msg, "changed": unchanged, "pending": pending, "deferred": deferred, "disarmed": disarmed}


def test_failed_resume_changes_nothing_and_leaves_nothing_pending(tmp_path):
    for r in harness.run(2, all_or_nothing, str(tmp_path)):
        assert "param_groups: checkpoint has 2, this optimizer 1" in r["msg"], r["msg"]
        assert r["changed"] == [] and r["pending"] is None, r
        assert "shape mismatch" in r["deferred"] and r["disarmed"], r


def legacy_containers(path: str):
    smp.init({"tensor_parallel_degree": 2})
    obj = {"d": collections.defaultdict(list, {"a": [1, 2]}), "o": collections.OrderedDict(b=torch.ones(2)),
           "nested": [(1, {"x": collections.defaultdict(int)})]}
    f = os.path.join(path, "new", "dir", "ck.pt")  # the parent does not exist yet
    smp.save(obj, f, partial=False, v3=True)
    smp.save(obj, f, partial=True)
    smp.barrier()
    return smp.load(f, partial=False), smp.load(f)


def test_smp_save_load_containers_and_parent_directory(tmp_path):
    for whole, mine in harness.run(2, legacy_containers, str(tmp_path)):
        for got in (whole, mine):
            assert type(got["d"]) is collections.defaultdict and got["d"].default_factory is list
            assert got["d"]["a"] == [1, 2] and got["d"]["new"] == []
            assert type(got["o"]) is collections.OrderedDict and torch.equal(got["o"]["b"], torch.ones(2))
            assert got["nested"][0][1]["x"].default_factory is int


def fine_tune_recipe(model_dir: str):
    """SageMaker's v1 fine-tuning recipe: rank 0 saves a pretrained model's state_dict() as
    fullmodel.pt; every rank builds the model, then resumes from it (HF keys, translated)."""
    torch.manual_seed(11)
    pretrained = GPT2LMHeadModel(cfg())
    if smp.rank() == 0:
        torch.save(pretrained.state_dict(), os.path.join(model_dir, "fullmodel.pt"))
    smp.init({"tensor_parallel_degree": 2, "random_seed": 0})
    model = smp.DistributedModel(GPT2LMHeadModel(cfg()))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert smp.resume_from_checkpoint(model_dir, tag="fullmodel.pt", partial=False) is None
    ours = dict(model.module.named_parameters())
    differ = [n for n, p in pretrained.named_parameters() if not torch.equal(as_hf(ours[n], p), p)]
    assert not optimizer.optimizer.state
    return differ


def test_v1_single_file_full_checkpoint_loads_bit_exactly(tmp_path):
    for differ in harness.run(2, fine_tune_recipe, str(tmp_path)):
        assert differ == [], f"not loaded from fullmodel.pt: {differ}"


def test_safetensors_header_cache_sees_a_file_rewritten_in_place(tmp_path):
    """The same path rewritten with other tensors at other offsets (same inode: written in
    place): the second read must use the new header."""
    f = tmp_path / "model.safetensors"
    first = {"a": torch.arange(6, dtype=torch.float32), "b": torch.full((4,), 7.0)}
    save_file(first, str(f))
    dst = torch.empty(4)
    assert safetensors_io.read_into(str(f), "b", dst, (4,), (0,)) and torch.equal(dst, first["b"])
    inode = f.stat().st_ino
    with open(f, "r+b") as out:  # rewrite in place
        out.truncate(0)
    second = {"b": torch.full((4,), 3.0), "a": torch.arange(10, dtype=torch.float32)}
    from safetensors.torch import save as save_bytes

    with open(f, "r+b") as out:
        out.write(save_bytes(second))
    assert f.stat().st_ino == inode
    assert safetensors_io.read_into(str(f), "b", dst, (4,), (0,)) and torch.equal(dst, second["b"])
