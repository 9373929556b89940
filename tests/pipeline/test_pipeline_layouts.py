"""Pipeline parallelism composed with context and expert parallelism (``DistributedModel`` and
``@smp.step``), against one Hugging Face process on the same global batch: every gradient of the
first step, then the losses (and, under SGD, the weights) of a few more steps.

Under pipeline x context each stage runs the context-parallel forward pre-hook on the first
stage's inputs (global positions, shifted labels, the loss share), so a gradient mismatch on
the last stage points at the labels the hook sees there (pipeline/inputs.py, context/inputs.py);
a mismatch by a constant factor at the average over the data x context ranks
(``DistributedModel._finish_backward``, the pipeline's ``finish``). Under pipeline x expert each
stage's experts are sharded over the expert-parallel ranks of the same stage: a mismatch of
expert gradients only points at the experts left unsharded or averaged over the wrong ranks
(parallelize.py step 5, ``DistributedModel._replica_groups``). With
``sharded_data_parallel_degree`` each stage is FSDP2-sharded over its own data x context ranks
(experts over their replicas).
"""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import harness
import modelparallel as smp
from modelparallel.expert import is_expert_parameter
from reference import NOISE_FACTOR, _fp32_gradient_noise, as_hf, tolerance, training_rtol
from state_helpers import gathered_state

VOCAB, ROWS, SEQ = 61, 4, 8


def build(arch: str):
    """Two-block models: each of two stages holds one block."""
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                            max_position_embeddings=16))
    # HF's router without its auxiliary loss (a function of every stage's router logits); eager
    # experts and attention, which the fp64 twin measuring the reference's rounding needs
    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
                           max_position_embeddings=16, output_router_logits=False)
    config._attn_implementation = config._experts_implementation = "eager"
    return MixtralForCausalLM(config)


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))


def my_part(ids: torch.Tensor) -> torch.Tensor:
    """This rank's rows (by data-parallel replica; the ranks of a tensor-parallel group share
    theirs: ``prescaled_batch``), and its part of their sequences."""
    return smp.get_batch_for_cp_rank(ids.chunk(smp.rdp_size())[smp.rdp_rank()])


@smp.step
def train_step(model, ids):
    out = model(ids, labels=ids)
    model.backward(out.loss)
    return out.loss


def global_loss(loss: smp.StepOutput) -> float:
    """The global batch's loss: the mean over the data x context ranks of each one's share."""
    shares = smp.allgather(loss.reduce_mean(), smp.DP_GROUP)  # tensor-parallel ranks hold equal shares
    return sum(shares).item() / len(shares)


def assert_grads_match(ref, model, ids) -> dict[str, float]:
    """Every parameter this rank holds has HF's gradient (reordered rounding, plus the fp32
    reference's distance from fp64 for gradients zero in exact arithmetic); returns each
    parameter's tolerance."""
    want = dict(ref.named_parameters(remove_duplicate=False))
    noise = _fp32_gradient_noise(ref, lambda twin: twin(ids, labels=ids).loss)
    shared = {id(p): n for n, p in ref.named_parameters()}
    atols = {}
    for name, p in model.module.named_parameters():
        expected = want[name].grad
        assert p.grad is not None, f"{name}: no gradient"
        atols[name] = tolerance(expected) + NOISE_FACTOR * noise.get(shared[id(want[name])], 0.0)
        torch.testing.assert_close(as_hf(p.grad, expected), expected, rtol=0, atol=atols[name],
                                   msg=lambda m, n=name: f"grad {n}: {m}")
    return atols


def train(arch: str, config: dict, optimizer: str, steps: int):
    """``steps`` steps of ``optimizer`` at ``config`` against HF; returns (losses, HF's losses,
    names of this rank's parameters, names of those sharded over the expert-parallel ranks)."""
    smp.init({"microbatches": 2, "random_seed": 1, "prescaled_batch": True, **config})
    torch.manual_seed(1)
    ref = build(arch)
    module = copy.deepcopy(ref)
    layers = list(module.model.layers) if arch == "mixtral" else []
    model = smp.DistributedModel(module)
    here = {id(b) for b in model.module.model.layers} if layers else set()
    assert not any(isinstance(b.mlp.experts.gate_up_proj, DTensor) for b in layers if id(b) not in here), \
        "the experts of other stages' layers are dropped with them, never sharded"
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1)) if optimizer == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    opt, ref_opt = smp.DistributedOptimizer(make(model.parameters())), make(ref.parameters())
    losses, want = [], []
    for step in range(steps):
        ids = global_batch(step)
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        losses.append(global_loss(train_step(model, my_part(ids))))
        want.append(ref_loss.item())
        atols = assert_grads_match(ref, model, ids) if step == 0 else None
        opt.step()
        ref_opt.step()
        if atols is not None and optimizer == "sgd":
            assert_weights_match(ref, model, atols)
        opt.zero_grad()
        ref_opt.zero_grad()
    names = sorted(n for n, _ in model.module.named_parameters())
    experts = sorted(n for n, p in model.module.named_parameters() if is_expert_parameter(p))
    return losses, want, names, experts


def assert_weights_match(ref, model, grad_atols: dict[str, float]) -> None:
    """After one SGD step: HF's weights, within their own rounding plus lr x the gradient's."""
    want = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.module.named_parameters():
        atol = tolerance(want[name].detach()) + 0.1 * grad_atols[name]
        torch.testing.assert_close(as_hf(p.detach(), want[name]), want[name].detach(), rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"weight {n}: {m}")


CASES = [  # (world, arch, config, optimizer, steps)
    pytest.param(4, "gpt2", {"pipeline_parallel_degree": 2, "context_parallel_degree": 2}, "sgd", 2, id="pp2_cp2_gpt2"),
    pytest.param(4, "llama", {"pipeline_parallel_degree": 2, "context_parallel_degree": 2, "pipeline": "simple"},
                 "adamw", 3, id="pp2_cp2_llama"),
    pytest.param(4, "mixtral", {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2}, "sgd", 2,
                 id="pp2_ep2_mixtral_sgd"),
    pytest.param(4, "mixtral", {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2}, "adamw", 3,
                 id="pp2_ep2_mixtral_adamw"),
    pytest.param(4, "llama", {"pipeline_parallel_degree": 2, "context_parallel_degree": 2,
                              "sharded_data_parallel_degree": 2}, "adamw", 2, id="pp2_cp2_fsdp2_llama"),
    pytest.param(4, "mixtral", {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2,
                                "sharded_data_parallel_degree": 2}, "adamw", 2, id="pp2_ep2_fsdp2_mixtral"),
    pytest.param(8, "llama", {"pipeline_parallel_degree": 2, "context_parallel_degree": 2,
                              "tensor_parallel_degree": 2}, "adamw", 2, id="pp2_cp2_tp2_llama"),
    pytest.param(8, "mixtral", {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2,
                                "context_parallel_degree": 2}, "adamw", 2, id="pp2_ep2_cp2_mixtral"),
]


@pytest.mark.parametrize("world, arch, config, optimizer, steps", CASES)
def test_trains_like_one_process(world, arch, config, optimizer, steps):
    out = harness.run(world, train, arch, config, optimizer, steps)
    for step, (loss, want) in enumerate(zip(*out[0][:2])):
        assert abs(loss - want) <= training_rtol(step) * abs(want), (step, loss, want)
    held = {n for _, _, names, _ in out for n in names}
    assert held == {n for n, _ in build(arch).named_parameters(remove_duplicate=False)}, "every parameter on some stage"
    assert all(len(names) < len(held) for _, _, names, _ in out), "a stage holds the whole model"
    if config.get("expert_parallel_degree", 1) > 1:
        assert all(experts for _, _, _, experts in out), "every stage's experts sharded over the ep ranks"


def refuses_the_auxiliary_loss():
    smp.init({"pipeline_parallel_degree": 2})
    model = build("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(NotImplementedError, match="output_router_logits True"):
        smp.DistributedModel(model)
    return True


def test_auxiliary_loss_across_stages_refused():
    """HF's load-balancing loss is one function of every layer's router logits: the last stage
    alone cannot compute it, so a model that asks for it is refused before anything runs."""
    assert harness.run(2, refuses_the_auxiliary_loss) == [True, True]


SAME = {"tp": "DPC", "pp": "DCT", "cp": "DPT", "rdp": "PCT", "dp": "P", "mp": "DC", "dp_cp": "PT"}
"""Each group: the coordinates its members share (SageMaker's definitions; ``dp_cp`` is what
``smp.dp_mesh()`` spans: the ranks holding the same parameters)."""


def coordinates(order: str, sizes: dict[str, int]) -> dict[int, dict[str, int]]:
    """Global rank -> its coordinates: ranks count through ``order``, the last letter fastest."""
    return {rank: dict(zip(order, c)) for rank, c in
            enumerate(itertools.product(*(range(sizes[letter]) for letter in order)))}


def live_groups(config: dict):
    smp.init(config)
    got = {}
    for name in SAME:
        if name == "dp_cp":
            got[name] = (smp.dp_mesh().mesh.tolist(), smp.dp_mesh().get_local_rank(), smp.dp_mesh().size(), None)
            continue
        members = getattr(smp, f"get_{name}_group")()
        rank, size = getattr(smp, f"{name}_rank")(), getattr(smp, f"{name}_size")()
        total = torch.tensor([float(smp.rank())])
        dist.all_reduce(total, group=getattr(smp, f"get_{name}_process_group")())  # it connects the members
        got[name] = (members, rank, size, int(total.item()))
    ep = torch.tensor([float(smp.rank())])
    dist.all_reduce(ep, group=smp.state.ep_process_group)
    got["ep"] = (smp.state.ep_rank, smp.state.ep_size, int(ep.item()))
    got["state"] = (smp.state.cp_rank, smp.state.cp_size, smp.state.pp_rank, smp.cp_mesh().mesh.tolist())
    return got


@pytest.mark.parametrize("placement", ["cluster", "spread"])
@pytest.mark.parametrize("other", ["context_parallel_degree", "expert_parallel_degree"])
def test_rank_queries_at_pp2_with_cp2_or_ep2(placement, other):
    """``smp.cp_rank()``, ``smp.pp_rank()``, every group and ``smp.dp_mesh()`` at pp 2 x cp 2 and
    pp 2 x ep 2, against each rank's coordinates (context ranks sit just inside "P", outside "T";
    the expert-parallel ranks are the data-parallel ones here, ep = dp = 2)."""
    world = 4
    sizes = {"P": 2, "C": 2 if other == "context_parallel_degree" else 1, "T": 1}
    sizes["D"] = world // (sizes["P"] * sizes["C"])
    order = {"cluster": "DPCT", "spread": "CTPD"}[placement]
    coords = coordinates(order, sizes)
    out = harness.run(world, live_groups, {"pipeline_parallel_degree": 2, other: 2, "placement_strategy": placement})
    for rank, got in enumerate(out):
        for name, shared in SAME.items():
            want = sorted(r for r, c in coords.items() if all(c[k] == coords[rank][k] for k in shared))
            members, index, size, total = got[name]
            assert members == want, (name, rank, members, want)
            assert (index, size) == (want.index(rank), len(want)) and total in (None, sum(want)), (name, rank)
        cp_group = got["cp"][0]
        assert got["state"] == (coords[rank]["C"], sizes["C"], coords[rank]["P"], cp_group), (rank, got["state"])
        if other == "expert_parallel_degree":  # ep = dp: the expert group is the replicas of this stage
            assert got["ep"] == (coords[rank]["D"], 2, sum(got["rdp"][0])), (rank, got["ep"])


def job(arch: str, layout: dict, seed: int):
    """A model and AdamW at ``layout`` (short names: pp, cp, ep, tp), one microbatch per stage."""
    keys = {"pp": "pipeline_parallel_degree", "cp": "context_parallel_degree", "ep": "expert_parallel_degree",
            "tp": "tensor_parallel_degree"}
    smp.init({"random_seed": seed, "prescaled_batch": True, "microbatches": layout.get("pp", 1),
              **{keys[k]: v for k, v in layout.items()}})
    torch.manual_seed(seed)
    model = smp.DistributedModel(build(arch))
    return model, smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))


def steps(model, opt, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        losses.append(global_loss(train_step(model, my_part(global_batch(step)))))
        opt.step()
        opt.zero_grad()
    return losses


def save_and_go_on(arch: str, layout: dict, path: str):
    """Two steps, a partial checkpoint, two more steps: (this stage's state as saved, the losses after)."""
    model, opt = job(arch, layout, seed=0)
    steps(model, opt, 0, 2)
    smp.save_checkpoint(path, tag="step2", user_content={"step": 2})
    saved = gathered_state(model, opt)
    return saved, steps(model, opt, 2, 2)


def resume(arch: str, layout: dict, path: str):
    """Another seed's model, resumed from the checkpoint, then the same two steps."""
    model, opt = job(arch, layout, seed=7)
    fresh = gathered_state(model, opt)
    content = smp.resume_from_checkpoint(path, tag="step2")
    return fresh, gathered_state(model, opt), content, steps(model, opt, 2, 2)


def merged(states: list[dict]) -> dict:
    """Every rank's (stage's) tensors by name; ranks holding one name hold it equally."""
    out = {}
    for state in states:
        for key, value in state.items():
            assert key not in out or torch.equal(out[key], value), f"{key}: two ranks disagree"
            out[key] = value
    return out


@pytest.mark.parametrize("arch, save_at, resume_at", [
    ("llama", {"pp": 2, "cp": 2}, {"cp": 2, "tp": 2}),
    ("llama", {"pp": 2, "tp": 2}, {"pp": 2, "cp": 2}),
    ("mixtral", {"pp": 2, "ep": 2}, {"ep": 2, "tp": 2}),
    ("mixtral", {"ep": 4}, {"pp": 2, "ep": 2}),
], ids=["pp2_cp2-to-cp2_tp2", "pp2_tp2-to-pp2_cp2", "pp2_ep2-to-ep2_tp2", "ep4-to-pp2_ep2"])
def test_checkpoint_resumes_at_another_layout(tmp_path, arch, save_at, resume_at):
    """A partial checkpoint saved at one layout resumes at another with every weight and AdamW
    slot bit-equal, and trains on as the saving job did (within the rounding of two layouts)."""
    first = harness.run(4, save_and_go_on, arch, save_at, str(tmp_path))
    second = harness.run(4, resume, arch, resume_at, str(tmp_path))
    saved, loaded, fresh = (merged([r[0] for r in first]), merged([r[1] for r in second]),
                            merged([r[0] for r in second]))
    assert sorted(loaded) == sorted(saved), sorted(set(loaded) ^ set(saved))
    assert any(not torch.equal(fresh[k], v) for k, v in saved.items()), "the fresh model already equal"
    for key, want in saved.items():
        assert torch.equal(loaded[key], want), f"{key}: not bit-equal after resuming at {resume_at}"
    assert all(r[2] == {"step": 2} for r in second)
    for step, (got, want) in enumerate(zip(second[0][3], first[0][1])):
        assert abs(got - want) <= training_rtol(step + 2) * abs(want), (step, got, want)
