"""The SageMaker import hook (modelparallel/sagemaker/hook.py) and its environment (env.py).

A failure in the alias tests means ``smdistributed.modelparallel.torch[.x]`` or
``torch.sagemaker[.x]`` no longer give this package's own module objects (look at ``ROOTS`` and
``MIRRORED``, ``SageMakerFinder.find_spec`` and ``_Loader.exec_module``); in the not-provided test, that a
missing SageMaker module no longer raises ``ModuleNotFoundError`` naming it; in the
``sagemaker_imports`` test, that leaving the block leaves aliases behind. The env tests check the
SM_* defaults a script's argparse reads and the CPU ``torch.cuda.set_device`` stand-in.
"""

import json
import sys

import pytest
import torch

import modelparallel
from modelparallel.sagemaker import sagemaker_imports
from modelparallel.sagemaker import env, hook


def test_aliases_are_this_package():
    with sagemaker_imports():
        import smdistributed.modelparallel
        import smdistributed.modelparallel.torch as smp
        import torch.sagemaker as tsm
        from smdistributed.modelparallel.torch.nn import FusedLayerNorm
        from smdistributed.modelparallel.torch.nn.huggingface.gptj import translate_state_dict_to_hf_gptj
        from torch.sagemaker.delayed_param import DelayedParamIniter

        import modelparallel.delayed_param
        import modelparallel.sagemaker.nn.huggingface.gptj

        assert smp is modelparallel.sagemaker.v1 and tsm is modelparallel.sagemaker.v2 and torch.sagemaker is tsm
        assert smp.DistributedModel is modelparallel.DistributedModel and tsm.state is modelparallel.state
        assert smp.init is modelparallel.runtime.init, "v1's init is the engine's: no v2 PyTorch patches"
        assert tsm.init is modelparallel.init and tsm.transform is modelparallel.transform
        assert smp.nn is modelparallel.nn is modelparallel.sagemaker.nn
        assert smdistributed.modelparallel.__version__ == modelparallel.__version__
        assert FusedLayerNorm is modelparallel.sagemaker.nn.FusedLayerNorm
        assert translate_state_dict_to_hf_gptj is modelparallel.sagemaker.nn.huggingface.gptj.translate_state_dict_to_hf_gptj
        assert DelayedParamIniter is modelparallel.delayed_param.DelayedParamIniter
        assert sys.modules["smdistributed.modelparallel.torch.nn"] is modelparallel.sagemaker.nn
        assert modelparallel.sagemaker.nn.__spec__.name == "modelparallel.sagemaker.nn", "the real module's spec must stay its own"
        import torch.fx as fx  # torch's own submodules import as before

        assert fx.__name__ == "torch.fx"
        assert sys.modules["torch"]._export.__name__ == "torch._export"  # torch's lazy submodules too


def test_sagemaker_paths_under_modelparallel():
    """``modelparallel`` written for ``torch.sagemaker`` (as the README's v2 examples do) reaches the
    same module objects as ``modelparallel.sagemaker``'s, and ``smp.state`` stays the state object."""
    from modelparallel.grad_norm import clip_grad_norm_
    from modelparallel.moe.moe_config import MoEConfig
    from modelparallel.patches.checkpoint import checkpoint
    import modelparallel.nn.huggingface.gpt2
    import modelparallel.sagemaker.nn.huggingface.gpt2 as gpt2

    assert modelparallel.nn.huggingface.gpt2 is gpt2 and sys.modules["modelparallel.nn.huggingface.gpt2"] is gpt2
    assert MoEConfig is modelparallel.sagemaker.moe.moe_config.MoEConfig is modelparallel.expert.config.MoEConfig
    assert checkpoint is modelparallel.sagemaker.patches.checkpoint.checkpoint
    assert clip_grad_norm_ is modelparallel.clip_grad_norm_
    from modelparallel.nn.huggingface import table_for
    from modelparallel.nn.huggingface.translate import from_hf

    assert from_hf is modelparallel.models._translate.from_hf and table_for is modelparallel.models.table_for
    assert type(modelparallel.state).__name__ == "_State"
    from modelparallel.compat import sagemaker_imports as documented

    assert documented is sagemaker_imports


@pytest.mark.parametrize("name", ["torch.sagemaker.tensor_parallel.no_such_module",
                                  "smdistributed.dataparallel.torch.distributed",
                                  "smdistributed.modelparallel.torch.no_such_module"])
def test_not_provided_named(name):
    with sagemaker_imports():
        with pytest.raises(ModuleNotFoundError, match="not provided|provides") as info:
            __import__(name)
        assert name.startswith(info.value.name)


def test_block_end_removes_every_alias():
    with sagemaker_imports():
        import torch.sagemaker  # noqa: F401
        import smdistributed.modelparallel.torch.nn  # noqa: F401
    assert not [n for n in sys.modules if n.startswith(("smdistributed", "torch.sagemaker"))]
    assert not hasattr(torch, "sagemaker")
    assert not any(isinstance(f, hook.SageMakerFinder) for f in sys.meta_path)
    with pytest.raises(ModuleNotFoundError):
        import torch.sagemaker  # noqa: F401,F811


def test_sm_defaults(tmp_path):
    environ = {env.DIR_ENV: str(tmp_path / "job"), "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "GROUP_RANK": "1",
               "SM_CHANNEL_TRAIN": "/data/train", "SM_CHANNEL_EVAL": "/data/eval"}
    added = env.apply(environ)
    assert "SM_CHANNEL_TRAIN" not in added and environ["SM_CHANNEL_TRAIN"] == "/data/train"
    assert environ["SM_CHANNEL_TEST"] == str(tmp_path / "job" / "input" / "data" / "test")
    assert json.loads(environ["SM_CHANNELS"]) == ["eval", "test", "train"]
    assert environ["SM_MODEL_DIR"] == str(tmp_path / "job" / "model") and (tmp_path / "job" / "model").is_dir()
    assert (tmp_path / "job" / "output" / "data").is_dir()
    assert json.loads(environ["SM_HOSTS"]) == ["algo-1", "algo-2"] and environ["SM_CURRENT_HOST"] == "algo-2"
    if not torch.cuda.is_available():
        assert environ["SM_NUM_GPUS"] == "2"


def test_channel_flag():
    assert env.parse_channel("train=data/x") == ("SM_CHANNEL_TRAIN", str((__import__("pathlib").Path("data/x")).absolute()))
    with pytest.raises(ValueError, match="NAME=DIR"):
        env.parse_channel("train")


def test_cpu_cuda_calls(monkeypatch):
    """Without CUDA, the CUDA calls SageMaker's scripts make around a step do their CPU meaning;
    the returned function puts torch's own back."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    real = torch.cuda.set_device, torch.cuda.synchronize, torch.cuda.nvtx.range_push
    restore = env.cpu_cuda_calls()
    try:
        if torch.cuda.is_available():
            assert (torch.cuda.set_device, torch.cuda.synchronize, torch.cuda.nvtx.range_push) == real, \
                "with CUDA nothing is replaced"
            return
        torch.cuda.set_device(1)
        torch.cuda.set_device(torch.device("cuda", 0))
        with pytest.raises(Exception):
            torch.cuda.set_device(2)  # not a rank of this machine: torch's own error
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.nvtx.range_push("forward") == 0 and torch.cuda.nvtx.range_pop() == 0
        torch.cuda.nvtx.mark("step")
    finally:
        restore()
    assert (torch.cuda.set_device, torch.cuda.synchronize, torch.cuda.nvtx.range_push) == real


def test_device_count_division_names_the_fix():
    def pick_device(rank):
        return rank % torch.cuda.device_count()

    try:
        pick_device(1)
    except ZeroDivisionError as e:
        error = e
    else:
        assert torch.cuda.is_available()
        return
    hint = env.device_count_hint(error)
    assert hint is not None and "rank % torch.cuda.device_count()" in hint and "LOCAL_RANK" in hint
    assert env.device_count_hint(ZeroDivisionError("x")) is None  # not from device_count: no hint


SMDDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from modelparallel.sagemaker import hook, torch_calls
torch_calls.install()
torch_calls.install()  # a second call wraps nothing twice
hook.install()
import smdistributed.dataparallel.torch.torch_smddp  # what SageMaker's scripts import first
dist.init_process_group(backend="smddp", init_method="file://" + sys.argv[1], rank=0, world_size=1)
print(dist.get_backend(), dist.init_process_group.__wrapped__ is dist.distributed_c10d.init_process_group)
"""


def test_smddp_backend_name(tmp_path):
    """SageMaker's data-parallel backend name starts NCCL with CUDA and gloo without, after the
    scripts' ``import smdistributed.dataparallel.torch.torch_smddp``."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", SMDDP_SCRIPT, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["nccl" if torch.cuda.is_available() else "gloo", "True"]
