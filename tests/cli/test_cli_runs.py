"""``modelparallel train`` runs that end otherwise than well, and the runs that continue them.

A failure here means the CLI: reports a failed or interrupted run with tracebacks from every rank
instead of one short block, leaves ranks running after Ctrl-C, resumes from the wrong place (its
losses then differ from the uninterrupted run's), loses the history before an interruption, or
accepts a ``--resume`` it cannot honour (a run then silently starts over).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from modelparallel.cli import main
from modelparallel.cli.data import ByteTokenizer

STEPS = 40  # long enough that a Ctrl-C sent at the first checkpoint lands mid-run
RUN = ["--model", "gpt2-micro", "--tp", "2", "--nproc", "2", "--seq-len", "32", "--batch-size", "2",
       "--max-files", "5", "--eval-windows", "2", "--eval-every", "0", "--sample-tokens", "0"]


def _env(marker: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # the same thread count in every run, so their losses are comparable
    env["MP_TEST_MARKER"] = marker
    return env


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "modelparallel.cli", "train", *RUN, "--out", str(out), *extra]


def _train(out: Path, *extra: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(out, *extra), capture_output=True, text=True, timeout=300, env=_env())
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted run of STEPS steps with a checkpoint every 2 steps: (out, its stdout)."""
    out = tmp_path_factory.mktemp("reference")
    return out, _train(out, "--steps", str(STEPS), "--save-every", "2", "--keep", "3").stdout


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    return reference_run[0]


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``MP_TEST_MARKER=marker`` (the ranks inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"MP_TEST_MARKER={marker}".encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_ctrl_c_stops_every_rank_and_the_resumed_run_repeats_the_whole_history(reference, tmp_path):
    """SIGINT to the launcher: exit 130, one line saying where to resume, no traceback, no rank
    left; only committed checkpoints on disk. ``--resume`` then finishes the run, and its
    metrics.json holds all STEPS losses, equal to the uninterrupted run's (same batches, weights
    and optimizer state: the same computation in the same order, so exactly equal)."""
    out, marker = tmp_path / "run", uuid.uuid4().hex
    launcher = subprocess.Popen(_cmd(out, "--steps", str(STEPS), "--save-every", "2", "--keep", "3"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(marker))
    deadline = time.monotonic() + 240
    while not (out / "checkpoints" / "newest").exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGINT)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, stdout[-2000:] + stderr[-4000:]
    last = stderr.strip().splitlines()[-1]
    words = last.replace(";", "").split()  # interrupted at step N newest checkpoint step M rerun with --resume
    assert words[:3] == ["interrupted", "at", "step"] and words[4:7] == ["newest", "checkpoint", "step"], last
    assert last.endswith("rerun with --resume") and 2 <= int(words[7]) <= int(words[3]) < STEPS, last
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stdout + stderr
    assert _processes_with(marker) == []
    visible = [p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")]
    assert all((out / "checkpoints" / n / "checkpoint_manifest.json").is_file() for n in visible if n != "newest")

    resumed = _train(out, "--steps", str(STEPS), "--save-every", "2", "--keep", "3", "--resume")
    assert f"at step {words[7]}" in resumed.stdout
    m, full = _metrics(out), _metrics(reference)
    assert m["first_step"] == int(words[7]) and m["history_first_step"] == 0
    assert m["loss"] == full["loss"] and len(m["loss"]) == STEPS


def test_each_checkpoint_save_prints_one_line_and_tokens_per_s_is_the_bars(reference_run):
    reference, stdout = reference_run
    saves = [line for line in stdout.splitlines() if "saved checkpoint" in line]
    assert len(saves) == STEPS // 2 and saves[0].startswith("step 2: saved checkpoint ")
    assert all("written in the background" in line for line in saves), saves  # --save-every is async by default
    m = _metrics(reference)
    assert m["loss"][0] == pytest.approx(math.log(ByteTokenizer.vocab_size), abs=0.5)  # starts near uniform
    assert m["mean_tokens_per_s"] == pytest.approx(
        STEPS * 2 * 32 / sum(m["step_time_s"]), rel=1e-9)  # the bar's definition: tokens / summed step time
    assert {p.name for p in (reference / "checkpoints").glob("step*")} == \
        {f"step{s}_partial" for s in (STEPS - 4, STEPS - 2, STEPS)}  # --keep 3


def test_resume_requests_are_checked_before_launch(reference, tmp_path, capsys):
    """Nothing to resume, a finished run, an unknown tag, a damaged newest (naming the intact
    ones): each refused with exit status 2 before any rank starts; ``auto`` starts fresh."""
    def refused(*argv) -> str:
        with pytest.raises(SystemExit) as exc:
            main(["train", *RUN, *argv])
        assert exc.value.code == 2
        return capsys.readouterr().err

    err = refused("--out", str(tmp_path / "typo"), "--resume")
    assert "nothing to resume" in err and str(tmp_path / "typo" / "checkpoints") in err
    (tmp_path / "other" / "checkpoints" / "notes").mkdir(parents=True)
    assert "it holds: notes" in refused("--out", str(tmp_path / "other"), "--resume")
    assert "nothing left to train" in refused("--out", str(reference), "--steps", str(STEPS), "--resume")
    err = refused("--out", str(reference), "--steps", str(STEPS + 2), "--resume-from", "step3")
    assert f"saved: step{STEPS}, step{STEPS - 2}, step{STEPS - 4}" in err

    shutil.copytree(reference / "checkpoints", tmp_path / "broken" / "checkpoints")
    shard = sorted((tmp_path / "broken" / "checkpoints" / f"step{STEPS}_partial" / "model").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    err = refused("--out", str(tmp_path / "broken"), "--steps", str(STEPS + 2), "--resume")
    assert f"checkpoint step{STEPS}" in err and "damaged" in err and shard.name in err
    assert f"intact checkpoints: step{STEPS - 2}, step{STEPS - 4}" in err and f"--resume-from step{STEPS - 2}" in err

    from modelparallel.cli.resume import choose

    assert choose(tmp_path / "typo", "auto", None, STEPS, verify=True) == (None, [])
    assert choose(reference, "auto", None, STEPS + 2, verify=True) == (f"step{STEPS}", [])
    assert choose(tmp_path / "broken", None, f"step{STEPS - 2}", STEPS + 2, verify=True) == (f"step{STEPS - 2}", [])


def test_encoder_directory_is_refused_before_launch(tmp_path, capsys):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                         vocab_size=ByteTokenizer.vocab_size)).save_pretrained(tmp_path / "bert")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["train", *RUN[2:], "--model", str(tmp_path / "bert"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "this is not a causal LM" in err and "BertModel" in err and len(err.splitlines()) <= 3


def test_a_failing_run_is_one_short_block_with_the_log_of_every_rank(tmp_path):
    """A model directory whose weights lack a layer its config.json declares fails on every rank
    after launch; the launcher prints the first error and the log file, exits 1."""
    from transformers import GPT2LMHeadModel

    from modelparallel.cli.presets import preset_config

    GPT2LMHeadModel(preset_config("gpt2-micro", 32)).save_pretrained(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "n_layer": config["n_layer"] + 1}))
    proc = _train(tmp_path / "run", "--steps", "2", "--model", str(tmp_path / "model"), ok=False)
    assert proc.returncode == 1
    block = proc.stderr[proc.stderr.index("modelparallel train failed"):].splitlines()
    assert block[0].startswith("modelparallel train failed: rank ") and "ValueError: cannot load" in block[1]
    assert f"transformer.h.{config['n_layer']}.attn.c_attn.weight" in "\n".join(block)
    assert block[-1] == f"  full tracebacks: {tmp_path / 'run' / 'failure.log'}" and len(block) <= 6
    assert "Traceback" not in proc.stdout + proc.stderr
    log = (tmp_path / "run" / "failure.log").read_text()
    assert log.count("Traceback (most recent call last)") >= 1 and "load_hf_checkpoint" in log


def test_train_fine_tunes_a_model_directory_read_shard_on_read(tmp_path):
    """--model DIR builds the model on the meta device and reads its weights shard by shard: a
    saved model whose LM head always predicts token 0 starts with a huge loss, a model that was
    not loaded (fresh init) would start near ln(vocab)."""
    from transformers import GPT2LMHeadModel

    from modelparallel.cli.presets import preset_config

    model = GPT2LMHeadModel(preset_config("gpt2-micro", 32))
    with torch.no_grad():
        model.transformer.wte.weight[0].fill_(3.0)
        model.transformer.ln_f.weight.fill_(5.0)
        model.transformer.ln_f.bias.fill_(5.0)
    model.save_pretrained(tmp_path / "pretrained")
    _train(tmp_path / "run", "--steps", "2", "--model", str(tmp_path / "pretrained"))
    m = _metrics(tmp_path / "run")
    assert m["loss"][0] > 3 * math.log(ByteTokenizer.vocab_size), m["loss"]
