"""SageMaker's public v1 example scripts run with only the import changed: their call shape
(``v1_script_shape.py``), on harness ranks inside ``sagemaker_imports()`` and through
``modelparallel run``. (The seed's fine-tuning recipe and ``examples/smp_v1_train.py`` are in
``test_v1_recipe.py``.)

A failure in ``test_scripts_model_lines`` names what the scripts would trip on: the
``seq_layers`` tree (models/_sagemaker.py), the tie per HF config (materialize/hf_init.py), replicated parameters
differing across TP ranks (materialize/tp_sync.py) or ``fp16_groups`` (optimizer.py). A resumed
run whose losses differ from the uninterrupted one points at the same places or at checkpoint/;
a launcher failure at modelparallel/sagemaker/.
"""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, GPTJConfig, GPTJForCausalLM

import harness
import modelparallel as smp
from modelparallel.tp.layout import local_part
from reference import training_rtol


TINY = ["--max_context_width", "16", "--vocab_size", "64", "--hidden_width", "32", "--num_layers", "2",
        "--num_heads", "4", "--dropout", "0", "--lr", "0.01", "--train_batch_size", "4"]


def write_token_rows(train_dir: Path, rows: int = 128) -> None:
    """The data the scripts read: JSON lines of ``input_ids`` / ``attention_mask``, here token
    runs with a fixed stride (learnable, so the loss falls within a few steps)."""
    train_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    with open(train_dir / "part0.json", "w") as f:
        for start in torch.randint(0, 64, (rows,), generator=gen).tolist():
            f.write(json.dumps({"input_ids": [(start + 3 * k) % 64 for k in range(16)], "attention_mask": [1] * 16})
                    + "\n")


@contextlib.contextmanager
def sagemaker_process(sm_dir: str):
    """What ``modelparallel run`` gives a rank, for the duration of a harness call: SageMaker's
    environment, the CUDA calls' CPU meaning, the import hook."""
    from modelparallel.sagemaker import sagemaker_imports
    from modelparallel.sagemaker import env

    saved_env = dict(os.environ)
    os.environ[env.DIR_ENV] = sm_dir
    env.apply()
    restore_cuda = env.cpu_cuda_calls()
    from transformers.modeling_utils import PreTrainedModel

    saved_init = PreTrainedModel.init_weights  # the scripts replace it for the whole process
    try:
        with sagemaker_imports():
            sys.path.insert(0, str(Path(__file__).parent))
            import v1_script_shape

            yield v1_script_shape
    finally:
        PreTrainedModel.init_weights = saved_init
        restore_cuda()
        os.environ.clear()
        os.environ.update(saved_env)


def wrapped_like_the_scripts(sm_dir, model_type):
    """The scripts' lines up to the optimizer, then what a checkpoint and the tree see."""
    with sagemaker_process(sm_dir) as script:
        args = script.parse_args(["--model_type", model_type, "--tensor_parallel_degree", "2", *TINY])
        smp.init({"tensor_parallel_degree": 2, "ddp": True})
        model, _ = script.build_model(args)
        script.set_seed(args.seed + smp.tp_rank())
        model = smp.DistributedModel(model, trace_device="gpu")
        m = model.get_module()
        layers = model.module.module.transformer.seq_layers if model_type == "gptj" else m.transformer.seq_layers
        groups = script.get_param_groups_by_weight_decay(m)
        optimizer = smp.DistributedOptimizer(torch.optim.Adam(groups))
        names = {id(p): n for n, p in m.named_parameters()}
        blocks = list(layers.children())
        return {
            "tree": (layers is m.transformer.h and all(b.attention is b.attn and b.output is b.mlp for b in blocks)
                     and model.module.module.module.transformer is m.transformer),
            "names": sorted(m.state_dict()), "modules": sorted(n for n, _ in m.named_modules()),
            "tied": m.lm_head.weight is m.get_input_embeddings().weight,
            "no_decay": sorted(names[id(p)] for p in groups[1]["params"]),
            "params": len(list(m.parameters())),
            "shapes": {k: tuple(v) for g in script.get_param_shapes(model, optimizer) for k, v in g.items()},
            "replicated": {n: local_part(p).detach().clone() for n, p in m.named_parameters()
                           if not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements)},
        }


@pytest.mark.parametrize("model_type", ["gpt2", "gptj"])
def test_scripts_model_lines(tmp_path, model_type):
    """The tree the scripts walk exists as aliases (no new names), the LM head is tied as the HF
    config says although the scripts skip ``init_weights``, replicated parameters are TP rank 0's
    on every rank although the scripts seed each TP rank differently, the HF layer norms count
    as ``smp.nn.FusedLayerNorm`` (the scripts keep them out of weight decay), and ``fp16_groups``
    names every parameter with its global shape (in the distributed format: GPT-2's fused
    ``c_attn`` keeps its chunk dimension)."""
    r0, r1 = harness.run(2, wrapped_like_the_scripts, str(tmp_path), model_type)
    config_class, model_class = (GPT2Config, GPT2LMHeadModel) if model_type == "gpt2" else (GPTJConfig, GPTJForCausalLM)
    kw = {"rotary_dim": 4} if model_type == "gptj" else {}
    hf = model_class(config_class(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, **kw))
    assert r0["tree"] and r1["tree"]
    assert r0["names"] == sorted(hf.state_dict()), "the aliases must not add state-dict keys"
    assert r0["modules"] == sorted(n for n, _ in hf.named_modules())
    assert r0["tied"] == (model_type == "gpt2") and r0["params"] == len(list(hf.parameters()))
    norms = {f"{path}.{n}" for path, mod in hf.named_modules() if isinstance(mod, torch.nn.LayerNorm)
             for n, _ in mod.named_parameters()}
    assert r0["no_decay"] == sorted(norms | {n for n, _ in hf.named_parameters() if n.endswith(".bias")}), \
        "layer norms (smp.nn.FusedLayerNorm to the scripts) and biases are the scripts' no-decay group"
    from modelparallel.models import table_for
    from modelparallel.models._translate import from_hf

    distributed = from_hf(table_for(model_type), dict(hf.named_parameters()))  # the model's own layout
    assert r0["shapes"] == {n: tuple(p.shape) for n, p in distributed.items()}
    assert r0["replicated"].keys() == r1["replicated"].keys() and r0["replicated"]
    for name, value in r0["replicated"].items():
        assert torch.equal(value, r1["replicated"][name]), f"{name} differs across the TP ranks"


def script_losses(sm_dir, argv):
    with sagemaker_process(sm_dir) as script:
        return script.main(argv)


def test_gptj_script_trains_and_resumes_on_harness_ranks(tmp_path):
    """GPT-J's call shape at TP=2 with per-sublayer activation checkpointing (``c.attention`` /
    ``c.output`` of ``model.module.module.transformer.seq_layers``): the loss falls, and a run
    stopped at step 3 and resumed from its partial checkpoint continues with exactly the losses
    of the uninterrupted run (replicated weights that differed per TP rank would resume into
    another model)."""
    write_token_rows(tmp_path / "input" / "data" / "train")
    argv = ["--model_type", "gptj", "--checkpoint_sublayers", "1", "--tensor_parallel_degree", "2", *TINY,
            "--checkpoint_freq", "3"]
    full = harness.run(2, script_losses, str(tmp_path), [*argv, "--max_steps", "6", "--checkpoint-dir",
                                                          str(tmp_path / "a")])[0]
    first = harness.run(2, script_losses, str(tmp_path), [*argv, "--max_steps", "3", "--checkpoint-dir",
                                                           str(tmp_path / "b")])[0]
    rest = harness.run(2, script_losses, str(tmp_path), [*argv, "--max_steps", "6", "--load_partial", "1",
                                                          "--checkpoint-dir", str(tmp_path / "b")])[0]
    assert full[-1] < full[0], full
    assert first + rest == full, (first, rest, full)


def test_gpt2_script_at_pipeline_degree_2(tmp_path):
    """GPT-2's call shape at pipeline_parallel_degree 2 as SageMaker feeds a pipeline: the first
    stage reads the data and broadcasts the loader's length over PP_GROUP, the second gets a
    dummy dataset of empty tensors. Started from one full checkpoint (``--load_full``: each
    layout draws its own initial weights), the losses equal one process on the same batches
    (pp 2, and pp 2 x tp 2 with prescaled batches: one model copy either way), and a run stopped
    at step 3 and resumed from its partial checkpoint continues with exactly the uninterrupted
    run's losses."""
    write_token_rows(tmp_path / "input" / "data" / "train")
    start = str(tmp_path / "start")
    harness.run(1, script_losses, str(tmp_path), [*TINY, "--max_steps", "0", "--save_final_full_model", "1",
                                                   "--model-dir", start, "--checkpoint-dir", str(tmp_path / "x")])
    argv = [*TINY, "--activation_checkpointing", "0", "--microbatches", "2", "--checkpoint_freq", "3",
            "--load_full", "1", "--model-dir", start]
    one = harness.run(1, script_losses, str(tmp_path), [*argv, "--max_steps", "6",
                                                         "--checkpoint-dir", str(tmp_path / "one")])[0]
    pp = [*argv, "--pipeline_parallel_degree", "2"]
    full = harness.run(2, script_losses, str(tmp_path), [*pp, "--max_steps", "6", "--checkpoint-dir",
                                                          str(tmp_path / "a")])[0]
    tp = harness.run(4, script_losses, str(tmp_path), [*pp, "--tensor_parallel_degree", "2", "--max_steps", "6",
                                                        "--checkpoint-dir", str(tmp_path / "t")])[0]
    for step, (a, b, c) in enumerate(zip(full, tp, one)):
        assert abs(a - c) <= training_rtol(step) * abs(c) and abs(b - c) <= training_rtol(step) * abs(c), \
            (step, a, b, c)
    first = harness.run(2, script_losses, str(tmp_path), [*pp, "--max_steps", "3", "--checkpoint-dir",
                                                           str(tmp_path / "b")])[0]
    at = pp.index("--load_full")
    rest = harness.run(2, script_losses, str(tmp_path), [*pp[:at], *pp[at + 2:], "--max_steps", "6",
                                                          "--load_partial", "1", "--checkpoint-dir", str(tmp_path / "b")])[0]
    assert full[-1] < full[0], full
    assert first + rest == full, (first, rest, full)


def modelparallel_run(cwd: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """``modelparallel run --nproc-per-node 2 tests/v1_script_shape.py ARGV`` as a user types it."""
    cli = Path(sys.executable).parent / "modelparallel"
    cmd = [str(cli), "run", "--nproc-per-node", "2", "--sagemaker-dir", str(cwd / "sm"),
           str(Path(__file__).parent / "v1_script_shape.py"), *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM_")}
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")  # as the harness ranks
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_gpt2_script_via_modelparallel_run(tmp_path):
    """GPT-2's call shape at TP=2 launched by ``modelparallel run``: the SageMaker imports resolve,
    the argparse defaults read the SM_* variables the launcher set, ``torch.cuda.set_device``
    passes on CPU; the loss falls; a run stopped at step 3 resumes (on harness ranks) to exactly
    the losses of an uninterrupted run (same thread count); the final full checkpoint (tag
    ``fullmodel.pt``: SageMaker's single file, HF keys) loads into the HF model, head tied, and
    back with the scripts' ``--load_full``."""
    write_token_rows(tmp_path / "sm" / "input" / "data" / "train")
    argv = ["--tensor_parallel_degree", "2", *TINY, "--checkpoint_freq", "3"]
    full = harness.run(2, script_losses, str(tmp_path / "sm"),
                       [*argv, "--max_steps", "6", "--checkpoint-dir", str(tmp_path / "a")])[0]
    done = modelparallel_run(tmp_path, [*argv, "--max_steps", "3", "--checkpoint-dir", "b", "--save_final_full_model", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads((tmp_path / "sm" / "output" / "data" / "losses_0.json").read_text())
    rest = harness.run(2, script_losses, str(tmp_path / "sm"),  # the resume on harness ranks: one launch is enough
                       [*argv, "--max_steps", "6", "--checkpoint-dir", str(tmp_path / "b"), "--load_partial", "1"])[0]
    assert full[-1] < full[0], full
    if int(os.environ.get("OMP_NUM_THREADS", "1")) == 1:
        assert first + rest == full, (first, rest, full)
    else:  # several threads may split a kernel's sums differently in another process: rounding only
        for step, (got, want) in enumerate(zip(first + rest, full, strict=True)):
            assert abs(got - want) <= training_rtol(step) * abs(want), (step, first, rest, full)
    model_dir = tmp_path / "sm" / "model"  # tag fullmodel.pt: SageMaker's single file, HF keys, head tied
    config = torch.load(model_dir / "user_content_fullmodel.pt", weights_only=True)["model_config"]
    exported = GPT2LMHeadModel(GPT2Config.from_dict(config)).eval()
    report = exported.load_state_dict(torch.load(model_dir / "fullmodel.pt", weights_only=True), strict=False)
    assert report.unexpected_keys == [] and set(report.missing_keys) <= {"lm_head.weight"}, report
    assert exported.lm_head.weight is exported.transformer.wte.weight
    # --load_full reads that export back: its first loss is the export's loss on the first batch
    reloaded = harness.run(2, script_losses, str(tmp_path / "sm"),
                           [*argv, "--max_steps", "1", "--checkpoint-dir", str(tmp_path / "c"), "--load_full", "1"])[0]
    smp.init({})  # the script's data pipeline asks smp for its pipeline stage; alone, this process has no job
    with sagemaker_process(str(tmp_path / "sm")) as script:  # one replica (TP=2, prescaled): all rows
        ids, mask = next(iter(script.create_pretraining_dataloader([str(tmp_path / "sm" / "input" / "data" / "train"
                                                                         / "part0.json")], 4, 12345, 0, 1, True)))
    want = exported(input_ids=ids, attention_mask=mask, labels=ids).loss.item()
    assert abs(reloaded[0] - want) <= training_rtol(0) * want, (reloaded[0], want)
