"""``smp.state``: one object answering SageMaker v1's and v2's questions about the running job.

v1 scripts read ``smp.state.cfg``, ``smp.state.model``, ``smp.state.optimizer``; v2 scripts read
``state.tp_rank``, ``state.dp_rank``, ``state.tensor_parallel_degree``, ``state.ranker``... Every attribute is read
from the runtime started by ``init`` at the moment it is asked for: most are the rank API's
answer or a config field under another name, listed below as such.

Scripts may also assign attributes (``state.tensor_parallel_degree = 1`` before ``init()``, as v2
scripts do when they run without the library's implementation): an assigned value is answered for
as long as the job it was assigned in lasts (before ``init``, or the runtime it was assigned under),
so a later ``init`` answers from its own config again.

``dp_rank``/``dp_size`` here follow v2, where tensor-parallel ranks share a batch: they count
replicas of one model copy (v1's ``rdp_rank()``/``rdp_size()``). v1's functions ``smp.dp_rank()``
and ``smp.dp_size()`` keep v1's meaning (the TP group inside the data-parallel group).
"""

from __future__ import annotations

from .. import runtime
from ..training.replication import Ranker


def _job():
    """The job an assignment belongs to: the running runtime, or None before ``init``."""
    return runtime.current() if runtime.is_initialized() else None


class _Answer:
    """A state attribute computed at each read by ``compute``, unless the script assigned it in
    the current job (see the module docstring)."""

    def __init__(self, compute, doc: str):
        self.compute, self.__doc__ = compute, doc

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        assigned = obj.__dict__.get(self.name)
        if assigned is not None and assigned[0] is _job():
            return assigned[1]
        return self.compute(obj)

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.name] = (_job(), value)


def _asks(function: str, doc: str | None = None) -> _Answer:
    """An attribute answered by the rank API function ``function`` (looked up at each read)."""
    return _Answer(lambda self: getattr(runtime, function)(), doc or f"``smp.{function}()``")


def _config(name: str, doc: str | None = None) -> _Answer:
    """An attribute answered by the config field ``name``."""
    return _Answer(lambda self: getattr(runtime.current().config, name), doc or f"config ``{name}``")


def _newest(records: str) -> property:
    """The newest object the job created of a kind (``Runtime.models`` / ``optimizers``), or None."""
    def get(self):
        found = getattr(runtime.current(), records)
        return found[-1] if found else None
    return property(get, doc=f"The newest of ``Runtime.{records}``, or None.")


class _State:
    """Attributes of the running job; see the module docstring."""

    initialized = property(lambda self: runtime.is_initialized())
    cfg = config = property(lambda self: runtime.current().config)
    model = _newest("models")
    optimizer = _newest("optimizers")
    device_mesh = property(lambda self: runtime.current().mesh, doc="This rank's [rdp (\"dp\"), tp] DeviceMesh.")

    rank = _asks("rank")
    world_size = size = _asks("size")
    local_rank = _asks("local_rank")
    local_size = _asks("local_size")
    tp_rank = _asks("tp_rank")
    tp_size = _asks("tp_size")
    dp_rank = rdp_rank = _asks("rdp_rank", "v2's data-parallel rank: among the ranks holding the same shard.")
    dp_size = rdp_size = _asks("rdp_size", "v2's data-parallel size: replicas of one model copy.")
    pp_rank = _asks("pp_rank")
    pp_size = _asks("pp_size")
    cp_rank = _asks("cp_rank", "This rank's place among the ranks splitting its sequences (``smp.cp_rank()``).")
    cp_size = _asks("cp_size", "Ranks splitting one sequence (``smp.cp_size()``).")
    ep_rank = _asks("ep_rank", "This rank's place in its expert-parallel group.")
    ep_process_group = _asks("get_ep_process_group", "The expert-parallel group: ranks sharing the experts.")

    world_process_group = _asks("get_world_process_group")
    tp_process_group = _asks("get_tp_process_group")
    dp_process_group = _asks("get_rdp_process_group", "v2's data-parallel group: the ranks holding the same shard.")
    cp_process_group = _asks("get_cp_process_group")

    context_parallel_degree = _config("context_parallel_degree")
    ep_size = expert_parallel_degree = _config("expert_parallel_degree")
    ranker = property(lambda self: Ranker.of(runtime.current()),
                      doc="Replication groups under FSDP (``get_rep_groups()``, ``get_rep_rank(rank)``).")
    tensor_parallel_degree = _config("tensor_parallel_degree")
    hybrid_shard_degree = _config("hybrid_shard_degree")
    sm_activation_offloading = _config("activation_offloading", "activation offloading asked for (v1 or v2 name)")
    activation_loading_horizon = _config("activation_loading_horizon")

    def __repr__(self) -> str:
        if not runtime.is_initialized():
            return "smp.state(not initialized)"
        return (f"smp.state(rank={self.rank}, world_size={self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"dp(v2)={self.dp_rank}/{self.dp_size})")


state = _State()
