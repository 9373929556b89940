"""SageMaker v2's contract for the user's own PyTorch FSDP1 (``FullyShardedDataParallel``) call.

A v2 script wraps its model with FSDP itself after ``init`` and leaves the data-parallel layout
to the library: FSDP must shard over the ranks holding the same tensor-parallel shard (never
across TP ranks), and ``hybrid_shard_degree`` decides how: 0 (the default) or the data-parallel
degree shards over all of them, 1 replicates (``NO_SHARD``), and N in between shards inside
groups of N consecutive data-parallel ranks and replicates across the groups (``HYBRID_SHARD``),
whatever ``sharding_strategy`` the call names (``_HYBRID_SHARD_ZERO2`` is kept). A call naming
``HYBRID_SHARD`` (or ``_HYBRID_SHARD_ZERO2``) under degree 0 or D, as v2 scripts do by default,
gets one shard group over all D ranks: ``FULL_SHARD`` (``SHARD_GRAD_OP``) over the data-parallel
mesh (PyTorch's own reading, groups of one node's ranks, would need a 2-D mesh the TP shards are
not defined on, and on CPU shards over one rank).

``install`` wraps FSDP1's constructor once, with a function giving the running layout (``init``
passes the runtime's: the layout is read from the job at each call, never kept here). The constructor also takes SageMaker's ``post_param_init_fn=`` (``DelayedParamIniter.
get_post_param_init_fn()``): it runs on each unit right after FSDP materialized the unit's meta
modules with ``param_init_fn``, before flattening. The outermost FSDP call is checked and completed before FSDP runs any collective: a
``device_mesh`` or ``process_group`` that is not the data-parallel one raises naming the
expected mesh; none at all means the data-parallel mesh. The FSDP calls auto-wrapping makes for
submodules inherit the outermost call's arguments and pass through unchanged.

Memory while FSDP1 wraps: each unit's tensors are copied into one flat parameter, then this rank's
chunk of it is copied out. Inside a checked call, the unit's original tensors (no longer used:
the module already reads views of the flat parameter) are released before that second copy, and
the freed pages are handed back to the system after each unit (glibc keeps freed heap pages
otherwise), so a rank holds its tensors plus one unit's flat parameter, never two copies of it.
"""

from __future__ import annotations

import contextvars
import ctypes
import ctypes.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from ...compat import FlatParamHandle, fsdp_init_utils, mesh_group_config, unflatten_mesh
from ...expert import fsdp1 as expert_fsdp1
from ...meshes import kept
from . import fsdp1_dtensor_views
from ..wrapping import wrap_once

_MARK = "_mp_v2_layout"
_inside = contextvars.ContextVar("modelparallel_fsdp1_inside", default=False)
_post_init = contextvars.ContextVar("modelparallel_fsdp1_post_param_init", default=None)
_MATERIALIZERS = ("_materialize_with_param_init_fn", "_materialize_meta_module")


@dataclass(frozen=True)
class Layout:
    """What the outermost FSDP1 call must shard over."""

    dp_mesh: DeviceMesh
    tp_size: int
    hybrid_shard_degree: int
    expert_replicas: DeviceMesh | None = None
    """The ranks holding this rank's experts, over which expert-parallel experts are sharded
    (``expert.fsdp1``)."""
    mesh_cache: Any = None
    """The job's ``meshes.MeshCache``: the hybrid meshes made here are made once per process
    and world (each gloo group keeps its threads for the life of the process)."""
    layout: tuple = ()
    """The job's layout (``meshes.layout_key``): the meshes derived from its world mesh are kept
    per layout, since FSDP shards DTensors only over a mesh of their own root."""


def _ranks(mesh: DeviceMesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


def _describe(mesh: DeviceMesh) -> str:
    return f"a {mesh.ndim}-D mesh {mesh.mesh_dim_names} over ranks {mesh.mesh.tolist()}"


def _expected(lay: Layout) -> str:
    return (f"smp.dp_mesh() (the 1-D \"dp\" mesh over ranks {_ranks(lay.dp_mesh)}, the ranks holding this "
            "rank's tensor-parallel shard)")


def _check_mesh(mesh: DeviceMesh, strategy, lay: Layout) -> bool:
    """Whether ``mesh`` is the data-parallel mesh (False: the user's own 2-D hybrid mesh over
    exactly the data-parallel ranks, kept as given); raise for anything else."""
    dp = _ranks(lay.dp_mesh)
    if mesh.ndim == 1 and _ranks(mesh) == dp:
        return True
    hybrid = strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if mesh.ndim == 2 and hybrid and sorted(_ranks(mesh)) == sorted(dp) and lay.tp_size == 1:
        return False
    raise ValueError(f"FullyShardedDataParallel(device_mesh=...) got {_describe(mesh)}; expected {_expected(lay)}")


def _check_group(group, lay: Layout) -> None:
    ranks = dist.get_process_group_ranks(group)
    if ranks != _ranks(lay.dp_mesh):
        raise ValueError(f"FullyShardedDataParallel(process_group=...) got a group over ranks {ranks}; "
                         f"expected the data-parallel group (smp.get_rdp_process_group()) or {_expected(lay)}")


def _hsdp_mesh(lay: Layout) -> DeviceMesh:
    """("replicate", "shard") over the data-parallel ranks, shard groups of consecutive ranks.
    Under TP it is the data-parallel mesh unflattened (so it shares the world mesh with the TP
    shards' "tp" dimension, as FSDP needs to shard a DTensor further), else a mesh of its own."""
    dp, n, kind = _ranks(lay.dp_mesh), lay.hybrid_shard_degree, lay.dp_mesh.device_type
    sizes, names = (len(dp) // n, n), ("replicate", "shard")
    if lay.tp_size > 1:
        return kept(lay.mesh_cache, ("fsdp1 hybrid of the world mesh", lay.layout, n),
                    lambda: unflatten_mesh(lay.dp_mesh, lay.dp_mesh.mesh_dim_names[0], sizes, names))
    return kept(lay.mesh_cache, ("fsdp1 hybrid", kind, tuple(dp), n),
                lambda: DeviceMesh(kind, lay.dp_mesh.mesh.reshape(sizes), mesh_dim_names=names,
                                   backend_override=tuple(mesh_group_config(kind, k) for k in sizes)))


def _expert_mesh(lay: Layout) -> DeviceMesh:
    """The mesh the experts are sharded over (``expert.fsdp1.replica_mesh``), made once."""
    replicas, n, dp = lay.expert_replicas, lay.hybrid_shard_degree, lay.dp_mesh.size()
    return kept(lay.mesh_cache, ("fsdp1 expert replicas", lay.layout, tuple(_ranks(replicas)), n, dp),
                lambda: expert_fsdp1.replica_mesh(replicas, n, dp))


_ONE_SHARD_GROUP = {ShardingStrategy.HYBRID_SHARD: ShardingStrategy.FULL_SHARD,
                    ShardingStrategy._HYBRID_SHARD_ZERO2: ShardingStrategy.SHARD_GRAD_OP}
"""A hybrid strategy whose one shard group spans every data-parallel rank (no replicas)."""


def _shard_over(args: dict, mesh: DeviceMesh, lay: Layout) -> None:
    """FSDP1 shards over ``mesh`` (1-D, or hybrid 2-D ("replicate", "shard")): given as the mesh
    when TP shards are DTensors on it (FSDP1 flattens those only when it has the mesh), else as
    its process group(s), as SageMaker's FSDP1 calls are: FSDP1 then makes its sharded state dicts
    of ShardedTensors over the shard group, which the scripts' optimizer loading expects, and
    accepts ``LOCAL_STATE_DICT`` (refused with a mesh) for their local checkpoints."""
    if lay.tp_size > 1:
        args["device_mesh"], args["process_group"] = mesh, None
    elif mesh.ndim == 1:
        args["device_mesh"], args["process_group"] = None, mesh.get_group()
    else:
        args["device_mesh"], args["process_group"] = None, (mesh.get_group("shard"), mesh.get_group("replicate"))


def _apply_hybrid(args: dict, lay: Layout) -> None:
    n, d = lay.hybrid_shard_degree, lay.dp_mesh.size()
    if n in (0, d):
        full = _ONE_SHARD_GROUP.get(args.get("sharding_strategy"))
        if full is not None:
            args["sharding_strategy"] = full
            _shard_over(args, lay.dp_mesh, lay)
        return
    if n == 1:
        args["sharding_strategy"] = ShardingStrategy.NO_SHARD
        return
    if args.get("sharding_strategy") != ShardingStrategy._HYBRID_SHARD_ZERO2:
        args["sharding_strategy"] = ShardingStrategy.HYBRID_SHARD
    _shard_over(args, _hsdp_mesh(lay), lay)


def complete(args: dict, lay: Layout) -> None:
    """Check the mesh / group arguments of an outermost FSDP1 call against ``lay`` and fill in
    the data-parallel layout (in place).

    Raises:
        ValueError: a ``device_mesh`` or ``process_group`` other than the data-parallel one.
    """
    mesh, group = args.get("device_mesh"), args.get("process_group")
    if mesh is not None:
        if not _check_mesh(mesh, args.get("sharding_strategy"), lay):
            return
    elif isinstance(group, tuple):
        return  # the user's own (shard, replicate) groups for hybrid sharding
    elif group is not None:
        _check_group(group, lay)
        if lay.tp_size > 1:  # FSDP1 flattens TP shards only when given the mesh
            args["device_mesh"], args["process_group"] = lay.dp_mesh, None
    elif lay.tp_size > 1:
        args["device_mesh"] = lay.dp_mesh
    elif lay.dp_mesh.size() != dist.get_world_size():  # pipeline stages: the world holds other stages
        args["process_group"] = lay.dp_mesh.get_group()
    _apply_hybrid(args, lay)


def _libc_trim():
    """glibc's ``malloc_trim`` (returns freed heap pages to the system), or None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_trim = _libc_trim()


def _trim_heap() -> None:
    if _trim is not None:
        _trim(0)


def _owns_storage(t, flat) -> bool:
    """Whether ``t`` is alone in a heap storage of its own (so freeing it loses no other data;
    a memory-mapped checkpoint tensor, or a view into a larger buffer, is left alone)."""
    storage = t.untyped_storage()
    return (storage.resizable() and storage.data_ptr() != flat.untyped_storage().data_ptr()
            and storage.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0)


def _install_release() -> None:
    """Wrap ``FlatParamHandle.shard``: inside a checked call, drop the unit's original tensors
    before this rank's chunk is copied out, trimming the heap before and after that copy."""

    def wrap(shard):
        def releasing_shard(self):
            if _inside.get():
                flat = self.flat_param
                # The flattening copied every original; the module reads views of the flat parameter
                # from now on, so the originals' storage (shared with their DTensor wrappers, which
                # FSDP's caller still lists) is freed in place, as FSDP frees the unsharded flat one.
                for p in flat._params or ():
                    if p is not None and _owns_storage(p, flat):
                        p.untyped_storage().resize_(0)
                _trim_heap()
            out = shard(self)
            if _inside.get():
                _trim_heap()
            return out

        return releasing_shard

    wrap_once(FlatParamHandle, "shard", wrap, _MARK)


def _install_post_init() -> None:
    """Run the call's ``post_param_init_fn`` on each FSDP unit right after its meta modules are
    materialized (before it is flattened, so restored ties are flattened as ties)."""

    def wrap(materialize):
        def then_post_init(module, *args, **kwargs):
            materialize(module, *args, **kwargs)
            post = _post_init.get()
            if post is not None:
                post(module)

        return then_post_init

    for name in _MATERIALIZERS:
        wrap_once(fsdp_init_utils, name, wrap, _MARK)


def _outermost(init, signature, lay: Layout, module, args, kwargs) -> None:
    """The outermost FSDP1 call: checked and laid out, experts set apart and sharded on their own."""
    bound = signature.bind(module, *args, **kwargs)
    complete(bound.arguments, lay)
    dp, replicas = lay.dp_mesh.size(), lay.expert_replicas
    experts = expert_fsdp1.set_apart(bound.arguments, lay.hybrid_shard_degree, dp, dp // replicas.size())
    token = _inside.set(True)
    try:
        init(*bound.args, **bound.kwargs)
    finally:
        _inside.reset(token)
    if experts:
        expert_fsdp1.shard(experts, _expert_mesh(lay), bound.arguments.get("mixed_precision"))


def install(layout_of: Callable[[], Layout | None]) -> None:
    """Wrap ``FullyShardedDataParallel.__init__`` (idempotent): outermost calls are checked
    against ``layout_of()`` (None: no job running, FSDP1 as PyTorch has it)."""
    _install_release()
    _install_post_init()
    fsdp1_dtensor_views.install()

    def wrap(init):
        signature = inspect.signature(init)

        def checked_init(self, *args, post_param_init_fn=None, **kwargs):
            post = _post_init.set(post_param_init_fn) if post_param_init_fn is not None else None
            try:
                lay = None if _inside.get() else layout_of()
                if lay is None:
                    return init(self, *args, **kwargs)
                _outermost(init, signature, lay, self, args, kwargs)
            finally:
                if post is not None:
                    _post_init.reset(post)

        return checked_init

    wrap_once(FullyShardedDataParallel, "__init__", wrap, _MARK)
