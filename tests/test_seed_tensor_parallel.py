"""The tensor-parallelism page's own code, line for line, with only the import changed.

The page wraps a GPT-2 built under ``smp.tensor_parallelism()``, exports its state dict on the
ranks with ``rdp_rank() == 0`` (one whole tensor-parallel group: ``state_dict()`` is a collective
of that group only) and loads it into the original Hugging Face model; and it translates a
pretrained RoBERTa's state dict for ``DistributedModel.load_state_dict``. A failure means a line a
SageMaker user copies from that page no longer runs or no longer does what the page says: look at
the rank API (modelparallel/runtime.py), ``DistributedModel.state_dict`` or the key tables.
"""

import copy

import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, GPT2Config, RobertaConfig

import harness
import modelparallel as smp
from reference import assert_close

IDS = torch.tensor([[5, 17, 42, 99, 3, 64, 23, 8]])


def gpt2_export_on_rdp_rank0():
    smp.init({"tensor_parallel_degree": 2})
    hf_gpt2_config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1001, n_positions=32,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    # --- the page's code (only the import changed) ---
    from transformers import AutoModelForCausalLM
    with smp.tensor_parallelism():
        model = AutoModelForCausalLM.from_config(hf_gpt2_config)
    original = copy.deepcopy(model)  # kept to compare with: the page's "original HF model"
    model = smp.DistributedModel(model)
    dist_model = model

    from modelparallel.sagemaker.nn.huggingface.gpt2 \
        import translate_state_dict_to_hf_gpt2
    max_seq_len = 1024
    # [... code block for training ...]
    exported = None
    if smp.rdp_rank() == 0:
        state_dict = dist_model.state_dict()
        hf_state_dict = translate_state_dict_to_hf_gpt2(state_dict, max_seq_len)
        # can now call model.load_state_dict(hf_state_dict) to the original HF model
        fresh = AutoModelForCausalLM.from_config(hf_gpt2_config)
        fresh.load_state_dict(hf_state_dict)  # strict, as the page's comment does
        assert_close(fresh(IDS).logits, original(IDS).logits, what="exported GPT-2 logits")
        exported = smp.tp_rank()
    return smp.rdp_rank(), exported


def test_gpt2_translate_on_rdp_rank0_at_tp2_dp2():
    out = harness.run(4, gpt2_export_on_rdp_rank0)
    assert [e for r, e in out if r == 0] == [0, 1], f"one whole TP group must export: {out}"
    assert all(e is None for r, e in out if r != 0), out


def roberta_pretrained_into_distributed(tmp):
    smp.init({"tensor_parallel_degree": 2})
    roberta_config = RobertaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                   vocab_size=1001, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if smp.rank() == 0:  # stands in for the hub's "roberta-large": a local pretrained directory
        torch.manual_seed(1)
        AutoModelForMaskedLM.from_config(roberta_config).save_pretrained(tmp)
    smp.barrier()
    # --- the page's code (only the import changed; a local directory instead of the hub) ---
    from modelparallel.sagemaker.nn.huggingface.roberta \
        import translate_state_dict_to_smdistributed
    model = AutoModelForMaskedLM.from_config(roberta_config)
    model = smp.DistributedModel(model)
    pretrained_model = AutoModelForMaskedLM.from_pretrained(tmp)
    translated_state_dict = translate_state_dict_to_smdistributed(pretrained_model.state_dict())
    # load the translated pretrained weights into the smp.DistributedModel
    model.load_state_dict(translated_state_dict)
    # start fine-tuning...
    assert_close(model(IDS).logits, pretrained_model(IDS).logits, what="RoBERTa logits after the load")


def test_roberta_translate_to_distributed_at_tp2(tmp_path):
    harness.run(2, roberta_pretrained_into_distributed, str(tmp_path))
