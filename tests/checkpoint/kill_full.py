"""The full-checkpoint side of the kill trials (``checkpoint_kill.py --full``): read the newest
full checkpoint's weights without any process group, in the model's own keys.

Not a test module: imported by checkpoint_kill.py's driver.
"""

from __future__ import annotations

from pathlib import Path

import torch


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """``model/{key}`` -> tensor of a full GPT-2 checkpoint directory (Hugging Face layout,
    translated back to the distributed model's keys and shapes)."""
    from safetensors.torch import load_file

    from modelparallel.checkpoint.format import layouts

    back = layouts.translation("gpt2", False)
    got = {}
    for file in sorted(directory.glob("*.safetensors")):
        for key, value in load_file(file).items():
            got.update({f"model/{k}": v for k, v in back(key, value)})
    return got


def model_only(expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a full checkpoint holds of the trial's expected state: the model's entries."""
    return {k: v for k, v in expected.items() if k.startswith("model/")}
