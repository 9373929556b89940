"""Full checkpoints (``partial=False``): ``path/{tag}/`` is a Hugging Face model directory.

Export streams tensor by tensor: the shards of one tensor are sent to global rank 0 (every rank
of its TP group takes part, for every tensor, in the same order; a tensor of a later pipeline
stage is gathered on that stage and sent on), rank 0 translates it to HF's layout and appends it
to its planned safetensors shard, and the tensor is dropped before the next one. Rank 0 holds
at most one full tensor and one shard beyond its own shards; the others nothing new. A write
error on rank 0 does not stop its receives (the senders would wait forever); it is reported
once every tensor has been sent.

The directory holds ``config.json``, ``model.safetensors`` (or shards and their index) and
``checkpoint_manifest.json``; ``from_pretrained`` loads it as is. A model without a key table
(``smp.nn`` modules, registered modules, other architectures) stores its unsharded module's
state dict in ``full_state_dict*.safetensors`` (and ``config.json`` only if it has an HF config);
``translate_if_full=False`` stores the distributed format there (see ``layouts``). User content
goes to ``path/user_content_{tag}``. Commit rules are those of partial checkpoints.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ... import runtime
from ...tp.layout import block_slices, local_block
from ..background import async_full
from ..format import export_dtype, layouts
from ..format.layouts import Items
from ..load import parts
from ..safety import commit
from ..safety.errors import run_phase
from ..safety.files import CheckpointFiles, read_verified
from .partial import describe
from .shards import ShardWriter, plan_shards

FORMAT = "modelparallel-full"
MAX_SHARD_BYTES = 5 * 2**30
"""Largest safetensors shard written (Hugging Face's long-standing default, 5 GiB)."""
HF_PREFIX, PLAIN_PREFIX = "model", "full_state_dict"


def _plan(entries: list[tuple[str, tuple, torch.dtype, int]], translate: Items | None, prefix: str, max_bytes: int):
    """Shards for the translated entries, from shapes alone (meta tensors: nothing gathered)."""
    items, seen = [], set()
    for key, shape, dtype, _ in entries:
        meta = torch.empty(shape, dtype=dtype, device="meta")
        for out_key, out in (translate(key, meta) if translate else [(key, meta)]):
            if out_key in seen:
                raise ValueError(f"two entries translate to the same key {out_key!r}")
            seen.add(out_key)
            items.append((out_key, tuple(out.shape), out.dtype))
    return plan_shards(items, prefix, max_bytes)


def _gather_to_rank0(t: torch.Tensor, writer_rank: int) -> torch.Tensor | None:
    """The global tensor on global rank ``writer_rank`` (None elsewhere): the other ranks of
    its TP group send their shards one by one, each received straight into its place (for
    dim-0 shards) or through a shard-sized buffer, so the writer holds the tensor plus at most
    one shard and the senders nothing new. Ranks of other TP groups return at once."""
    if not isinstance(t, DTensor):
        return t if dist.get_rank() == writer_rank else None
    mesh, placement = t.device_mesh, t.placements[0]
    group_ranks = mesh.mesh.flatten().tolist()
    me, local = dist.get_rank(), t.to_local()
    if writer_rank not in group_ranks:
        return None
    if all(isinstance(p, Replicate) for p in t.placements):
        return local if me == writer_rank else None
    if not isinstance(placement, Shard) or len(t.placements) != 1:
        full = t.full_tensor()  # anything else (e.g. FSDP x TP): every rank of the mesh gathers
        return full if me == writer_rank else None
    if me != writer_rank:
        dist.send(local.contiguous(), dst=writer_rank, group=mesh.get_group())
        return None
    full = torch.empty(t.shape, dtype=t.dtype, device=local.device)  # NCCL receives into GPU memory
    for index, src in enumerate(group_ranks):
        place = full[block_slices(*local_block(t, [index]))]
        if src == me:
            place.copy_(local)
        elif place.is_contiguous():
            dist.recv(place, src=src, group=mesh.get_group())
        else:
            piece = torch.empty(place.shape, dtype=t.dtype, device=local.device)
            dist.recv(piece, src=src, group=mesh.get_group())
            place.copy_(piece)
    return full


def _entries(state: dict[str, torch.Tensor]) -> list[tuple[str, tuple, torch.dtype, int]]:
    """(key, global shape, dtype, pipeline stage) of the whole model's entries, in stage order: a
    collective of the pipeline group when the model is split (each stage holds its own entries;
    a tied weight two stages hold is listed once, under its first stage)."""
    rt = runtime.current()
    mine = [(k, tuple(t.shape), t.dtype) for k, t in state.items()]
    if rt.config.pipeline_parallel_degree == 1:
        return [(*e, 0) for e in mine]
    stages: list = [None] * rt.config.pipeline_parallel_degree
    dist.all_gather_object(stages, mine, group=rt.group(runtime.PP_GROUP))
    seen, out = set(), []
    for s, entries in enumerate(stages):
        out += [(*e, s) for e in entries if e[0] not in seen and not seen.add(e[0])]
    return out


def _to_writer(t: torch.Tensor | None, shape, dtype, stage: int, leaders: list[int]) -> torch.Tensor | None:
    """The global tensor on global rank 0 (None elsewhere): a later pipeline stage gathers it on
    its rank of rank 0's pipeline group (``leaders``), which sends it to rank 0."""
    if stage == 0:
        return _gather_to_rank0(t, writer_rank=0)
    me = dist.get_rank()
    if me == 0:
        full = torch.empty(shape, dtype=dtype, device=runtime.current().device)
        dist.recv(full, src=leaders[stage])
        return full
    if t is not None:
        full = _gather_to_rank0(t, writer_rank=leaders[stage])
        if me == leaders[stage]:
            dist.send(full.contiguous(), dst=0)
    return None


def stream(state, translate: Items | None, writer: ShardWriter | None,
           entries: list[tuple[str, tuple, torch.dtype, int]] | None = None) -> Exception | None:
    """Bring every tensor to global rank 0 in order (every rank of its TP group takes part, and
    of a later pipeline stage the rank sending it on); rank 0 (``writer``) writes each one and
    drops it before the next. ``entries``: ``_entries(state)``, gathered here if not given."""
    entries = _entries(state) if entries is None else entries
    error = None
    leaders = runtime.members(runtime.current().world_mesh.mesh, runtime.GROUP_DIMS[runtime.PP_GROUP], 0)
    for key, shape, dtype, stage in entries:
        full = _to_writer(state.get(key), shape, dtype, stage, leaders)
        if writer is not None and error is None:
            try:
                for out_key, out in (translate(key, full) if translate else [(key, full)]):
                    writer.write(out_key, out)
            except Exception as e:  # noqa: BLE001 - reported after the last gather
                error = e
        del full
    return error


def _config_copy(model, dtype: torch.dtype | None = None):
    """The HF config to store, naming the class and dtype as ``save_pretrained`` would (None for
    a model without one)."""
    if getattr(model.module, "config", None) is None or not hasattr(model.module.config, "save_pretrained"):
        return None
    config = copy.deepcopy(model.module.config)
    config.architectures = [type(model.module).__name__]
    config.dtype = dtype or next(model.module.parameters()).dtype
    return config


def save(path: Path, tag: str, model, user_content: Any, translate_if_full: bool,
         max_shard_bytes: int | None = None, trust_user_content: bool = False,
         dtype: torch.dtype | None = None, saver=None) -> Path:
    """Write ``path/{tag}/`` and ``path/user_content_{tag}`` (a collective), in ``dtype`` (None:
    the parameters' own; see ``export_dtype``). Rank 0 holds the directory's writer lock
    throughout (see ``commit.DirectoryLock``). With an ``async_save.AsyncSaver``, the tensors
    are gathered to rank 0's memory here (``async_full.Collected``) and written, fsynced and committed by
    its background thread on its own process group."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    layout, translate = layouts.for_save(model.module, translate_if_full)
    prefix = HF_PREFIX if layout == layouts.HF else PLAIN_PREFIX
    state = export_dtype.export_state(model, dtype)
    entries = _entries(state)
    found: dict[str, Any] = {}

    def prepare():
        found["shards"] = _plan(entries, translate, prefix, max_shard_bytes or MAX_SHARD_BYTES)
        if rank != 0:
            return None
        content = path / f"user_content_{tag}"
        if content.is_dir() and not content.is_symlink():
            raise ValueError(f"{content} is a directory; a full checkpoint writes its user content there")
        staged, found["content"] = parts.stage(path, tag, runtime.current().held_locks, user_content, trust_user_content)
        return staged

    staging = path / run_phase("full save (prepare)", prepare)[0]
    about = (_config_copy(model, dtype), describe(model, None))

    def write(items, error):
        writer = ShardWriter(staging, found["shards"], {"modelparallel_format": layout})
        for key, t in items:
            writer.write(key, t)
        _finish(path, staging, tag, about, writer, prefix, found.get("content"), trust_user_content, layout, error)

    try:
        if saver is None:
            writer = ShardWriter(staging, found["shards"], {"modelparallel_format": layout}) if rank == 0 else None
            error = stream(state, translate, writer, entries)
            run_phase("full save (write)", lambda: _finish(path, staging, tag, about, writer, prefix,
                                                          found.get("content"), trust_user_content, layout, error)
                      if rank == 0 else None)
            return path / tag
        collected = async_full.Collected(state) if rank == 0 else None
        error = stream(state, translate, collected, entries)
        run_phase("full save (gather)", lambda: async_full.raise_error(error))
    except Exception:
        if rank == 0:
            commit.clean_leftovers(path)
        raise
    async_full.in_background(saver, tag, path, lambda: write(async_full.drain(collected.items), None) if rank == 0 else None)
    return path / tag


def _finish(path: Path, staging: Path, tag: str, about: tuple, writer: ShardWriter, prefix: str, content: bytes,
            trusted: bool, layout: str, error: Exception | None) -> None:
    """Rank 0: close the shards, write config, user content and manifest, commit, point newest.
    ``about``: (``_config_copy``, ``describe``) of the model, taken at the call."""
    if error is not None:
        raise error
    weights = writer.close(prefix)
    sums = writer.checksums()  # computed while writing (and fsynced): the weights are not re-read
    config, described = about
    if config is not None:
        config.save_pretrained(staging)
    content_name = f"user_content_{tag}"
    content_tmp = path / commit.hidden_name("tmp", commit.new_nonce(), content_name)
    parts.write_bytes(content_tmp, content)
    manifest = {"format": FORMAT, "version": 1, "tag": tag, "translated": layout == layouts.HF, "layout": layout,
                "weights": weights,
                "files": {f: sums[f] if f in sums else commit.file_checksum(staging / f, fsync=True)
                          for f in commit.data_files(staging)},
                "user_content": {"file": content_name, **commit.file_checksum(content_tmp)},
                "user_content_trusted": trusted, "saved_at_ns": commit.saved_at(path), **described}
    commit.write_manifest(staging, manifest)
    commit.commit_dir(staging, path / tag)
    commit.check_committed(path / tag, manifest)
    os.replace(content_tmp, path / content_name)
    commit.fsync_path(path)
    commit.write_newest(path, tag)


def resume(path: Path, files: CheckpointFiles, trusted: bool = False) -> Any:
    """Check the directory's structure and read the user content (which must be
    ``path/user_content_{name}``, verified while read); return it, read without running code
    unless ``trusted``. The weights are verified as ``full_load`` reads them."""
    from ..load.partial_load import verify

    directory, entry = files.directory, files.manifest["user_content"]
    verify(files, ("",))

    def read():
        if entry["file"] != f"user_content_{directory.name}":
            raise ValueError(f"{directory}/{commit.MANIFEST} names user content {entry['file']!r}; "
                             f"a full checkpoint's user content is user_content_{directory.name}")
        data = read_verified(path, entry["file"], entry)
        return parts.read_user_content(data, path / entry["file"], trusted)

    found: dict[str, Any] = {}
    run_phase("full load (user content)", lambda: found.update(content=read()))
    return found["content"]
