"""A single-file resume (``fullmodel.pt``, memory-mapped) while another process rewrites the file.

Truncating a memory-mapped file under its reader ends the reader with SIGBUS. The load holds a
read lease (``safety/lease.py``): a truncation, or any open for writing, waits until every tensor
was copied out; a file already open for writing is read into memory instead of mapped. Each case
runs in a child process, so a SIGBUS fails the test instead of ending pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from modelparallel.checkpoint import single_file
from modelparallel.checkpoint.safety import lease

CHILD = textwrap.dedent("""
    import os, sys, threading, time
    from pathlib import Path
    import torch
    from modelparallel.checkpoint import single_file

    root, tag = Path(sys.argv[1]), "fullmodel.pt"
    expected = torch.load(root / "expected.pt", weights_only=True)
    seen = {}

    def fake_stage_whole(model, whole, strict, from_hf, what, policy=None):
        # another process's truncation starts while the tensors are still mapped
        cut = threading.Thread(target=os.truncate, args=(root / tag, 0))
        cut.start()
        time.sleep(0.5)
        seen["size_while_loading"] = (root / tag).stat().st_size
        seen["cut_waiting"] = cut.is_alive()
        seen["equal"] = all(torch.equal(whole[k], expected[k]) for k in expected) and set(whole) == set(expected)
        seen["thread"] = cut
        return "staged"

    single_file.stage_whole = fake_stage_whole
    got = single_file.stage_file(root, tag, model=None, strict=True, translate_function=lambda w: w)
    seen.pop("thread").join(timeout=60)
    print(got, seen["equal"], seen["cut_waiting"], seen["size_while_loading"] > 0, (root / tag).stat().st_size)
""")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(4)}


def test_truncation_during_a_mapped_load_waits_for_it(tmp_path):
    state = _state()
    torch.save(state, tmp_path / "fullmodel.pt")
    torch.save(state, tmp_path / "expected.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, f"rc {done.returncode} (-7: SIGBUS): {done.stderr[-2000:]}"
    # staged, every tensor equal to what was saved, the truncation held back until the load let go,
    # the file whole meanwhile, truncated afterwards
    assert done.stdout.split() == ["staged", "True", "True", "True", "0"], done.stdout + done.stderr[-2000:]


def test_a_file_open_for_writing_is_read_not_mapped(tmp_path, caplog, monkeypatch):
    state = _state()
    path = tmp_path / "fullmodel.pt"
    torch.save(state, path)
    seen = {}

    def stage_whole(model, whole, strict, from_hf, what, policy=None):
        seen["equal"] = set(whole) == set(state) and all(torch.equal(whole[k], state[k]) for k in state)
        seen["mapped"] = [k for k, t in whole.items() if t.untyped_storage().filename]
        return "staged"

    monkeypatch.setattr(single_file, "stage_whole", stage_whole)
    writer = os.open(path, os.O_WRONLY)  # someone still writing it: no lease can be taken
    try:
        with caplog.at_level("WARNING", logger="modelparallel"):
            got = single_file.stage_file(tmp_path, "fullmodel.pt", None, True, translate_function=lambda w: w)
    finally:
        os.close(writer)
    assert got == "staged" and seen == {"equal": True, "mapped": []}  # read into memory, nothing mapped
    assert "open for writing by another process" in caplog.text and str(path) in caplog.text


def test_the_lease_is_released_after_the_block(tmp_path):
    path = Path(tmp_path / "f.bin")
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        with lease.read_lease(fd) as held:
            assert held == lease.HELD
        # released: an open for writing returns at once (non-blocking: EWOULDBLOCK if a lease were held)
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    finally:
        os.close(fd)
