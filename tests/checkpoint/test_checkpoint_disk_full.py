"""A save that runs out of disk names the cause and the file, and leaves no temporary file.

A failure means ``torch.save``'s zip writer or DCP replaced the ``OSError`` by text that names
neither (modelparallel/checkpoint/save/writer.py), a full checkpoint's shard lost its error
(save/shards.py, save/full.py), ``smp.save`` lost it (sagemaker/legacy.py), or a temporary file
stayed behind (safety/commit.py). 2 ranks at TP=2.
"""

import errno
import os
from pathlib import Path

import torch

import harness
import modelparallel as smp
from ckpt_helpers import build, error_of


def _enospc_on_write(n: int):
    """Make the ``n``-th write of a file object opened for writing fail with ENOSPC."""
    import io

    real_open, count = io.open, [0]

    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            count[0] += 1
            if count[0] >= n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    def fake_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Full(f) if "w" in mode or "a" in mode else f

    return real_open, fake_open


def disk_full(path: str) -> dict:
    """ENOSPC at the second write of rank 1's DCP file and of rank 0's full-checkpoint shard, and
    at the write of a legacy ``smp.save``: the cause and the file are named; no temporary file stays behind."""
    import builtins
    import io

    root = Path(path)
    build()
    msgs = {}
    for what, call in (("partial", lambda: smp.save_checkpoint(root / "p", "a")),
                       ("full", lambda: smp.save_checkpoint(root / "f", "a", partial=False)),
                       ("legacy", lambda: smp.save({"w": torch.ones(1000)}, str(root / "legacy" / "x.pt"),
                                                   partial=False))):
        real, fake = _enospc_on_write(1 if what == "legacy" else 2)
        victim = {"partial": 1, "full": 0, "legacy": 0}[what]
        if smp.rank() == victim:
            io.open = builtins.open = fake
        try:
            msgs[what] = error_of(call) if what != "legacy" or smp.rank() == 0 else None
        finally:
            io.open = builtins.open = real
        smp.barrier()
    leftovers = sorted(str(p.relative_to(root)) for p in root.rglob(".mp-tmp-*"))
    return {"msgs": msgs, "leftovers": leftovers}


def test_disk_full_errors_name_the_cause_and_the_file(tmp_path):
    results = harness.run(2, disk_full, str(tmp_path))
    for r in results:
        first = r["msgs"]["partial"].splitlines()[0]
        assert "No space left on device" in first and "p/.mp-staging-" in first and "__1_0.distcp" in first, first
        first = r["msgs"]["full"].splitlines()[0]
        assert "No space left on device" in first and "model.safetensors" in first, first
    legacy = results[0]["msgs"]["legacy"]
    assert "No space left on device" in legacy and "x.pt" in legacy, legacy
    assert results[0]["leftovers"] == [], results[0]["leftovers"]
