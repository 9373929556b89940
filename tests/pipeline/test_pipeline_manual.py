"""Manual pipeline partitions as SageMaker's v1 scripts write them: ``auto_partition`` false,
``smp.set_partition`` on the wrapped model's layers after ``smp.DistributedModel`` (the split
waits until the stages are needed), an optimizer built from the parameters before the split,
``with smp.partition(i):`` around module creation, and the same calls at pipeline degree 1.

A failure means the deferred split (modelparallel/partitioning.py) does not honour marks set
after ``DistributedModel``, the optimizer still holds parameters the split replaced
(``partitioning.remap``), or pipeline/marks.py reads the marks wrongly.
"""

import copy

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import harness
import modelparallel as smp
from test_pipeline_training import assert_stage_grads_match, build, global_batch, my_rows, train_step


def weight_decay_groups(module):
    """SageMaker's example scripts: no weight decay for biases and LayerNorms."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        (no_decay if name.endswith("bias") or ".ln_" in name else decay).append(p)
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def _script(pp):
    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2, "auto_partition": False, "default_partition": 0,
              "random_seed": 1})
    torch.manual_seed(1)
    ref = build("gpt2")
    model = smp.DistributedModel(copy.deepcopy(ref))
    m = model.get_module()
    layers = m.transformer.seq_layers  # SageMaker's name for the blocks, offered before the split
    div, rem = divmod(len(layers), smp.pp_size())  # SageMaker's even assignment, extras to the last stages
    assignments = [p for p in range(smp.pp_size()) for _ in range(div + 1 if p >= smp.pp_size() - rem else div)]
    for i, c in enumerate(layers.children()):
        smp.set_partition(c, assignments[i])
    opt = smp.DistributedOptimizer(torch.optim.AdamW(weight_decay_groups(m), lr=1e-2))
    ids = global_batch(0)
    ref(ids, labels=ids).loss.backward()
    train_step(model, my_rows(ids))
    assert_stage_grads_match(ref, model, ids)
    opt.step()
    held = {id(p) for p in model.module.parameters()}
    in_optimizer = [id(p) for g in opt.param_groups for p in g["params"]]
    assert set(in_optimizer) == held, "the optimizer holds exactly this stage's parameters"
    try:
        mine = list(layers.children())  # this stage's layers (the others left the ModuleList)
        smp.set_partition(mine[0], 1 - smp.pp_rank())
    except ValueError as e:
        late = str(e)
    wrapped_late = None
    try:  # a block wrapped after the split (PyTorch's checkpoint wrapper) is refused the same way
        smp.set_partition(checkpoint_wrapper(mine[0]), 1 - smp.pp_rank())
    except ValueError as e:
        wrapped_late = str(e)
    return model.module._mp_stage.ranges, [len(g["params"]) for g in opt.param_groups], late, wrapped_late


def test_set_partition_after_distributed_model_as_sagemaker_scripts_do():
    out = harness.run(2, _script, 2)
    assert all(r[0] == ((0, 2), (2, 4)) for r in out)
    assert all("the model was already split and this module runs on partition" in r[2] for r in out)
    assert all(r[3] is not None and "the model was already split" in r[3] for r in out), out


def _context():
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False})
    torch.manual_seed(1)
    model = build("gpt2")
    with smp.partition(1):  # the last three layers built in a partition-1 block
        for i in (1, 2, 3):
            model.transformer.h[i] = GPT2Block(model.config, layer_idx=i)
    ref = copy.deepcopy(model)
    model = smp.DistributedModel(model)
    ids = global_batch(0)
    ref(ids, labels=ids).loss.backward()
    train_step(model, my_rows(ids))
    assert_stage_grads_match(ref, model, ids)
    return model.module._mp_stage.ranges


def test_partition_context_places_the_modules_created_inside():
    assert harness.run(2, _context) == [((0, 1), (1, 4))] * 2


def _at_degree_one():
    smp.init({"tensor_parallel_degree": 2, "auto_partition": False, "microbatches": 2, "random_seed": 1})
    torch.manual_seed(1)
    ref = build("gpt2")
    model = smp.DistributedModel(copy.deepcopy(ref))
    for c in model.get_module().transformer.h.children():
        smp.set_partition(c, 0)
    with smp.partition(0):
        pass
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ids = global_batch(0)
    ref(ids, labels=ids).loss.backward()
    train_step(model, my_rows(ids))
    opt.step()
    return model.partitioned


def test_partition_calls_accepted_at_pipeline_degree_one():
    assert harness.run(2, _at_degree_one) == [True, True]
