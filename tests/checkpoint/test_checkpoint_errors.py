"""Checkpoint integrity and bad input: every failure is a clear error on every rank, and a failed
save loses nothing that was on disk.

A failure here means a guarantee of modelparallel/checkpoint (commit.py for files and
``newest``, errors.py for cross-rank agreement, api.py for the messages) is broken: read the
assertion's expected message first. Each scenario runs on 2 ranks at TP=2.
"""

import os
import time
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

import harness
import modelparallel as smp
from modelparallel.checkpoint.safety import commit

MANIFEST = commit.MANIFEST


def cfg(**kw):
    base = dict(n_embd=32, n_layer=1, n_head=2, vocab_size=97, n_positions=16, bos_token_id=0, eos_token_id=0,
                pad_token_id=0)
    return GPT2Config(**{**base, **kw})


def model_with(seed: int, cls=GPT2LMHeadModel, **kw):
    smp.init({"tensor_parallel_degree": 2, "random_seed": seed})
    model = smp.DistributedModel(cls(cfg(**kw)))
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return model


def listing(path) -> list[str]:
    """The directory's entries but the writer lock file (which stays, by design)."""
    return sorted(n for n in os.listdir(path) if n != commit.LOCK)


def weight(model) -> torch.Tensor:
    return model.module.transformer.h[0].mlp.c_fc.weight.full_tensor().detach().clone()


def errors_of(fn, *args) -> str:
    """The message of the exception ``fn`` raises (test fails if it raises nothing)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the tests read the message
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{fn.__name__} raised nothing")


def bad_inputs(path: str):
    root = Path(path)
    model = model_with(0)
    smp.save_checkpoint(path, "a")
    msgs = {"missing path": errors_of(smp.resume_from_checkpoint, path + "/nope"),
            "unknown tag": errors_of(smp.resume_from_checkpoint, path, "zzz"),
            "full requested": errors_of(smp.resume_from_checkpoint, path, "a", False),
            "directory as tag": errors_of(smp.resume_from_checkpoint, path, "a_partial")}
    empty = root / "empty"
    if smp.rank() == 0:
        empty.mkdir()
    smp.barrier()
    msgs["no newest"] = errors_of(smp.resume_from_checkpoint, str(empty))
    if smp.rank() == 0:
        (empty / "newest").write_text("gone_partial\n")
    smp.barrier()
    msgs["dangling newest"] = errors_of(smp.resume_from_checkpoint, str(empty))
    msgs["bad tag"] = errors_of(smp.save_checkpoint, path, "../x")
    msgs["bad keep"] = errors_of(smp.save_checkpoint, path, "b", True, None, None, None, True, 0)
    smp.init({"tensor_parallel_degree": 2})
    smp.DistributedModel(OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                                  num_attention_heads=2, max_position_embeddings=16)))
    msgs["architecture"] = errors_of(smp.resume_from_checkpoint, path, "a", True, True, False)
    return msgs, weight(model)


def test_bad_input_gives_clear_errors_on_every_rank(tmp_path):
    results = harness.run(2, bad_inputs, str(tmp_path))
    assert results[0][0] == results[1][0], "every rank raises the same error"
    m = results[0][0]
    assert "FileNotFoundError" in m["missing path"] and f"{tmp_path}/nope does not exist" in m["missing path"]
    assert "'zzz_partial' does not exist" in m["unknown tag"] and "['a_partial']" in m["unknown tag"]
    assert "but 'a_partial' does: it is a partial checkpoint, resume it with partial=True" in m["full requested"]
    assert "'a_partial' is the directory of the partial checkpoint tagged 'a': pass tag='a'" in m["directory as tag"]
    assert "has no 'newest' file" in m["no newest"]
    assert "newest names 'gone_partial', which does not exist" in m["dangling newest"]
    assert "tag must be a non-empty name without '/'" in m["bad tag"]
    assert "num_kept_partial_checkpoints must be an integer >= 1" in m["bad keep"]
    assert "holds a 'gpt2' model (GPT2LMHeadModel); this model is 'opt' (OPTForCausalLM)" in m["architecture"]
    assert listing(tmp_path) == ["a_partial", "empty", "newest"], "failed saves wrote nothing"


def corrupt_then_load(path: str, how: str):
    model = model_with(0)
    smp.save_checkpoint(path, "a")
    target = Path(path) / "a_partial" / "model" / "__1_0.distcp"
    if smp.rank() == 0:
        data = bytearray(target.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0x01
            target.write_bytes(bytes(data))
        elif how == "truncate":
            target.write_bytes(bytes(data[:-10]))
        else:
            target.unlink()
    smp.barrier()
    fresh = model_with(1)
    before = weight(fresh)
    msg = errors_of(smp.resume_from_checkpoint, path)
    assert torch.equal(weight(fresh), before), "nothing loaded from a corrupted checkpoint"
    return msg


@pytest.mark.parametrize("how,expected", [("flip", "(corrupted)"), ("truncate", "(truncated or overwritten)"),
                                          ("missing", "missing (listed in the manifest)")])
def test_corrupted_file_is_named_on_every_rank(tmp_path, how, expected):
    msgs = harness.run(2, corrupt_then_load, str(tmp_path), how)
    for msg in msgs:
        assert f"a_partial/model/__1_0.distcp: " in msg and expected in msg, msg


def strict_mismatch(path: str):
    source = model_with(0, GPT2ForSequenceClassification, num_labels=3)
    smp.save_checkpoint(path, "cls", model=source, optimizer=None)
    want = weight(source)
    target = model_with(1, GPT2LMHeadModel, n_positions=32, tie_word_embeddings=False)
    msg = errors_of(smp.resume_from_checkpoint, path, "cls", True, True, False)
    smp.resume_from_checkpoint(path, "cls", strict=False, load_optimizer=False)
    assert torch.equal(weight(target), want), "strict=False still loads what fits"
    return msg, smp.last_load_report()["model"]


def test_strict_lists_every_mismatch_and_non_strict_returns_them(tmp_path):
    msg, report = harness.run(2, strict_mismatch, str(tmp_path))[0]
    assert "missing keys (in the model, not in the checkpoint): ['lm_head.weight']" in msg
    assert "unexpected keys (in the checkpoint, not in the model): ['score.weight']" in msg
    assert "shape mismatch transformer.wpe.weight: checkpoint (16, 32), model (32, 32)" in msg
    assert report.missing_keys == ["lm_head.weight"] and report.unexpected_keys == ["score.weight"]
    assert report.mismatched_shapes == ["transformer.wpe.weight: checkpoint (16, 32), model (32, 32)",
                                        "config n_positions: checkpoint 16, model 32"]
    assert "model: config n_positions: checkpoint 16, model 32" in msg


def fail_on_rank1(path: str, where: str):
    """Save "a", then a save of "b" that fails on rank 1 only; every rank must raise, quickly."""
    from torch.distributed.checkpoint import FileSystemWriter

    model = model_with(0)
    smp.save_checkpoint(path, "a")
    want = weight(model)
    if smp.rank() == 0:
        os.mkdir(Path(path) / commit.hidden_name("staging", commit.new_nonce(), "x_partial"))  # a crashed save's leftover
    smp.barrier()
    with torch.no_grad():
        model.module.transformer.h[0].mlp.c_fc.weight.to_local().add_(1.0)
    owner, name = (FileSystemWriter, "write_data") if where == "dcp write" else (commit, "synced_checksum")
    original = getattr(owner, name)
    if smp.rank() == 1:
        def boom(*_a, **_k):
            raise OSError("No space left on device (simulated)")
        setattr(owner, name, boom)
    start = time.monotonic()
    try:
        msg = errors_of(smp.save_checkpoint, path, "b")
    finally:
        setattr(owner, name, original)  # the rank process lives on for later tests
    elapsed = time.monotonic() - start
    fresh = model_with(1)
    smp.resume_from_checkpoint(path)
    assert torch.equal(weight(fresh), want), "the previous newest checkpoint still loads"
    return msg, elapsed, listing(path)


@pytest.mark.parametrize("where", ["dcp write", "checksum"])
def test_failure_on_one_rank_raises_on_all_and_keeps_the_previous_checkpoint(tmp_path, where):
    results = harness.run(2, fail_on_rank1, str(tmp_path), where)
    for msg, elapsed, _ in results:
        assert "No space left on device (simulated)" in msg and "failed on rank(s)" in msg, msg
        first = msg.splitlines()[0]  # the cause first: what, and on which rank
        assert "No space left on device (simulated)" in first and "(rank 1, during checkpoint save" in first, first
        assert elapsed < 30, f"took {elapsed:.1f}s"
    assert results[0][2] == ["a_partial", "newest"], "failed save removed its staging; leftovers cleaned"


def fail_load_on_rank1(path: str):
    """A load whose DCP read fails on rank 1 only: every rank raises, quickly."""
    from modelparallel.checkpoint.load.fastread import FastReader

    model_with(0)
    smp.save_checkpoint(path, "a")
    model_with(1)
    original = FastReader.read_data
    if smp.rank() == 1:
        def boom(*_a, **_k):
            raise OSError("Input/output error (simulated)")
        FastReader.read_data = boom
    start = time.monotonic()
    try:
        msg = errors_of(smp.resume_from_checkpoint, path)
    finally:
        FastReader.read_data = original
    return msg, time.monotonic() - start


def test_read_failure_on_one_rank_raises_on_all(tmp_path):
    for msg, elapsed in harness.run(2, fail_load_on_rank1, str(tmp_path)):
        # the model part is read (into staging) first, so that read fails first
        assert msg.splitlines()[0].startswith("CheckpointOSError: Input/output error (simulated) (rank 1")
        assert "load (model: read) failed on rank(s)" in msg, msg
        assert elapsed < 30
