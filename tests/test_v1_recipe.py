"""SageMaker v1 code run with only the import changed: the seed's v1 fine-tuning recipe at TP=2
(``trace_device="gpu"``, ``backward_passes_per_step``, dynamic loss scaling, resume from
``fullmodel.pt``), ``examples/smp_v1_train.py`` on 2 and 4 ranks (train, stop, resume), and
GPT-J's two translate spellings.

A failure in the recipe means one of the v1 entry points it calls (DistributedModel's v1
arguments in model.py, ``@smp.step``, the single-file resume in checkpoint/) changed contract;
its reference is the untouched pretrained HF model.

Kept apart from ``test_v1_scripts.py``, which runs SageMaker's public example scripts' call
shape (their own data, argparse and launcher); these need none of that.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import harness
import modelparallel as smp
from reference import training_rtol

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def seed_recipe(model_dir):
    """The recipe's lines as the seed prints them; only ``args``, ``dtype``, ``model_config`` and
    the optimizer (``...`` on the page) are filled in."""
    args = argparse.Namespace(fine_tune=1, delayed_param=1, model_name=None, model_dir=model_dir,
                              use_distributed_transformer=0, sharded_data_parallel_degree=0, alibi=0,
                              attention_in_fp32=0, residual_addition_in_fp32=0, query_key_layer_scaling=0,
                              bf16=0, fused_softmax=0, fused_dropout=0, fused_bias_gelu=0, flash_attention=0,
                              gradient_accumulation=2)
    smp.init({"tensor_parallel_degree": 2, "microbatches": 2, "sharded_data_parallel_degree": 0, "ddp": True})
    dtype = torch.float32
    model_config = AutoConfig.from_pretrained(model_dir)
    # --- the seed's lines ---
    if args.fine_tune > 0 and args.delayed_param > 0 and smp.rank() == 0:
        pretrained_model = AutoModelForCausalLM.from_pretrained(
            args.model_name or args.model_dir
        )
        model_state_dict = pretrained_model.state_dict()
        path = os.path.join(args.model_dir, "fullmodel.pt")
        torch.save(model_state_dict, path)
    with smp.model_creation(
        tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0,
        zero_init=args.use_distributed_transformer == 0,
        dtype=dtype,
        distribute_embedding=args.sharded_data_parallel_degree > 1 and smp.tp_size() > 1,
        use_alibi=args.alibi > 0,
        attention_in_fp32=args.attention_in_fp32 > 0,
        fp32_residual_addition=args.residual_addition_in_fp32 > 0,
        query_key_layer_scaling=args.query_key_layer_scaling > 0 and args.bf16 < 1,
        fused_softmax=args.fused_softmax > 0,
        fused_dropout=args.fused_dropout > 0,
        fused_bias_gelu=args.fused_bias_gelu > 0,
        flash_attention=args.flash_attention > 0,
    ):
        if args.fine_tune > 0 and args.delayed_param == 0:
            model = AutoModelForCausalLM.from_pretrained(
                args.model_name or args.model_dir
            )
        else:
            model = AutoModelForCausalLM.from_config(model_config)
    model = smp.DistributedModel(
        model, trace_device="gpu", backward_passes_per_step=args.gradient_accumulation
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = smp.DistributedOptimizer(
        optimizer,
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
    )
    if args.fine_tune > 0 and args.delayed_param > 0:
        smp.resume_from_checkpoint(args.model_dir, tag="fullmodel.pt", partial=False)
    # --- a v1 training loop over it ---

    @smp.step
    def train_step(model, ids):
        loss = model(ids, labels=ids).loss
        model.backward(loss)
        return loss

    ids = (torch.arange(32).reshape(4, 8) * 7 + smp.dp_rank()) % model_config.vocab_size
    losses = []
    for _ in range(2):  # backward_passes_per_step=2: one optimizer step after two passes
        losses.append(train_step(model, ids).reduce_mean().item())
    optimizer.step()
    optimizer.zero_grad()
    return losses, model(ids).logits.detach()


def test_seed_v1_finetune_recipe_at_tp2(tmp_path):
    torch.manual_seed(0)
    pretrained = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=16,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    pretrained.save_pretrained(tmp_path)
    out = harness.run(2, seed_recipe, str(tmp_path))
    # first pass: the resumed pretrained weights on the union of both ranks' batches
    union = torch.cat([(torch.arange(32).reshape(4, 8) * 7 + r) % 61 for r in range(2)])
    want = pretrained(union, labels=union).loss.item()
    for losses, _ in out:
        assert abs(losses[0] - want) <= training_rtol(0) * want, (losses[0], want)
        assert losses[1] == losses[0], "no optimizer step between the two accumulated passes"
    after = pretrained(union).logits
    assert not torch.allclose(out[0][1], after[:4], atol=1e-4), "the optimizer step changed the model"


def run_example(argv):
    sys.path.insert(0, str(EXAMPLES))
    import smp_v1_train

    return smp_v1_train.main(argv)


def test_v1_example_trains_and_resumes_on_2_and_4_ranks(tmp_path):
    for world in (2, 4):
        out = str(tmp_path / f"w{world}")
        first = harness.run(world, run_example, ["--out", out, "--steps", "6", "--stop-after", "3"])[0]
        rest = harness.run(world, run_example, ["--out", out, "--steps", "6"])[0]
        assert len(first) == 3 and len(rest) == 3, (first, rest)
        assert rest[-1] < first[0], f"{world} ranks: loss did not fall ({first} then {rest})"


def test_gptj_translate_spellings():
    from modelparallel.sagemaker.nn.huggingface import gptj
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    hf = GPTJForCausalLM(GPTJConfig(n_embd=32, n_layer=1, n_head=4, rotary_dim=4, n_positions=16,
                                    vocab_size=50)).state_dict()
    hf["transformer.h.0.attn.bias"] = torch.ones(1, 1, 16, 16, dtype=torch.bool)  # an old checkpoint's buffer
    one = gptj.translate_hf_gptj_state_dict_to_smdistributed_gptj(dict(hf))
    two = gptj.translate_hf_gptj_state_dict_to_smdistributed(dict(hf), 16)
    base = gptj.translate_hf_state_dict_to_smdistributed_gptj(dict(hf))
    assert "transformer.h.0.attn.bias" not in two
    assert one.keys() == two.keys() == base.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)
