"""The v2 load (``state_dict_loader.load``) against a hostile or damaged checkpoint directory, on
2 ranks: code in ``.metadata`` or in a non-tensor entry, storage paths leaving the checkpoint, a
FIFO, a truncated or flipped data file. Each must end with the same error on both ranks naming
the file, nothing run, nothing in the state dict changed. Saves over an existing checkpoint
(failed, unfinished, local over other shards) and the plain DCP format are in
``test_v2_checkpoint_saves.py``, which reuses this file's states and comparisons.

A failure points at ``verified_load`` (copies, agreement), ``directory`` (what a load may open,
the commit) or ``checkpoint.files`` / ``safe_load`` (the reads themselves). The attacker here
recomputes the manifest's checksums, so every refusal shown is the reader's, not the CRC's.
"""

from __future__ import annotations

import json
import os
import pickle
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import harness
from modelparallel.checkpoint.safety.errors import CheckpointError
from modelparallel.distributed.checkpoint.directory import SAVED_BY
from modelparallel.distributed.checkpoint.state_dict_loader import load
from modelparallel.distributed.checkpoint.state_dict_saver import save

N = 17


def _state(seed: float) -> dict:
    """Each rank's tensors (its own keys) and shared ones (written once), plus a plain value."""
    rank = dist.get_rank()
    model = {f"r{rank}.w{i}": torch.arange(64.0).reshape(8, 8) * seed + i + 100 * rank for i in range(N)}
    model["shared"] = torch.full((5,), seed)
    return {"model": model, "step": int(seed)}


def _zeros() -> dict:
    state = _state(0.0)
    for v in state["model"].values():
        v.zero_()
    state["step"] = -1
    return state


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and a["model"].keys() == b["model"].keys() \
        and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def _reseal(path: Path, name: str, data: bytes | None = None) -> None:
    """Rank 0 writes ``name`` (when ``data``) and records it in the manifest as an attacker would."""
    if data is not None:
        (path / name).write_bytes(data)
    manifest = json.loads((path / "checkpoint_manifest.json").read_text())
    body = (path / name).read_bytes()
    manifest["files"][name] = {"size": len(body), "crc32": f"{zlib.crc32(body):08x}"}
    (path / "checkpoint_manifest.json").write_text(json.dumps(manifest))


def _metadata(path: Path):
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # our own file, trusted by the test


def _storage_of(metadata, fqn: str):
    return next(k for k in metadata.storage_data if k.fqn == fqn)


def _refused(path: Path, attack, marker: Path | None = None) -> str:
    """Save a checkpoint, let rank 0 ``attack(path)`` it, load it on both ranks into zeros:
    the load must raise on both ranks, name a file of ``path``, change nothing, run nothing."""
    save(_state(2.0), checkpoint_id=str(path))
    if dist.get_rank() == 0:
        attack(path)
    dist.barrier()
    target = _zeros()
    with pytest.raises(CheckpointError) as info:
        load(target, checkpoint_id=str(path))
    assert _same(target, _zeros()), "a failed load changed the state dict"
    assert marker is None or not marker.exists(), "the checkpoint ran code"
    first = str(info.value).splitlines()[0]
    assert str(path) in first, f"the error names no file of the checkpoint: {first}"
    return str(info.value)


class _Runs:
    """Unpickling this calls ``exec``: creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def code_in_metadata(root):
    path, marker = Path(root) / "ck", Path(root) / "ran"
    return _refused(path, lambda p: _reseal(p, ".metadata", pickle.dumps(_Runs(marker))), marker)


def code_in_entry(root):
    """The ``step`` entry pointed at a ``torch.save`` file whose object runs code."""
    path, marker = Path(root) / "ck", Path(root) / "ran"

    def attack(p: Path):
        metadata = _metadata(p)
        torch.save(_Runs(marker), p / "__7_0.distcp")
        size = (p / "__7_0.distcp").stat().st_size
        info = metadata.storage_data[_storage_of(metadata, "step")]
        info.relative_path, info.offset, info.length = "__7_0.distcp", 0, size
        _reseal(p, "__7_0.distcp")
        _reseal(p, ".metadata", pickle.dumps(metadata))

    return _refused(path, attack, marker)


def path_outside(root, where: str):
    """A tensor entry whose ``relative_path`` leaves the checkpoint (a copy of a real data
    file placed there, so only the path is wrong)."""
    path = Path(root) / "ck"
    outside = Path(root) / "outside.distcp"

    def attack(p: Path):
        metadata = _metadata(p)
        key = next(k for k in metadata.storage_data if k.fqn == "model.r0.w3")
        info = metadata.storage_data[key]
        outside.write_bytes((p / info.relative_path).read_bytes())
        info.relative_path = "../outside.distcp" if where == "relative" else str(outside)
        _reseal(p, ".metadata", pickle.dumps(metadata))

    return _refused(path, attack)


def fifo_entry(root, manifest: bool):
    """A data file replaced by a FIFO (listed in the manifest, or in a plain DCP directory
    with no manifest): refused at once, neither rank blocks."""
    path = Path(root) / "ck"

    def attack(p: Path):
        os.remove(p / "__1_0.distcp")
        os.mkfifo(p / "__1_0.distcp")
        if manifest:
            entries = json.loads((p / "checkpoint_manifest.json").read_text())
            entries["files"]["__1_0.distcp"] = {"size": 0, "crc32": "00000000"}
            (p / "checkpoint_manifest.json").write_text(json.dumps(entries))
        else:  # a directory plain DCP wrote: no manifest, no mark of ours in .metadata
            os.remove(p / "checkpoint_manifest.json")
            metadata = _metadata(p)
            metadata.planner_data.pop(SAVED_BY)
            (p / ".metadata").write_bytes(pickle.dumps(metadata))

    return _refused(path, attack)


def damaged(root, how: str):
    path = Path(root) / "ck"

    def attack(p: Path):
        data = bytearray((p / "__1_0.distcp").read_bytes())
        if how == "truncated":
            data = data[:len(data) // 2]
        else:
            data[len(data) // 2] ^= 0x40
        (p / "__1_0.distcp").write_bytes(bytes(data))

    return _refused(path, attack)


@pytest.mark.parametrize("attack,args,expect", [
    ("code_in_metadata", (), r"\.metadata: not a valid DCP metadata file: refused to load builtins\.exec"),
    ("code_in_entry", (), r"checkpoint entry 'step': refused to load"),
    ("path_outside", ("relative",), r"'\.\./outside\.distcp' is not listed in the manifest"),
    ("path_outside", ("absolute",), r"outside\.distcp' is not listed in the manifest"),
    ("fifo_entry", (True,), r"__1_0\.distcp: not a regular file \(a FIFO\)"),
    ("fifo_entry", (False,), r"'__1_0\.distcp' is not listed"),
    ("damaged", ("truncated",), r"__1_0\.distcp: size \d+ bytes, manifest says \d+ \(truncated"),
    ("damaged", ("flipped",), r"__1_0\.distcp: CRC32 [0-9a-f]{8}, manifest says [0-9a-f]{8} \(corrupted\)"),
])
def test_a_hostile_or_damaged_checkpoint_is_refused_on_both_ranks(tmp_path, attack, args, expect):
    import re

    errors = harness.run(2, globals()[attack], str(tmp_path), *args)
    assert errors[0] == errors[1], f"the ranks raised different errors: {errors}"
    assert re.search(expect, errors[0].splitlines()[0]), errors[0]
