"""Crash-safe commit, ``newest`` and retention (modelparallel/checkpoint/safety/commit.py).

A failure means a checkpoint could become visible before it is complete, a good checkpoint
could be deleted, or a leftover could be mistaken for a checkpoint. The file-level rules are
tested in one process; the last test checks them through ``smp.save_checkpoint`` on 2 ranks.
"""

import json
import os

import torch

import harness
import modelparallel as smp
from modelparallel.cli import main
from modelparallel.checkpoint.safety import commit


def fake_checkpoint(root, name, saved_at, content=b"x"):
    staging = root / commit.hidden_name("staging", commit.new_nonce(), name)
    staging.mkdir()
    (staging / "data.bin").write_bytes(content)
    commit.write_manifest(staging, {"saved_at_ns": saved_at, "format": "modelparallel-partial", "parts": [],
                                    "files": {"data.bin": commit.file_checksum(staging / "data.bin")}})
    commit.commit_dir(staging, root / name)


def test_retention_keeps_the_newest_and_never_touches_foreign_directories(tmp_path):
    for i in range(4):
        fake_checkpoint(tmp_path, f"s{i}_partial", saved_at=100 + i)
    (tmp_path / "mine_partial").mkdir()  # no manifest: not ours, never deleted (orbax #394)
    (tmp_path / "mine_partial" / "notes.txt").write_text("keep me")
    deleted = commit.apply_retention(tmp_path, keep=2, protect="s3_partial")
    assert deleted == ["s0_partial", "s1_partial"]
    assert sorted(os.listdir(tmp_path)) == ["mine_partial", "s2_partial", "s3_partial"]


def test_retention_never_deletes_what_newest_names(tmp_path):
    fake_checkpoint(tmp_path, "old_partial", saved_at=1)
    fake_checkpoint(tmp_path, "new_partial", saved_at=2)
    assert commit.apply_retention(tmp_path, keep=1, protect="old_partial") == []


def test_same_tag_is_replaced_whole_and_leftovers_are_cleaned(tmp_path):
    fake_checkpoint(tmp_path, "t_partial", saved_at=1, content=b"old")
    fake_checkpoint(tmp_path, "t_partial", saved_at=2, content=b"new")
    assert (tmp_path / "t_partial" / "data.bin").read_bytes() == b"new"
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == [], "the swapped-out copy is deleted"
    (tmp_path / commit.hidden_name("staging", commit.new_nonce(), "u_partial")).mkdir()
    (tmp_path / commit.hidden_name("tmp", commit.new_nonce(), "newest")).write_text("half")
    (tmp_path / ".mp-notes").write_text("a user's file: not ours, never removed")
    assert len(commit.clean_leftovers(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == [".mp-notes", "t_partial"]


def test_newest_is_replaced_atomically_and_checksums_catch_changes(tmp_path):
    commit.write_newest(tmp_path, "a_partial")
    commit.write_newest(tmp_path, "b_partial")
    assert commit.read_newest(tmp_path) == "b_partial" and os.listdir(tmp_path) == ["newest"]
    fake_checkpoint(tmp_path, "c_partial", saved_at=1, content=b"abcdef")
    entry = json.loads((tmp_path / "c_partial" / commit.MANIFEST).read_text())["files"]["data.bin"]
    assert commit.verify_file(tmp_path / "c_partial", "data.bin", entry) is None
    (tmp_path / "c_partial" / "data.bin").write_bytes(b"abcdeF")
    assert "(corrupted)" in commit.verify_file(tmp_path / "c_partial", "data.bin", entry)


def save_with_retention(path: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    smp.init({"tensor_parallel_degree": 2})
    model = smp.DistributedModel(GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50,
                                                             n_positions=8, bos_token_id=0, eos_token_id=0)))
    for step in range(4):
        with torch.no_grad():
            model.module.transformer.wpe.weight.fill_(step)
        smp.save_checkpoint(path, f"step{step}", user_content=step, num_kept_partial_checkpoints=2)
    smp.save_checkpoint(path, "step2", user_content="again")  # same tag saved again: replaced
    return smp.resume_from_checkpoint(path), smp.resume_from_checkpoint(path, "step3")


def test_save_checkpoint_applies_retention_and_updates_newest(tmp_path, capsys):
    first, second = harness.run(2, save_with_retention, str(tmp_path))[0]
    assert (first, second) == ("again", 3)
    assert sorted(os.listdir(tmp_path)) == [commit.LOCK, "newest", "step2_partial", "step3_partial"]
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "newest: step2_partial" in out and "* step2_partial" in out and "  step3_partial" in out
    assert "tp 2 x dp 1" in out and "gpt2 GPT2LMHeadModel" in out and out.count("ok (4 files)") == 2
    victim = tmp_path / "step3_partial" / "model" / ".metadata"
    victim.write_bytes(victim.read_bytes()[:-1])
    assert main(["inspect", str(tmp_path)]) == 1
    assert "step3_partial/model/.metadata: size" in capsys.readouterr().out


def test_checksum_is_zlib_crc32_whichever_library_computes_it():
    """Manifests must verify in any environment: the (optional) SIMD CRC gives zlib's values."""
    import zlib

    data = bytes(range(256)) * 4099 + b"tail"
    assert commit.crc32(data) == zlib.crc32(data)
    assert commit.crc32(data[1000:], commit.crc32(data[:1000])) == zlib.crc32(data)


def test_every_file_is_verified_by_exactly_one_rank_and_dcp_files_by_their_writer():
    sizes = {"model/__0_0.distcp": 500, "model/__1_0.distcp": 480, "optimizer/__0_0.distcp": 900,
             "optimizer/__1_0.distcp": 910, "model/.metadata": 40, "optimizer/.metadata": 60,
             "user_content.pt": 700, "model/__5_0.distcp": 10}  # written by a rank this job lacks
    shares = [commit.share(sizes, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(sizes), "a partition of the files"
    for r in range(2):
        assert {f"model/__{r}_0.distcp", f"optimizer/__{r}_0.distcp"} <= set(shares[r])
    assert commit.share(sizes, 0, 1) == sorted(sizes)


def test_a_clock_stepped_back_does_not_reorder_the_saves(tmp_path, monkeypatch):
    """``saved_at_ns`` orders retention and ``--resume``: a save made after the clock went back
    records a time just after the checkpoint ``newest`` names, so retention deletes the older save."""
    clock = {"ns": 1000}
    monkeypatch.setattr(commit.time, "time_ns", lambda: clock["ns"])
    assert commit.saved_at(tmp_path) == 1000, "no checkpoint yet: the clock"
    fake_checkpoint(tmp_path, "a_partial", saved_at=commit.saved_at(tmp_path))
    commit.write_newest(tmp_path, "a_partial")
    clock["ns"] = 400  # stepped back
    fake_checkpoint(tmp_path, "b_partial", saved_at=commit.saved_at(tmp_path))
    commit.write_newest(tmp_path, "b_partial")
    assert [n for _, n in commit.saved_checkpoints(tmp_path)] == ["a_partial", "b_partial"]
    assert commit.apply_retention(tmp_path, keep=1, protect="b_partial") == ["a_partial"]
    clock["ns"] = 5000  # ahead again: the clock
    assert commit.saved_at(tmp_path) == 5000
    (tmp_path / "newest").write_text("gone_partial")  # newest naming nothing readable: the clock
    clock["ns"] = 10
    assert commit.saved_at(tmp_path) == 10
