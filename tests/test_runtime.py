"""The runtime: SageMaker's rank API, mesh layout by placement strategy, groups, object
communication (send/recv_from/broadcast/allgather), smp.state, bad configs.

A failure means modelparallel/runtime.py (or comm.py, state.py) maps ranks to the [rdp, tp] mesh
wrongly, breaks SageMaker's group definitions (TP group inside the DP group, dp_size == world /
pp, rdp = same tp rank, mp = one model copy), or a group getter returns the wrong ranks.
"""

import pytest
import torch
import torch.distributed as dist

import harness
import modelparallel as smp
from modelparallel.config import build_config
from modelparallel.runtime import GROUP_DIMS, mesh_layout, members


def test_mesh_layout_cluster_and_spread():
    """The grid is [pp, dp, cp, tp]; at pipeline and context degree 1 its [dp, tp] face is the layout."""
    assert mesh_layout(build_config({"tensor_parallel_degree": 2}, 4))[0, :, 0].tolist() == [[0, 1], [2, 3]]
    spread = build_config({"tensor_parallel_degree": 2, "placement_strategy": "spread"}, 4)
    assert mesh_layout(spread)[0, :, 0].tolist() == [[0, 2], [1, 3]]
    assert mesh_layout(spread).shape == (1, 2, 1, 2)


def test_groups_of_a_pipeline_layout():
    """SageMaker's groups at pp 2 x tp 2 x rdp 2 under "cluster" (rank = 4 d + 2 p + t): the
    grid arithmetic alone, before pipelining exists to start such a job."""
    cfg = build_config({"tensor_parallel_degree": 2}, 8)
    grid = torch.arange(8).reshape(2, 2, 2).permute(1, 0, 2).unsqueeze(2)  # [pp, dp, cp, tp] from D, P, T
    expected = {smp.TP_GROUP: [0, 1], smp.PP_GROUP: [0, 2], smp.RDP_GROUP: [0, 4],
                smp.DP_GROUP: [0, 1, 4, 5], smp.MP_GROUP: [0, 1, 2, 3], smp.WORLD: list(range(8))}
    for group, ranks in expected.items():
        assert members(grid, GROUP_DIMS[group], 0) == ranks, group
    assert members(grid, GROUP_DIMS[smp.DP_GROUP], 7) == [2, 3, 6, 7]
    assert cfg.dp_degree == 4


def _ranks(strategy):
    smp.init({"tensor_parallel_degree": 2, "placement_strategy": strategy})
    tp_members = [torch.zeros(1) for _ in range(smp.tp_size())]
    dist.all_gather(tp_members, torch.tensor([float(smp.rank())]), group=smp.get_tp_process_group())
    rdp_members = [torch.zeros(1) for _ in range(smp.rdp_size())]
    dist.all_gather(rdp_members, torch.tensor([float(smp.rank())]), group=smp.get_rdp_process_group())
    if smp.tp_rank() == 0:  # SageMaker's broadcast: the sender sends, receivers call recv_from
        smp.broadcast({"from": smp.rank()}, smp.TP_GROUP)
        value = {"from": smp.rank()}
    else:
        value = smp.recv_from(0, smp.RankType.TP_RANK)
    smp.barrier()
    return dict(rank=smp.rank(), size=smp.size(), tp=(smp.tp_rank(), smp.tp_size()),
                dp=(smp.dp_rank(), smp.dp_size()), rdp=(smp.rdp_rank(), smp.rdp_size()),
                mp=(smp.mp_rank(), smp.mp_size()), pp=(smp.pp_rank(), smp.pp_size()),
                local=(smp.local_rank(), smp.local_size()),
                tp_group=[int(t.item()) for t in tp_members], rdp_group=[int(t.item()) for t in rdp_members],
                lists=dict(tp=smp.get_tp_group(), dp=smp.get_dp_group(), rdp=smp.get_rdp_group(),
                           mp=smp.get_mp_group(), pp=smp.get_pp_group(), world=smp.get_world_group()),
                dp_pg=dist.get_world_size(smp.get_dp_process_group()),
                pp_pg=dist.get_world_size(smp.get_pp_process_group()),
                meshes=(smp.tp_mesh().mesh.tolist(), smp.dp_mesh().mesh.tolist()),
                gathered=smp.allgather(smp.rank() * 10, smp.RDP_GROUP), bcast=value["from"],
                state=(smp.state.tp_rank, smp.state.tp_size, smp.state.dp_rank, smp.state.dp_size,
                       smp.state.tensor_parallel_degree, smp.state.hybrid_shard_degree, smp.state.world_size))


@pytest.mark.parametrize("strategy, groups", [pytest.param("cluster", [[0, 1], [2, 3]], marks=pytest.mark.smoke),
                                              ("spread", [[0, 2], [1, 3]])])
def test_rank_api(strategy, groups):
    out = harness.run(4, _ranks, strategy)
    for r, info in enumerate(out):
        group = next(g for g in groups if r in g)
        rdp_group = [g[group.index(r)] for g in groups]
        assert info["rank"] == r and info["size"] == 4
        assert info["tp"] == (group.index(r), 2) and info["mp"] == info["tp"]
        assert info["rdp"] == (groups.index(group), 2)
        assert info["dp"] == (r, 4)  # the TP group is inside the DP group: dp_size == world / pp
        assert info["pp"] == (0, 1) and info["local"] == (r, 4)
        assert info["tp_group"] == group and info["rdp_group"] == rdp_group
        assert info["lists"] == dict(tp=group, dp=[0, 1, 2, 3], rdp=rdp_group, mp=group, pp=[r], world=[0, 1, 2, 3])
        assert info["dp_pg"] == 4 and info["pp_pg"] == 1
        assert info["meshes"] == (group, rdp_group)
        assert info["gathered"] == [q * 10 for q in rdp_group]
        assert info["bcast"] == group[0]
        assert info["state"] == (group.index(r), 2, groups.index(group), 2, 2, 0, 4)


def _send_recv():
    smp.init({})
    if smp.rank() == 0:
        smp.send({"to": 1}, 1, smp.RankType.WORLD_RANK)
        return smp.recv_from(1)
    got = smp.recv_from(0, smp.RankType.DP_RANK)
    smp.send(["reply", got], 0)
    return got


def test_send_and_recv_from():
    assert harness.run(2, _send_recv) == [["reply", {"to": 1}], {"to": 1}]


def _bad_init():
    try:
        smp.init({"tensor_parallel_degree": 3})
    except ValueError as e:
        return str(e)
    return None


def test_bad_config_raises_on_every_rank():
    for msg in harness.run(2, _bad_init):
        assert msg and "world size 2 is not divisible by tensor_parallel_degree 3" in msg


def test_rank_api_needs_init(monkeypatch):
    monkeypatch.setattr("modelparallel.runtime._RUNTIME", None)
    with pytest.raises(RuntimeError, match="call modelparallel.init"):
        smp.tp_rank()


def test_keys_without_effect_logged_once(monkeypatch):
    import logging

    from modelparallel import runtime
    from modelparallel.config import without_effect

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("modelparallel")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    logged = set()  # a fresh process's (the runtime holds it and each init hands it on)
    try:
        cfg = {"optimize": "speed", "skip_tracing": True, "microbatches": 2}
        runtime._log_without_effect(logged, without_effect(cfg))
        runtime._log_without_effect(logged, without_effect(cfg))
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert seen == ["config keys accepted with no effect here: optimize='speed', skip_tracing=True"]
    first = runtime.init({})
    assert runtime.init({}).logged is first.logged, "a new job must not log again what this process logged"


def _restarts():
    """Threads of this process before and after restarting the runtime with layouts it had."""
    import os

    configs = [{"tensor_parallel_degree": 2}, {}, {"tensor_parallel_degree": 2, "expert_parallel_degree": 1}]
    for config in configs:  # every layout built once
        smp.init(config)
    before = len(os.listdir("/proc/self/task"))
    meshes = []
    for _ in range(4):
        for config in configs:
            meshes.append(smp.init(config).world_mesh)
    ok = smp.init({"tensor_parallel_degree": 2}).ranks(smp.TP_GROUP) == [0, 1]
    smp.barrier()
    return before, len(os.listdir("/proc/self/task")), meshes[0] is meshes[3], meshes[0] is meshes[1], ok


def test_restart_reuses_process_groups():
    """``init`` again with a layout this process has built reuses its meshes and groups: every new
    gloo group keeps three threads for the life of the process, so a job (or a test process)
    restarting the runtime would otherwise gain threads at every restart."""
    for before, after, same, other, ok in harness.run(2, _restarts):
        assert after == before, "restarts created process groups"
        assert same and not other and ok


def _gpt2_pipeline():
    from transformers import GPT2Config, GPT2LMHeadModel

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    smp.DistributedModel(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16)))


def _fsdp1_hybrid():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    smp.init({"hybrid_shard_degree": 2})
    FSDP(torch.nn.Linear(8, 8), device_id=torch.device("cpu"))


def _expert_fsdp1_hybrid():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import MixtralConfig, MixtralForCausalLM

    from modelparallel.expert.config import MoEConfig

    smp.init({"expert_parallel_degree": 2, "hybrid_shard_degree": 2})
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
                           max_position_embeddings=16)
    FSDP(smp.transform(MixtralForCausalLM(config), config=MoEConfig()), device_id=torch.device("cpu"))


def _threads_per_round(build, rounds: int) -> list[int]:
    """Threads of this process after each of ``rounds`` runtime restarts that build ``build``'s model."""
    import os

    counts = []
    for _ in range(rounds):
        build()
        smp.barrier()
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


@pytest.mark.parametrize("world, build", [(2, _gpt2_pipeline), (4, _fsdp1_hybrid), (4, _expert_fsdp1_hybrid)],
                         ids=["pipeline-ties", "fsdp1-hybrid", "expert-fsdp1-hybrid"])
def test_rebuilding_models_reuses_their_process_groups(world, build):
    """Restarting the runtime and building the same kind of model again makes no new process
    group: the pipeline's tied-weight pairs, FSDP1's hybrid mesh and the experts' replica mesh
    are kept with the runtime's meshes (each gloo group would keep three threads for good)."""
    for counts in harness.run(world, _threads_per_round, build, 4):
        assert counts[1:] == [counts[1]] * 3, f"threads after each rebuild: {counts}"


def _cp_tp():
    smp.init({"context_parallel_degree": 2, "tensor_parallel_degree": 2})


def _group_timeouts(build) -> dict[str, float]:
    """Collective timeout (s) of every process group of more than one rank that the library made
    for ``build``'s layout and model: the meshes' dimensions, flattened and split dimensions,
    multi-dimension groups, the checkpoint writer's group, FSDP1's hybrid mesh, tied-weight pairs."""
    from torch.distributed.device_mesh import DeviceMesh

    from modelparallel import runtime
    from modelparallel.meshes import Meshes

    build()
    rt = runtime._RUNTIME
    _ = rt.replica_mesh  # the flattened data x context dimension, made on first use

    def of_mesh(mesh):
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        meshes = [mesh] + list(getattr(root, "_flatten_mapping", {}).values())
        return [(f"{m.mesh_dim_names[i]}", m.get_group(i)) for m in meshes for i in range(m.ndim)]

    found = []
    for key, value in rt.mesh_cache.built.items():
        if isinstance(value, Meshes):
            found += of_mesh(value.world) + of_mesh(value.expert)
            found += [(f"groups {dims}", g) for dims, g in value.groups.items()]
        elif isinstance(value, DeviceMesh):
            found += of_mesh(value)
        for g in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(g, dist.ProcessGroup):
                found.append((str(key[0]), g))
    out = {}
    for name, group in found:
        if group is not None and dist.get_world_size(group) > 1:
            out[name] = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    return out


@pytest.mark.parametrize("world, build", [(4, _cp_tp), (2, _gpt2_pipeline), (4, _fsdp1_hybrid),
                                          (4, _expert_fsdp1_hybrid)],
                         ids=["cp-tp", "pipeline-ties", "fsdp1-hybrid", "expert-fsdp1-hybrid"])
def test_every_group_has_the_jobs_timeout(world, build):
    """The job's collective timeout (``harness``: 120 s) holds for every group the library makes,
    not only the default one: PyTorch gives a group made without one its own default (30 minutes
    on gloo), so a rank whose peer hangs in a collective of a mesh dimension would wait that long."""
    for timeouts in harness.run(world, _group_timeouts, build):
        assert len(timeouts) >= 2, timeouts
        assert set(timeouts.values()) == {120.0}, timeouts


def _assigned_state():
    """A value a script assigns to ``smp.state`` holds within the job it was assigned in; the next
    ``init`` answers from its own config again."""
    smp.init({"tensor_parallel_degree": 2})
    smp.state.tensor_parallel_degree = 7
    assigned = smp.state.tensor_parallel_degree
    smp.init({"tensor_parallel_degree": 1})
    return assigned, smp.state.tensor_parallel_degree, smp.state.tp_size


def test_state_accepts_assignments(monkeypatch):
    """v2 scripts set ``state.tensor_parallel_degree`` before ``init`` when they run without the
    library's own implementation; that must neither raise nor outlive the job it was set in."""
    from modelparallel import runtime
    from modelparallel.sagemaker.state import _State

    monkeypatch.setattr(runtime, "_RUNTIME", None)  # before init (another test may have run one here)
    state = _State()
    state.tensor_parallel_degree = 1
    state.expert_parallel_degree = 1
    assert (state.tensor_parallel_degree, state.expert_parallel_degree) == (1, 1)
    with pytest.raises(Exception, match="init"):
        state.context_parallel_degree  # never assigned: answered by the (absent) runtime, as before
    assert harness.run(2, _assigned_state) == [(7, 1, 1)] * 2
