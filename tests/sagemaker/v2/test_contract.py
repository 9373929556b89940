"""Which entry points install SageMaker v2's PyTorch patches (modelparallel/sagemaker/v2/contract.py).

Each case runs in a fresh process (the patches are process-wide and other tests install them).
A failure for v1 means a v1 job (``smdistributed.modelparallel.torch``'s ``init``) patches PyTorch's
FSDP1 constructor, its activation-offload wrapper or DCP, which only v2 scripts call themselves
(look for an engine module installing one again, e.g. ``runtime.init``); a failure for v2 means
``torch.sagemaker``'s ``init`` or ``transform`` stopped installing what v2 scripts rely on.
"""

import subprocess
import sys

import pytest

SCRIPT = """
import sys
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper
from modelparallel.sagemaker import hook
hook.install()
if sys.argv[1] == "v1":
    import smdistributed.modelparallel.torch as smp
    smp.init({})
else:
    import torch.sagemaker as smp
    smp.init({})
    if sys.argv[1] == "v2-transform":
        smp.transform(nn.Sequential(nn.Linear(4, 4)))
from modelparallel.compat import dcp_saver_module, fsdp_optim_utils
print(getattr(FullyShardedDataParallel.__init__, "_mp_v2_layout", False),
      getattr(OffloadWrapper.forward, "_mp_offload_wrapper", False),
      getattr(fsdp_optim_utils._gather_state_dict, "_mp_tp_local", False),
      getattr(dcp_saver_module._save_state_dict, "_mp_group_blocks", False))
"""


def _patched(entry: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, entry], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize("entry, expected", [("v1", ["False"] * 4), ("v2", ["True", "True", "False", "False"]),
                                             ("v2-transform", ["True"] * 4)])
def test_v2_patches_only_from_v2_entry_points(entry, expected):
    assert _patched(entry) == expected
