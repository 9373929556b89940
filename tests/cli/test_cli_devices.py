"""``modelparallel train`` and ``modelparallel run`` against the machine's GPUs, in one process
with a faked GPU count (nothing is launched).

A failure in the first tests means a launch with more ranks per machine than GPUs is no longer
refused before any rank starts (exit status 2, one line saying how to run on CPU), or the default
run no longer fits a one-GPU machine: look at ``_device_problems`` / ``default_tp`` in
modelparallel/cli/train.py and ``launch_ranks`` in modelparallel/sagemaker/launch.py. A failure in
the last means the training loop no longer moves its batch to the rank's device
(modelparallel/cli/train_job.py ``_cp_part``).
"""

from __future__ import annotations

import shlex
import types
from pathlib import Path

import pytest
import torch

from modelparallel import devices
from modelparallel.cli import build_parser, main, train, train_job

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def data(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.py").write_text("x = 1\n" * 2000)
    return tmp_path


def fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.delenv(devices.DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def _args(data, *extra):
    args = build_parser().parse_args(["train", "--model", "gpt2-micro", "--data", str(data / "data"), "--steps", "4",
                                      "--seq-len", "32", "--out", str(data / "run"), *extra])
    args.argv = []
    return args


@pytest.mark.parametrize("gpus,tp", [(0, 2), (1, 1), (2, 2), (8, 2)])
def test_default_tp_fits_the_gpus(monkeypatch, data, gpus, tp):
    fake_gpus(monkeypatch, gpus)
    args = _args(data)
    assert train.check_args(args) == []
    assert (args.tp, args.nproc) == (tp, tp)


def test_more_ranks_than_gpus_is_refused_before_launch(monkeypatch, data, capsys):
    fake_gpus(monkeypatch, 1)
    launched = []
    monkeypatch.setattr("modelparallel.cli.train_launch.launch_ranks", launched.append)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "gpt2-micro", "--data", str(data / "data"), "--steps", "4", "--seq-len", "32",
              "--out", str(data / "run"), "--tp", "2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and not launched
    assert "2 ranks per machine but PyTorch sees 1 GPU(s)" in err and "lower --nproc" in err, err
    assert "MODELPARALLEL_DEVICE=cpu" in err and "Traceback" not in err


def test_the_cpu_switch_accepts_any_rank_count(monkeypatch, data):
    fake_gpus(monkeypatch, 1)
    monkeypatch.setenv(devices.DEVICE_ENV, "cpu")
    args = _args(data, "--tp", "2")
    assert train.check_args(args) == [] and args.nproc == 2


def test_help_says_the_default_tp(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "1 on a one-GPU machine" in out and "MODELPARALLEL_DEVICE=cpu" in out


def test_run_refuses_more_ranks_than_gpus(monkeypatch, tmp_path, capsys):
    fake_gpus(monkeypatch, 1)
    ran = []
    monkeypatch.setattr("modelparallel.cli.launch.run_agent", lambda *a: ran.append(a))
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["run", "--nproc-per-node", "2", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not ran and len(err) == 1, err
    assert "modelparallel run: error: 2 ranks per machine but PyTorch sees 1 GPU(s)" in err[0]
    assert "--nproc-per-node" in err[0] and "MODELPARALLEL_DEVICE=cpu" in err[0]


def test_the_training_batch_goes_to_the_ranks_device(monkeypatch):
    """The sampler cuts windows in host memory; the step must get them on the rank's device
    (the meta device stands in for a GPU: a tensor left behind stays on CPU)."""
    rt = types.SimpleNamespace(device=torch.device("meta"))
    monkeypatch.setattr(train_job.runtime, "current", lambda: rt)
    monkeypatch.setattr(train_job.smp, "cp_size", lambda: 1)
    x, y = train_job._cp_part(torch.arange(8).view(2, 4), torch.arange(8).view(2, 4))
    assert x.device.type == "meta" and y.device.type == "meta" and x.shape == (2, 4)


def _gpu_commands(doc: str, heading: str) -> list[list[str]]:
    """The command lines of the first bash block under ``heading`` in ``doc``, without comments."""
    text = (ROOT / doc).read_text()
    block = text.split(heading + "\n", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("doc,heading,count", [("docs/gpus.md", "## On GPUs", 5), ("README.md", "### On GPUs", 4)])
def test_the_readme_gpu_commands_pass_the_checks(monkeypatch, tmp_path, doc, heading, count):
    """Every ``train`` line of the GPU quick starts (docs/gpus.md, the README) is accepted as written
    (the first on a one-GPU machine, the others on machines with 8), under torchrun as one of its 8
    ranks too."""
    commands = _gpu_commands(doc, heading)
    assert len(commands) == count, commands
    for i, cmd in enumerate(commands):
        fake_gpus(monkeypatch, 1 if i == 0 else 8)
        if cmd[0].endswith("torchrun"):
            assert cmd[cmd.index("--nproc-per-node") + 1] == "8" and cmd[cmd.index("-m") + 1] == "modelparallel.cli"
            for name, value in (("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_WORLD_SIZE", "8")):
                monkeypatch.setenv(name, value)
            cmd = cmd[cmd.index("--") + 1:]
        elif cmd[1] == "run":
            assert cmd[2:4] == ["--nproc-per-node", "8"] and devices.launch_problems(8, "") == []
            continue
        else:
            cmd = cmd[1:]
        cmd = [str(tmp_path / "out") if a.startswith(("runs/", "/shared/")) else a for a in cmd]
        args = build_parser().parse_args(cmd)
        args.argv = cmd
        assert train.check_args(args) == [], cmd
        for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("gpus,value,needle", [
    (1, "gpu", "MODELPARALLEL_DEVICE='gpu': use one of cpu, cuda"),
    (0, "cuda", "MODELPARALLEL_DEVICE=cuda but PyTorch sees no GPU"),
])
def test_an_unusable_device_switch_is_refused_before_launch(monkeypatch, data, capsys, gpus, value, needle):
    fake_gpus(monkeypatch, gpus)
    monkeypatch.setenv(devices.DEVICE_ENV, value)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "gpt2-micro", "--data", str(data / "data"), "--steps", "4", "--seq-len", "32",
              "--out", str(data / "run")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err and "Traceback" not in err, err


def test_run_on_cpu_hides_the_gpus_from_the_script(monkeypatch, tmp_path):
    """Under ``MODELPARALLEL_DEVICE=cpu`` a script's own ``.cuda()`` / ``set_device`` must not find a GPU."""
    fake_gpus(monkeypatch, 1)
    monkeypatch.setenv(devices.DEVICE_ENV, "cpu")
    ran = []
    monkeypatch.setattr("modelparallel.cli.launch.run_agent", lambda args, nproc, extra: ran.append((nproc, extra)))
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["run", "--nproc-per-node", "2", "--sagemaker-dir", str(tmp_path / "sm"), str(script)]) == 0
    (nproc, extra), = ran
    assert nproc == 2 and extra["CUDA_VISIBLE_DEVICES"] == ""
