"""``modelparallel convert``: a Hugging Face model directory to the distributed format and back.

The distributed format is degree-independent, so conversion needs no ranks: it runs in one
process. ``--to distributed`` writes ``config.json`` plus ``model.safetensors`` holding the
distributed-format state dict (what ``DistributedModel.load_state_dict`` accepts at any TP
degree); ``--to hf`` writes a directory ``from_pretrained`` loads with no missing or unexpected
keys (tied duplicates are left out, as ``save_pretrained`` does; HF re-ties them on load).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from . import user_path

HELP = "convert a Hugging Face model directory to the distributed format, or back"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", type=user_path, help="input directory (config.json + *.safetensors)")
    p.add_argument("dest", type=user_path, help="output directory (created; must not hold a model already)")
    p.add_argument("--to", choices=("distributed", "hf"), required=True, help="target format")


def _read_state_dict(directory: Path) -> dict:
    from ..materialize.safetensors_io import load_all

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    state_dict = {}
    for f in files:
        state_dict.update(load_all(f))
    return state_dict


_CONFIG_CAP = 16 << 20
"""Bytes a ``config.json`` may have (Hugging Face's are a few KiB)."""


def _read_config(source: Path) -> dict:
    """``source/config.json`` as a dict, or an error saying what ``source`` is instead."""
    from ..checkpoint.safety.manifest import MANIFEST
    from ..checkpoint.safety.safe_open import read_small

    if not source.exists():
        raise FileNotFoundError(f"{source}: no such directory")
    if not source.is_dir():
        raise NotADirectoryError(f"{source} is a file; the source must be a model directory (config.json + "
                                 "*.safetensors)")
    path = source / "config.json"
    if not path.is_file() and (source / MANIFEST).is_file():
        raise ValueError(f"{source} is a modelparallel checkpoint without config.json (a partial checkpoint holds "
                         "training state, not a model directory): resume it and save a full one with "
                         "smp.save_checkpoint(path, tag, partial=False), whose directory converts")
    try:
        # one open, symlinks followed (the HF cache links its files), a FIFO refused rather than read forever
        config = json.loads(read_small(path, _CONFIG_CAP, follow=True).decode("utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{source}: no config.json (expected a model directory saved with "
                                "save_pretrained)") from None
    except OSError as e:
        raise type(e)(e.errno, e.strerror, str(path)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a model configuration (a JSON object), got {type(config).__name__}")
    return config


def _without_aliases(state_dict: dict) -> dict:
    """Keep one key per storage: safetensors refuses shared tensors, and HF re-ties on load."""
    seen, out = set(), {}
    for key, tensor in state_dict.items():
        ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ptr not in seen:
            seen.add(ptr)
            out[key] = tensor.contiguous()
    return out


def convert(source: Path, dest: Path, to: str) -> Path:
    """Convert ``source`` into ``dest``; returns the written weights file.

    Raises:
        FileNotFoundError / FileExistsError / ValueError: for a missing input, an output that
            already holds weights, or an architecture without translation.
    """
    from safetensors.torch import save_file

    from ..models import table_for
    from ..models._translate import from_hf, to_hf

    config = _read_config(source)
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(f"{dest} is a file; the destination must be a directory (created if missing)")
    table = table_for(config.get("model_type", ""))
    if table is None:
        raise ValueError(f"{source}: model_type {config.get('model_type')!r} has no state-dict translation")
    if any(dest.glob("*.safetensors")):
        raise FileExistsError(f"{dest} already holds *.safetensors files; choose an empty directory")
    state_dict = _read_state_dict(source)
    _refuse_converted(source, table, state_dict, to)
    converted = from_hf(table, state_dict) if to == "distributed" else to_hf(table, state_dict)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / "model.safetensors"
    _write_both(dest, json.dumps(config, indent=2).encode(),
                lambda tmp: save_file(_without_aliases(converted), tmp, metadata={"format": "pt",
                                                                                  "modelparallel_format": to}))
    return out


_FORMATS = {"hf": "Hugging Face", "distributed": "distributed"}


def _refuse_converted(source: Path, table, state_dict: dict, to: str) -> None:
    """Refuse a source already in the ``to`` format, as its first fused weight shows (the formats
    differ only there): HF's ``[in, 3*out]`` has no dimension of ``chunks`` at the fused
    dimension, ours ``[in, 3, out]`` has. Converted again, an HF one crashes and a distributed
    one is silently reshaped into garbage."""
    for key, tensor in state_dict.items():
        try:
            _, template, _ = table.match(table.model_key(key))
        except KeyError:
            continue  # from_hf / to_hf name it
        if template not in table.packed:
            continue
        dim, chunks = table.packed[template]
        found = "distributed" if tensor.dim() >= dim + 2 and tensor.shape[dim] == chunks else "hf"
        if found == to:
            back = "hf" if to == "distributed" else "distributed"
            raise ValueError(f"{source} is already in the {_FORMATS[to]} format ({key} has shape "
                             f"{tuple(tensor.shape)}); --to {back} converts it the other way")
        return


def _write_both(dest: Path, config: bytes, write_weights) -> None:
    """``config.json`` and ``model.safetensors`` written under temporary names, fsynced, then
    renamed into place (config first): a failure leaves no weights file (so a rerun is not
    refused) and no temporary; its error names the file."""
    from ..checkpoint.safety import commit
    from ..checkpoint.save.stream import named

    nonce = commit.new_nonce()
    temps = {name: dest / commit.hidden_name("tmp", nonce, name) for name in ("config.json", "model.safetensors")}
    try:
        with open(temps["config.json"], "wb") as f:
            f.write(config)
            f.flush()
            os.fsync(f.fileno())
        try:
            write_weights(temps["model.safetensors"])
        except Exception as e:  # safetensors' own errors are no OSError and name no file
            if isinstance(e, OSError):
                raise named(e, temps["model.safetensors"]) from None
            raise OSError(f"{dest / 'model.safetensors'}: could not be written ({e})") from None
        commit.fsync_path(temps["model.safetensors"])
        _apply_umask(temps["model.safetensors"])
        for name in ("config.json", "model.safetensors"):
            os.replace(temps[name], dest / name)
        commit.fsync_path(dest)
    except OSError as e:  # nothing half-done: no weights file (its presence would refuse a rerun)
        for path in (*temps.values(), dest / "model.safetensors"):
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise named(e, dest / "model.safetensors") from None


def _apply_umask(path: Path) -> None:
    """safetensors creates its file with mode 0600 whatever the umask; give it the mode any
    other new file of the user's gets (0666 less the umask), as ``config.json`` has."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Convert; a bad input is one line naming the file, exit status 2."""
    from safetensors import SafetensorError

    from ..checkpoint.safety.failure import CheckpointError

    try:
        out = convert(args.source, args.dest, args.to)
    except (OSError, ValueError, KeyError, SafetensorError, CheckpointError) as e:
        message = str(e).strip() or type(e).__name__
        print(f"modelparallel convert: {message}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
