"""Every pipeline rank materializes only its stage: a meta-built model loaded shard by shard from
a Hugging Face checkpoint reads only the stage's tensors and then trains like ``from_pretrained``
in one process; a delayed-initialization build initializes only the stage and keeps a weight
tied across stages identical on both; a model only rank 0 holds is refused at pipeline degree > 1.

A failure in the loading test means shard-on-read (modelparallel/materialize/loading.py) refuses
other stages' keys or misses a tied weight's key on the last stage (pipeline/split.py's
``elsewhere`` / ``saved_names``); a count failure, that a rank allocated another stage's tensors.
"""

import copy

import pytest
import torch
from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from modelparallel.materialize import meta
from reference import as_hf, gathered
from test_pipeline_training import assert_stage_grads_match, build, global_batch, my_rows, train_step


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-ckpt")
    out = {}
    for arch in ("gpt2", "llama"):
        torch.manual_seed(0)
        build(arch).save_pretrained(root / arch, max_shard_size="40KB")  # several files: each read as needed
        out[arch] = str(root / arch)
    return out


CLASSES = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}


def _load(path, arch, pp, tp, **extra):
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2, **extra})
    ref = CLASSES[arch].from_pretrained(path)
    with torch.device("meta"):
        model = CLASSES[arch](copy.deepcopy(ref.config))
    model = smp.DistributedModel(model)
    assert meta.has_meta(model.module), "nothing allocated before the read"
    report = smp.load_hf_checkpoint(model, path)
    assert not report.missing_keys and not report.unexpected_keys, report
    ids = global_batch(0)
    ref.train()
    ref(ids, labels=ids).loss.backward()
    train_step(model, my_rows(ids))
    assert_stage_grads_match(ref, model, ids)
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.module.parameters())
    return held, sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize("arch, world, pp, tp", [("gpt2", 2, 2, 1), ("llama", 4, 2, 2), ("gpt2", 4, 4, 1)])
def test_shard_on_read_loads_only_the_stage(checkpoints, arch, world, pp, tp):
    out = harness.run(world, _load, checkpoints[arch], arch, pp, tp)
    total = out[0][1]
    for held, _ in out:
        # a stage's blocks plus, on the first and last stage, the embeddings or the head
        assert held < 0.75 * total, (held, total)


def test_shard_on_read_with_virtual_stages(checkpoints):
    """Rank 0 holds layers 0 and 2 with the embeddings, rank 1 layers 1 and 3 with the head: each
    reads only those, and trains with HF's gradients."""
    out = harness.run(2, _load, checkpoints["gpt2"], "gpt2", 2, 1, pipeline_virtual_stages=2)
    assert all(held < 0.75 * total for held, total in out), out


def _delayed(pp):
    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2, "delayed_parameter_initialization": True})
    torch.manual_seed(0)
    with smp.delay_param_initialization():
        model = build("gpt2")
    model = smp.DistributedModel(model)
    assert not meta.has_meta(model.module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for step in range(3):
        losses.append(train_step(model, my_rows(global_batch(step))).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    tied = [gathered(p.detach()) for n, p in model.module.named_parameters()
            if n in ("transformer.wte.weight", "lm_head.weight")]
    return losses, tied, sorted(n for n, _ in model.module.named_parameters())


def test_delayed_init_initializes_the_stage_and_keeps_ties():
    out = harness.run(2, _delayed, 2)
    (losses, first_tied, first_names), (_, last_tied, last_names) = out
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert not set(first_names) & set(last_names) - {"transformer.wte.weight", "lm_head.weight"}
    assert torch.equal(first_tied[0], last_tied[0]), "wte (first stage) and lm_head (last stage) start and stay equal"


def _delayed_llama(pp, tp, virtual, tied):
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2,
              "pipeline_virtual_stages": virtual})
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, tie_word_embeddings=tied)
    torch.manual_seed(5)
    eager = LlamaForCausalLM(cfg)
    torch.manual_seed(5)
    with smp.delay_param_initialization():
        model = LlamaForCausalLM(cfg)
    model = smp.DistributedModel(model)
    differ = [n for n, p in model.module.named_parameters()
              if not torch.equal(as_hf(p.detach(), eager.get_parameter(n)), eager.get_parameter(n))]
    return sorted(n for n, _ in model.module.named_parameters()), differ


@pytest.mark.parametrize("world, pp, tp, virtual, tied", [(2, 2, 1, 1, False), (2, 2, 1, 2, True),
                                                          (4, 2, 2, 1, True)])
def test_delayed_llama_at_pipeline_degree_2_equals_eager(world, pp, tp, virtual, tied):
    """Each stage draws where the whole model's eager build draws (the other stages' modules are
    replayed, then dropped): every parameter of every stage equals the eager build's for the seed."""
    out = harness.run(world, _delayed_llama, pp, tp, virtual, tied)
    names = [set(n) for n, _ in out]
    assert names[0] != names[-1] and all(n for n in names), names  # the stages hold different layers
    for rank, (_, differ) in enumerate(out):
        assert not differ, f"rank {rank}: {differ}"


def _rank0_only():
    smp.init({"pipeline_parallel_degree": 2})
    if smp.rank() == 0:
        model = build("gpt2")
    else:
        with torch.device("meta"):
            model = build("gpt2")
    try:
        smp.DistributedModel(model)
    except NotImplementedError as e:
        return str(e)
    return None


def test_rank0_only_model_refused():
    assert all("real on rank 0 only" in e for e in harness.run(2, _rank0_only))
