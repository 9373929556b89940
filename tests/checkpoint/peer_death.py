"""A 2-rank job (TP=2, gloo) whose rank 1 is SIGKILLed in the middle of a checkpoint phase;
prints, as JSON, what rank 0 raised and how long it took. Run by test_checkpoint_peer_death.py
as a script: the driver imports torch once and forks both ranks.

Usage: python peer_death.py DIR PHASE   (PHASE: "save", "load", or "async-group": rank 1 dies
just before the first asynchronous save creates its background process group)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

TIMEOUT_S = {"save": 60, "load": 60, "async-group": 10}
"""The job's collective timeout per phase (a peer dead before a group is created is only seen
when the timeout expires, so that phase has a short one)."""
ROLL_CALL_S = 0.2
"""The survivor's roll call (``errors.ROLL_CALL_S``, 3 s by default): it waits for the other
survivors, and this 2-rank job has none, so it always ends at its limit naming rank 1; a shorter
limit names it the same without 3 s of waiting."""


def _rank(rank: int, root: Path, phase: str) -> None:
    import torch
    import torch.distributed as dist

    import modelparallel as smp
    from modelparallel.checkpoint.background import async_save
    from modelparallel.checkpoint.load import fastread
    from modelparallel.checkpoint.safety import errors
    from modelparallel.checkpoint.save import partial

    errors.ROLL_CALL_S = ROLL_CALL_S  # this forked rank's own copy of the module

    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=TIMEOUT_S[phase]))
    sys.path.insert(0, str(Path(__file__).parent))
    from ckpt_helpers import build

    build()
    if phase == "load":
        smp.save_checkpoint(root / "ck", "a")
    if rank == 1:  # dies inside the phase, after the first collective of the save or load started
        def die(*_a, **_k):
            os.kill(os.getpid(), signal.SIGKILL)
        if phase == "save":
            partial._write = die
        elif phase == "async-group":
            async_save.AsyncSaver.process_group = die
        else:
            fastread.FastReader.read_data = die
    start = time.monotonic()
    try:
        if phase == "load":
            smp.resume_from_checkpoint(root / "ck")
        else:
            smp.save_checkpoint(root / "ck", "b", async_save=phase == "async-group")
            smp.wait_for_checkpoints()
        message = None
    except Exception as e:  # noqa: BLE001 - reported to the driver
        message = f"{type(e).__name__}: {e}"
    (root / "result.json").write_text(json.dumps({"message": message, "seconds": time.monotonic() - start}))
    del torch


def main() -> int:
    root, phase = Path(sys.argv[1]), sys.argv[2]
    root.mkdir(parents=True, exist_ok=True)
    import torch  # noqa: F401 - imported once, shared by the forked ranks
    import transformers  # noqa: F401

    import modelparallel  # noqa: F401

    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _rank(rank, root, phase)
            except BaseException:  # noqa: BLE001 - reported through the exit code
                import traceback

                traceback.print_exc()
                code = 3
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + 500  # generous: a loaded machine starts ranks slowly
    codes = {}
    while len(codes) < 2 and time.monotonic() < deadline:
        for rank, pid in enumerate(pids):
            if rank not in codes and os.waitpid(pid, os.WNOHANG)[0]:
                codes[rank] = "done"
        time.sleep(0.05)
    for rank, pid in enumerate(pids):
        if rank not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    result = root / "result.json"
    print(result.read_text() if result.exists() else json.dumps({"message": "rank 0 did not finish"}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    raise SystemExit(main())
