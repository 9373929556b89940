"""Loading full-model weights into a sharded model, all or nothing: a full checkpoint's
safetensors files, or a dict of full tensors (SageMaker's single ``fullmodel.pt``, a user
``translate_function``'s output).

A full checkpoint is planned from its safetensors headers (keys, shapes, dtype kinds, compared
with the model before anything is read), then every file is read front to back and verified
against the manifest (``files.VerifiedReader``), one whole tensor at a time: each rank keeps only
its shard of it, in staging tensors (``staging``); the caller applies them once every rank read
everything. Peak memory: the staged shards plus one full tensor (in journal mode, see
``journal``: one full tensor, each shard applied through the undo journal as it is read). No
communication.

A user ``translate_function`` (SageMaker's whole-state-dict translators, e.g.
``translate_hf_state_dict_to_smdistributed_gpt2``) needs the whole state dict at once: every
rank then reads all weights (verified) into memory first.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable

import torch

from ...host_bytes import host_bytes
from ...materialize.safetensors_io import DTYPES
from ...pipeline.split import elsewhere
from ...tp.layout import local_part, shard_of
from ..format import layouts, model_config
from ..safety.errors import run_phase
from ..safety.files import CheckpointFiles, CorruptFileError
from . import parts, staging
from .journal import Policy
from .parts import LoadReport

Source = tuple[str, str, tuple, torch.dtype | str]  # (file, stored key, global shape, dtype or name)


def _kind(dtype: torch.dtype | str) -> str:
    """"float", "int", "bool", "complex" or the unknown safetensors name: a value is cast on
    read within its kind (fp32 <-> bf16), across kinds never (an int32 read as fp32 is a lie)."""
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype, dtype)
        if isinstance(dtype, str):
            return dtype
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "complex" if dtype.is_complex else "int"


def _header(files: CheckpointFiles, name: str) -> dict:
    """The JSON header of safetensors file ``name`` (plan only: the verified read re-reads it
    and must find the same)."""
    with files.reader(name) as reader:
        (n,) = struct.unpack("<Q", bytes(reader.read(8)))
        if n > files.entry(name)["size"] - 8:
            raise CorruptFileError(f"{reader.path}: safetensors header of {n} bytes in a smaller file")
        try:
            return json.loads(bytes(reader.read(n)))
        except ValueError as e:
            raise CorruptFileError(f"{reader.path}: unreadable safetensors header ({e})") from None


def _sources(headers: dict[str, dict], from_hf) -> dict[str, Source]:
    """distributed key -> (file, stored key, global shape, dtype name), from the headers."""
    out = {}
    for name, header in headers.items():
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype = DTYPES.get(info["dtype"])
            meta = torch.empty(info["shape"], dtype=dtype or torch.uint8, device="meta")
            for dist_key, t in (from_hf(key, meta) if from_hf else [(key, meta)]):
                out[dist_key] = (name, key, tuple(t.shape), info["dtype"])
    return out


def _compare(state: dict[str, torch.Tensor], sources: dict[str, Source], module) -> LoadReport:
    """Keys, shapes and dtype kinds; a stored tie alias (``lm_head.weight``) stands for the key
    it is tied to; keys other pipeline stages load (``elsewhere``) are not unexpected."""
    ties, others = parts.tied_keys(module), elsewhere(module)
    for alias, kept in ties.items():
        if alias in sources and kept not in sources:
            sources[kept] = sources.pop(alias)
    extra = sorted(k for k in sources if k not in state and k not in ties and k not in others)
    mismatched = []
    for key, t in state.items():
        if key not in sources:
            continue
        name, stored, shape, dtype = sources[key]
        if shape != tuple(t.shape) and shape != tuple(local_part(t).shape):
            mismatched.append(f"{key}: checkpoint {shape}, model {tuple(t.shape)}")
        elif _kind(dtype) != _kind(t.dtype):
            mismatched.append(f"{key}: checkpoint dtype {dtype} in {name}, model {t.dtype} (only casts within "
                              "floating-point or integer dtypes are made)")
    return LoadReport(sorted(set(state) - set(sources)), extra, mismatched)


def _check(model, report: LoadReport, strict: bool, manifest: dict | None, what: str) -> LoadReport:
    config = model_config.differences((manifest or {}).get("config"), getattr(model.module, "config", None))
    report = LoadReport(report.missing_keys, report.unexpected_keys, report.mismatched_shapes + config)
    problems = report.problems("model")
    if problems and strict:
        raise ValueError(f"{what} does not fit (strict=True):\n  - " + "\n  - ".join(problems))
    if any("dtype" in m for m in report.mismatched_shapes):  # never loaded, even when not strict
        raise ValueError(f"{what}: " + "; ".join(m for m in report.mismatched_shapes if "dtype" in m))
    return report


def _copy(load: staging.ModelLoad, key: str, tensor: torch.Tensor) -> None:
    """This rank's piece of ``tensor`` (global or already local shape) into ``load``'s ``key``."""
    target = load.live[key]
    piece = shard_of(tensor.to(target.dtype), target) if tuple(tensor.shape) == tuple(target.shape) \
        else tensor.to(target.dtype)
    load.put(key, piece)


def _read_file(files: CheckpointFiles, name: str, header: dict, wanted: dict[str, list[str]],
               load: staging.ModelLoad, from_hf) -> None:
    """Read safetensors file ``name`` front to back (verified), putting the shards of the
    ``wanted`` stored keys (stored key -> distributed keys) into ``load``."""
    with files.reader(name) as reader:
        (n,) = struct.unpack("<Q", bytes(reader.read(8)))
        try:
            same = n <= files.entry(name)["size"] - 8 and json.loads(bytes(reader.read(n))) == header
        except ValueError:
            same = False
        if not same:
            raise CorruptFileError(f"{reader.path}: its header changed while it was being read")
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__" and k in wanted),
                         key=lambda kv: kv[1]["data_offsets"][0])
        for key, info in entries:
            begin, end = info["data_offsets"]
            dtype = DTYPES[info["dtype"]]
            need = math.prod(info["shape"]) * dtype.itemsize  # checked before the memory is taken
            if end - begin != need or 8 + n + end > files.entry(name)["size"]:
                raise CorruptFileError(f"{reader.path}: {key} spans bytes {begin}..{end} of the data, its shape and "
                                       f"dtype need {need}, the file has {files.entry(name)['size'] - 8 - n}")
            tensor = torch.empty(info["shape"], dtype=dtype)
            reader.skip_to(8 + n + begin)
            reader.read_into(host_bytes(tensor))
            items = dict(from_hf(key, tensor) if from_hf else [(key, tensor)])
            for dist_key in wanted[key]:
                _copy(load, dist_key, items.get(dist_key, next(iter(items.values()))))
            del tensor, items
        reader.finish()


def prepare(files: CheckpointFiles, model, strict: bool,
            translate_function: Callable | None = None, policy: Policy | None = None) -> staging.ModelLoad:
    """Check the full checkpoint in ``files`` against ``model`` and read it into staging, or
    through an undo journal where ``policy`` says so (phases every rank agrees on; a failure
    leaves the model as it was)."""
    names = [f for f in files.manifest["weights"] if f.endswith(".safetensors")]
    if translate_function is not None:
        found: dict = {}
        run_phase("full load (weights)", lambda: found.update(whole=_read_whole(files, names)))
        whole = found.pop("whole")
        return staging.agreed("full load (translate)", lambda: stage_whole(
            model, translate_function(whole), strict, None, str(files.directory), files.manifest, policy))
    layout = files.manifest.get("layout") or (layouts.HF if files.manifest["translated"] else layouts.DISTRIBUTED)
    from_hf = layouts.for_load(model.module, layout, files.manifest.get("model_type"))
    state = parts.model_state(model.module)
    found = {}

    def plan():
        headers = {name: _header(files, name) for name in names}
        sources = _sources(headers, from_hf)
        report = _check(model, _compare(state, sources, model.module), strict, files.manifest,
                        str(files.directory))
        found.update(headers=headers, sources=sources)
        return report

    report = run_phase("full load (keys)", plan)[_rank()]
    load = staging.agreed("full load (targets)", lambda: staging.begin(
        report, state, set(state) & set(found["sources"]) - report.mismatched_keys, policy))
    by_file: dict[str, dict[str, list[str]]] = {}
    for key in load.keys:
        name, stored, _, _ = found["sources"][key]
        by_file.setdefault(name, {}).setdefault(stored, []).append(key)

    def read():
        for name, wanted in sorted(by_file.items()):
            _read_file(files, name, found["headers"][name], wanted, load, from_hf)

    load.run("full load (weights)", read)
    return load


def _read_whole(files: CheckpointFiles, names: list[str]) -> dict[str, torch.Tensor]:
    whole: dict[str, torch.Tensor] = {}
    for name in names:
        header = _header(files, name)
        wanted = {k: [k] for k in header if k != "__metadata__"}
        staged = {k: torch.empty(v["shape"], dtype=DTYPES[v["dtype"]]) for k, v in header.items()
                  if k != "__metadata__"}
        _read_file(files, name, header, wanted, staging.ModelLoad(LoadReport([], []), staged, staged), None)
        whole.update(staged)
    return whole


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def stage_whole(model, whole: dict[str, torch.Tensor], strict: bool, from_hf, what: str,
                manifest: dict | None = None, policy: Policy | None = None) -> staging.ModelLoad:
    """Stage a dict of full (or this rank's local) tensors for ``model`` (or, in journal mode,
    write them through the undo journal): keys translated with ``from_hf`` if given, checked
    (keys, shapes, dtype kinds) before anything is copied. No collective: the caller runs it in
    a phase (``staging.agreed``, which undoes it if any rank failed)."""
    state = parts.model_state(model.module)
    sources: dict[str, Source] = {}
    for key, t in whole.items():
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        for dist_key, m in (from_hf(key, meta) if from_hf else [(key, meta)]):
            sources[dist_key] = (what, key, tuple(m.shape), t.dtype)
    report = _check(model, _compare(state, sources, model.module), strict, manifest, what)
    load = staging.begin(report, state, set(state) & set(sources) - report.mismatched_keys, policy)
    try:
        for key in load.keys:
            stored = sources[key][1]
            items = dict(from_hf(stored, whole[stored]) if from_hf else [(stored, whole[stored])])
            _copy(load, key, items.get(key, next(iter(items.values()))))
    except BaseException as e:
        load.restore(e)
        raise
    load.cost = load.journal_cost()
    return load
