"""``modelparallel run`` (modelparallel/sagemaker/launch.py) as a user runs it, in a subprocess.

A failure here means the launcher no longer ends a run cleanly when a rank's script raises: the
first failing rank's traceback and one block naming it, every traceback in
``<sagemaker-dir>/output/failure.log``, exit status 1. (A whole SageMaker script through the
launcher, trained, saved and resumed, is in tests/test_v1_scripts.py.)
"""

import os
import subprocess
import sys
from pathlib import Path


def test_failing_script_reported_once(tmp_path):
    """A script that fails on one rank ends every rank; the launcher prints that rank's traceback
    and one block naming it, and keeps every traceback in <sagemaker-dir>/output/failure.log."""
    script = tmp_path / "fails.py"
    script.write_text("import os\nimport smdistributed.modelparallel.torch as smp\nsmp.init({})\n"
                      "if smp.rank() == 1:\n    raise ValueError('bad shard 7')\nsmp.barrier()\n")
    cli = Path(sys.executable).parent / "modelparallel"
    done = subprocess.run([str(cli), "run", "--nproc-per-node", "2", "--sagemaker-dir", str(tmp_path / "sm"),
                           str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1
    assert f"modelparallel run failed: rank 1 during {script}" in done.stderr
    assert "ValueError: bad shard 7" in done.stderr
    assert "bad shard 7" in (tmp_path / "sm" / "output" / "failure.log").read_text()


def test_rank_part_under_torchrun(tmp_path):
    """``torchrun -m modelparallel.run script.py``: each rank gets the SageMaker names and
    environment without a second launch."""
    script = tmp_path / "names.py"
    script.write_text("import os, sys\nimport torch.sagemaker as tsm\ntsm.init({})\n"
                      "open(os.path.join(os.environ['SM_OUTPUT_DATA_DIR'], f'rank{tsm.rank()}'), 'w')"
                      ".write(' '.join([os.environ['SM_NUM_GPUS'], os.environ['SM_CURRENT_HOST'], *sys.argv[1:]]))\n")
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--standalone", "-m", "modelparallel.run",
                           "--sagemaker-dir", str(tmp_path / "sm"), str(script), "--lr", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    gpus = 2  # the suite hides GPUs from the ranks (conftest): SM_NUM_GPUS is then the ranks per machine
    for rank in (0, 1):
        assert (tmp_path / "sm" / "output" / "data" / f"rank{rank}").read_text() == f"{gpus} algo-1 --lr 1"


def test_no_python_refused(tmp_path):
    cli = Path(sys.executable).parent / "modelparallel"
    done = subprocess.run([str(cli), "run", "--no-python", "x.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "--no-python cannot be used" in done.stderr, (done.returncode, done.stderr)


def test_cuda_step_calls_on_cpu(tmp_path):
    """On a machine without CUDA the calls SageMaker's scripts make around a step (set_device,
    synchronize, NVTX ranges) pass, and ``rank % torch.cuda.device_count()`` fails with a message
    naming the line and the fix (not a bare ZeroDivisionError)."""
    script = tmp_path / "cuda_calls.py"
    script.write_text("import os, torch, torch.distributed as dist\n"
                      "dist.init_process_group('smddp')\n"
                      "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
                      "torch.cuda.nvtx.range_push('step')\ntorch.cuda.synchronize()\ntorch.cuda.nvtx.range_pop()\n"
                      "print('steps passed', flush=True)\n"
                      "device = dist.get_rank() % torch.cuda.device_count()\n")
    cli = Path(sys.executable).parent / "modelparallel"
    done = subprocess.run([str(cli), "run", "--nproc-per-node", "1", "--sagemaker-dir", str(tmp_path / "sm"),
                           str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert "steps passed" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 1
    assert "dist.get_rank() % torch.cuda.device_count()` divides by torch.cuda.device_count()" in done.stderr
    assert "LOCAL_RANK" in done.stderr
