"""Soak: many seeded SIGKILL trials of checkpoint saves and retention (default 60).

Each trial forks a 2-rank TP=2 job that resumes from the newest checkpoint, trains and saves
twice with retention, and kills one rank at a seeded file-system event or after a seeded delay;
then the newest visible checkpoint must load bit-exactly and no rank may hang. The machinery is
``tests/checkpoint/checkpoint_kill.py`` (the test suite runs 20 trials of it). Results go to
``bench/results/soak_checkpoint_kill.json``.

    python bench/soak_checkpoint_kill.py [--trials 60] [--seed 1]
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: the driver forks

import common  # noqa: E402 - imports nothing heavy

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=common.RESULTS_DIR / "soak_checkpoint_kill.json")
    args = p.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "checkpoint")]
    from transformers import GPT2LMHeadModel  # noqa: F401 - imported once, shared by every forked job

    import checkpoint_kill

    args.json.parent.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="soak-ckpt-")
    code = checkpoint_kill.main([work, "--trials", str(args.trials), "--seed", str(args.seed),
                                 "--json", str(args.json)])
    print(f"load average after the trials: {common.load_average()}")
    if code == 0:
        import shutil

        shutil.rmtree(work)
    else:
        print(f"kept {work} (checkpoints and every rank's log) for inspection")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
