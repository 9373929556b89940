"""``modelparallel run``'s answers to a user's mistakes and to scripts that end oddly, run as a
user runs it (``python -m modelparallel``, this checkout first on the path).

A failure here means: a bad ``--nproc-per-node`` ends in a traceback again instead of one line
naming it; a rank's ``os._exit(5)`` gets torchrun's long report (or status 1) instead of one block
with its status; ``sys.exit("message")`` loses its message; a killed launcher's status directory
is named so that no later launcher sweeps it; or ``python -m modelparallel`` is gone.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

from modelparallel.cli import status_dir

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TMPDIR": str(tmp_path)}  # the launcher's status directory lands where the test looks
    return subprocess.run([sys.executable, "-m", "modelparallel", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _script(tmp_path: Path, text: str) -> str:
    script = tmp_path / "script.py"
    script.write_text(text)
    return str(script)


def test_bad_nproc_per_node_is_one_line(tmp_path):
    script = _script(tmp_path, "print('ran')\n")
    for value in ("0", "-1", "abc"):
        done = _run(tmp_path, "run", "--nproc-per-node", value, script)
        assert done.returncode == 2, (value, done.stderr[-3000:])
        assert "Traceback" not in done.stderr and "ran" not in done.stdout, done.stderr[-3000:]
        assert done.stderr.strip().splitlines()[-1].startswith(f"modelparallel run: error: --nproc-per-node "), \
            done.stderr


def test_rank_os_exit_is_one_block_with_its_status(tmp_path):
    """No record (``os._exit``): torchrun's report would be ~20 lines and the launcher's status 1."""
    script = _script(tmp_path, "import os\nos._exit(5)\n")
    done = _run(tmp_path, "run", "--nproc-per-node", "1", script)
    assert done.returncode == 5, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-2] == "modelparallel run failed: rank 0 during its run", done.stderr
    assert "exited with code 5" in lines[-1] and "ChildFailedError" not in done.stderr, done.stderr


def test_sys_exit_message_is_reported(tmp_path):
    script = _script(tmp_path, "import sys\nsys.exit('no data under /nowhere')\n")
    done = _run(tmp_path, "run", "--nproc-per-node", "1", script)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    header = lines.index(f"modelparallel run failed: rank 0 during {script}")
    assert lines[header + 1] == "  SystemExit: no data under /nowhere", done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # Python prints the message alone too


def test_killed_launchers_status_dir_is_swept(tmp_path):
    """The script SIGKILLs the launcher (its parent: torchrun's agent runs in the launcher), which
    so removes nothing; a later launcher's sweep must recognize the directory left behind."""
    script = _script(tmp_path, "import os, signal, time\n"
                               "open('status_path', 'w').write(os.environ['MODELPARALLEL_CLI_STATUS'])\n"
                               "os.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(30)\n")
    done = _run(tmp_path, "run", "--nproc-per-node", "1", script)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    left = Path((tmp_path / "status_path").read_text())
    assert left.parent == tmp_path and left.is_dir()
    assert status_dir.sweep(tmp_path) == [left]
    assert not left.exists()


def test_python_m_modelparallel_is_the_command_without_torch(tmp_path):
    done = _run(tmp_path, "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: modelparallel ") and "run" in done.stdout
    code = ("import runpy, sys\nsys.argv = ['modelparallel', '--help']\ntry:\n"
            "    runpy.run_module('modelparallel', run_name='__main__', alter_sys=True)\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.stderr.strip().splitlines()[-1] == "False False", done.stderr[-3000:]
