"""``examples/smp_v2_finetune.py`` on 2 CPU ranks (TP=1 x DP=2), and on 4 ranks (TP=2 x DP=2)
stopped after 3 steps and resumed from its DCP checkpoint: its losses and its exported weights
equal 6 AdamW steps of the pretrained HF model in one process on the whole batch.

A wrong loss at step 1 means the rank-0 load / transform / FSDP build is off (see
test_v2_recipes.py); from step 4 on only, the checkpoint does not restore the optimizer or the
weights; an export that ``from_pretrained`` refuses or that differs, the DCP-to-HF export.
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import harness

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS, STOP = 6, 3
# Losses: fp32 sums reordered by the sharding (~10^3 terms: eps 1.2e-7 x 10^3) over 6 AdamW
# steps whose updates are O(lr): 1e-4 relative. Weights: AdamW turns an element whose gradient is
# cancellation noise into a full step of up to ~lr in either direction, so single elements may
# differ by a few 1e-3 x lr; compared per tensor by the norm of the difference, relative to the
# tensor's norm (~1): 1e-3 tolerates a few such elements and catches any wrong layout (O(1)).
LOSS_RTOL, WEIGHT_RTOL = 1e-4, 1e-3


def run_example(argv):
    sys.path.insert(0, str(EXAMPLES))
    import smp_v2_finetune

    return smp_v2_finetune.main(argv)


def reference(model_dir, vocab):
    """Single process, whole batch, same AdamW: losses per step and the final model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = {}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 + step)  # the example's batches, all rows
        ids = torch.randint(0, vocab, (4, 16), generator=g)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[step + 1] = loss.item()
    return losses, model


def check_against_one_process(run_dir, losses):
    exported = AutoModelForCausalLM.from_pretrained(str(run_dir / "export"))
    want, ref = reference(str(run_dir / "pretrained"), exported.config.vocab_size)
    assert sorted(losses) == sorted(want)
    for step, loss in want.items():
        assert abs(losses[step] - loss) <= LOSS_RTOL * abs(loss), (step, losses[step], loss)
    for name, p in ref.named_parameters():
        diff = (exported.get_parameter(name) - p).norm() / p.norm()
        assert diff <= WEIGHT_RTOL, f"{name}: relative difference {diff:.2e}"


def test_v2_example_tp1_dp2_equals_one_process(tmp_path):
    out = tmp_path / "run"
    result = harness.run(2, run_example, ["--out", str(out), "--tp", "1", "--steps", str(STEPS)])[0]
    check_against_one_process(out, result["losses"])


def test_v2_example_stop_resume_export_tp2_dp2(tmp_path):
    """Resume from the DCP checkpoint with TP-sharded optimizer state under FSDP1."""
    out = tmp_path / "run"
    args = ["--out", str(out), "--tp", "2", "--steps", str(STEPS)]
    first = harness.run(4, run_example, args + ["--stop-after", str(STOP)])[0]
    assert first["stopped"] == STOP
    second = harness.run(4, run_example, args)[0]
    assert sorted(second["losses"]) == list(range(STOP + 1, STEPS + 1)), "did not resume at step 4"
    check_against_one_process(out, {**first["losses"], **second["losses"]})
