"""The ``modelparallel`` command: a real two-rank ``train`` run end to end, plus the pieces that
decide what every rank sees (tokenizer, corpus order, batches) and the up-front argument checks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modelparallel.cli import main
from modelparallel.cli.data import (
    ByteTokenizer, WindowSampler, eval_batches, find_text_files, read_corpus, select_files, split_holdout,
)
from modelparallel.cli.launch import Nodes, torchrun_args


def test_train_command_two_ranks(tmp_path):
    """Launches itself with torchrun (2 ranks, TP=2), trains, validates, samples, writes artifacts.
    ``--nproc`` is passed on purpose: torchrun once mistook it for its own ``--nproc-per-node``."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "modelparallel.cli", "train", "--model", "gpt2-micro", "--tp", "2",
           "--nproc", "2", "--steps", "5", "--seq-len", "32", "--batch-size", "2", "--max-files", "5",
           "--eval-windows", "4", "--sample-tokens", "8", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (out / "loss.png").stat().st_size > 0
    m = json.loads((out / "metrics.json").read_text())
    assert (m["world_size"], m["tp"], m["dp"]) == (2, 2, 1) and m["optimizer"] == "DistributedOptimizer"
    assert len(m["loss"]) == 5 and all(math.isfinite(v) for v in m["loss"])
    assert math.isfinite(m["final_val_loss"]) and math.isfinite(m["final_train_loss"])
    assert m["loss"][0] == pytest.approx(math.log(ByteTokenizer.vocab_size), abs=0.5)  # starts near uniform
    assert all(t > 0 for t in m["tokens_per_s"]) and m["wall_time_s"] > 0
    assert m["sample"].startswith("def ") and "sample from 'def '" in proc.stdout


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo, wörld ✓ 🐍'\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([tok.eos_token_id, *ids, tok.eos_token_id]) == text  # specials are dropped
    assert tok.vocab_size % 8 == 0 and tok.vocab_size > tok.eos_token_id


def test_corpus_is_deterministic_and_separated(tmp_path):
    for name, body in [("a.py", "x = 1\n"), ("b/c.md", "# t\n"), ("b/d.txt", "é"), ("e.bin", "no"),
                       ("empty.py", ""), ("site-packages/f.py", "skip")]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body, encoding="utf-8")
    files = find_text_files([tmp_path])
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a.py", "b/c.md", "b/d.txt", "empty.py"]
    assert find_text_files([tmp_path / "b", tmp_path / "a.py"]) == sorted(files[1:3] + files[:1])
    assert sorted(select_files(files, None)) == files and select_files(files, 2) == select_files(files, 2)
    tokens, n_read = read_corpus(files, ByteTokenizer())
    assert n_read == 3 and tokens.dtype == torch.int32
    assert (tokens == ByteTokenizer.eos_token_id).sum() == 3  # one separator per non-empty file


def test_bad_data_paths_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        find_text_files([tmp_path / "nope"])
    with pytest.raises(ValueError, match="no .* files"):
        find_text_files([tmp_path])


def test_windows_same_for_tp_ranks_different_for_dp_ranks():
    tokens = torch.arange(10_000, dtype=torch.int32)
    def batches(dp_rank):
        s = WindowSampler(tokens, seq_len=16, batch_size=4, seed=7, dp_rank=dp_rank, dp_size=2)
        return [s.next_batch() for _ in range(3)]
    tp0, tp1, other_dp = batches(0), batches(0), batches(1)  # two TP ranks of dp 0, and dp 1
    for (x0, y0), (x1, y1), (xo, _) in zip(tp0, tp1, other_dp):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
        assert not torch.equal(x0, xo)
        assert x0.shape == (4, 16) and x0.dtype == torch.long
        assert torch.equal(y0[:, :-1], x0[:, 1:]) and torch.equal(y0[:, -1], x0[:, -1] + 1)


def test_data_parallel_ranks_split_one_process_global_batch():
    """Every layout trains on the same windows: the data-parallel ranks' rows, in rank order, are
    the batches one process draws at the global batch size (also after skipping on resume)."""
    tokens = torch.arange(10_000, dtype=torch.int32)
    whole = WindowSampler(tokens, seq_len=16, batch_size=8, seed=7)
    parts = [WindowSampler(tokens, seq_len=16, batch_size=4, seed=7, dp_rank=r, dp_size=2) for r in range(2)]
    whole.skip(2)
    for p in parts:
        p.skip(2)
    for _ in range(3):
        x, y = whole.next_batch()
        rows = [p.next_batch() for p in parts]
        assert torch.equal(x, torch.cat([r[0] for r in rows])) and torch.equal(y, torch.cat([r[1] for r in rows]))
    with pytest.raises(ValueError, match="dp_rank 2"):
        WindowSampler(tokens, seq_len=16, batch_size=4, seed=7, dp_rank=2, dp_size=2)


def test_eval_batches_split_over_dp_ranks():
    train, val = split_holdout(torch.arange(1000, dtype=torch.int32), 0.1, min_val=17)
    assert len(val) == 100 and torch.equal(val, torch.arange(900, 1000, dtype=torch.int32))
    starts = [int(x[i, 0]) for r in range(2) for x, _ in eval_batches(val, 16, 2, 99, r, 2) for i in range(len(x))]
    assert sorted(starts) == [900 + 16 * i for i in range(6)]  # every window once, across dp ranks
    with pytest.raises(ValueError, match="corpus too small"):
        split_holdout(torch.arange(20), 0.1, min_val=17)


def test_bad_arguments_fail_before_launch(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--tp", "3", "--nproc", "4", "--data", str(tmp_path / "missing"), "--model", "nope",
              "--steps", "0", "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for needle in ("--tp 3 does not divide --nproc 4", "missing", "'nope' is neither a preset", "--steps must be"):
        assert needle in err
    assert not (tmp_path / "out").exists()


def test_launcher_separates_its_arguments():
    cmd = torchrun_args(Nodes(2), ["train", "--nproc", "2"])
    assert cmd[cmd.index("modelparallel.cli") + 1] == "--" and "--standalone" in cmd
    cmd = torchrun_args(Nodes(2, nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:29400"), ["train"])
    assert cmd[:cmd.index("-m")] == ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
                                     "--rdzv-endpoint", "127.0.0.1:29400", "--local-addr", "127.0.0.1"]


def test_model_directory_tokenizer_choice(tmp_path):
    """A tokenizer-less directory saved from a preset gets the byte tokenizer; any other
    tokenizer-less directory is refused (transformers would hand back an empty tokenizer)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from modelparallel.cli.presets import load_tokenizer, preset_config

    GPT2LMHeadModel(preset_config("gpt2-micro", 32)).save_pretrained(tmp_path / "bytes")
    assert isinstance(load_tokenizer(str(tmp_path / "bytes")), ByteTokenizer)
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="no usable tokenizer"):
        load_tokenizer(str(tmp_path / "other"))
