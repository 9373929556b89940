"""``modelparallel plan MODEL_DIR --tp N``: prints the plan a model gets and saves it as a model
file the registry accepts; a model it cannot place is refused naming the module (exit 2).

A failure in the printed rules points at modelparallel/tp/auto/ (the derivation); in the saved
file, at modelparallel/tp/auto/render.py (it must define the same SPEC and a TABLE whose
templates match every key of the model).
"""

import importlib.util
import subprocess
import sys

import torch
import transformers as T

from modelparallel.cli import main
from modelparallel.models import _check
from modelparallel.models._translate import from_hf, to_hf
from modelparallel.tp.auto.plan import derive
from modelparallel.tp.walker import collect

CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              vocab_size=101, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)


class _Done:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _plan(*args, capsys=None):
    """Run ``modelparallel plan ARGS``: in this process when ``capsys`` is given, else as a command."""
    argv = ["plan", *map(str, args)]
    if capsys is None:
        return subprocess.run([sys.executable, "-m", "modelparallel.cli", *argv], capture_output=True, text=True)
    code = main(argv)
    out, err = capsys.readouterr()
    return _Done(code, out, err)


def _load(path):
    """The saved file as the registry imports it: a module of ``modelparallel.models``."""
    spec = importlib.util.spec_from_file_location("modelparallel.models._saved_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_prints_and_saves_a_model_file_the_registry_accepts(tmp_path, capsys):
    torch.manual_seed(0)
    model = T.OlmoForCausalLM(T.OlmoConfig(**CONFIG))
    model.save_pretrained(tmp_path / "olmo")
    done = _plan(tmp_path / "olmo", "--tp", 4, "--save", tmp_path / "olmo_plan.py")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "OlmoForCausalLM: automatic" in out and "at TP 4" in out, out
    assert "layers.*.self_attn.o_proj  rowwise" in out and "lm_head                    vocab_colwise" in out, out
    assert "KV heads of layers.*.self_attn (k_proj, v_proj) replicated" in out, out
    saved = _check(_load(tmp_path / "olmo_plan.py"))
    assert saved.SPEC == derive(model, 4).spec
    for tp in (2, 4):  # the file serves other degrees too
        work = collect(model, saved.SPEC, tp)
        assert not work.problems and len(work.assignments) == 2 * 7 + 2, work.problems
    state = model.state_dict()
    assert to_hf(saved.TABLE, from_hf(saved.TABLE, state)).keys() == state.keys()  # every key known
    assert _plan(tmp_path / "olmo", "--save", tmp_path / "olmo_plan.py", capsys=capsys).returncode == 2, \
        "never overwrites"


def test_plan_of_a_built_in_family_says_so_and_refuses_what_it_cannot_place(tmp_path, capsys):
    T.LlamaForCausalLM(T.LlamaConfig(**CONFIG)).save_pretrained(tmp_path / "llama")
    done = _plan(tmp_path / "llama", capsys=capsys)
    assert done.returncode == 0 and "LlamaForCausalLM: built in (modelparallel/models/llama.py)" in done.stdout, done
    T.Olmo2ForCausalLM(T.Olmo2Config(**CONFIG)).save_pretrained(tmp_path / "olmo2")
    done = _plan(tmp_path / "olmo2", capsys=capsys)
    assert done.returncode == 2, done.stdout
    assert "modelparallel plan: model.layers.0.self_attn: no split of" in done.stderr, done.stderr
    done = _plan(tmp_path / "olmo2", "--tp", 3, capsys=capsys)
    assert "Olmo2Config.num_attention_heads = 4 is not divisible by tensor_parallel_degree 3" in done.stderr, done


def test_train_fine_tunes_a_model_without_a_file_through_the_automatic_plan(tmp_path):
    """``modelparallel train --model DIR`` with an architecture that has no model file: the ranks
    derive and verify the automatic plan, read the weights shard by shard and train."""
    import json
    import math
    import os

    from modelparallel.cli.data import ByteTokenizer

    vocab = ByteTokenizer.vocab_size  # the byte tokenizer's: the directory needs no tokenizer files
    T.OlmoForCausalLM(T.OlmoConfig(**{**CONFIG, "vocab_size": vocab, "max_position_embeddings": 64})).save_pretrained(
        tmp_path / "olmo")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "modelparallel.cli", "train", "--model", str(tmp_path / "olmo"), "--tp", "2",
           "--nproc", "2", "--seq-len", "32", "--batch-size", "2", "--max-files", "3", "--eval-windows", "2",
           "--eval-every", "0", "--sample-tokens", "0", "--steps", "2", "--out", str(tmp_path / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    losses = json.loads((tmp_path / "run" / "metrics.json").read_text())["loss"]
    assert len(losses) == 2 and all(abs(loss - math.log(vocab)) < 1.5 for loss in losses), losses
    assert "automatic tensor-parallel plan for OlmoForCausalLM" in done.stdout + done.stderr


def test_plan_refuses_a_missing_directory_a_link_and_a_proxy_too_large(tmp_path, capsys):
    """A missing directory is named as such (not as a Hub repo id); ``--save`` never writes
    through a symlink, even a dangling one; a model whose proxy would take gigabytes is refused
    naming the size, before anything is allocated."""
    import resource

    done = _plan(tmp_path / "nowhere", capsys=capsys)
    assert done.returncode == 2 and done.stderr.strip() == f"modelparallel plan: {tmp_path / 'nowhere'}: no such directory"
    T.OlmoForCausalLM(T.OlmoConfig(**CONFIG)).save_pretrained(tmp_path / "olmo")
    (tmp_path / "link.py").symlink_to(tmp_path / "elsewhere.py")
    done = _plan(tmp_path / "olmo", "--save", tmp_path / "link.py", capsys=capsys)
    assert done.returncode == 2 and "link.py is a symlink" in done.stderr
    assert not (tmp_path / "elsewhere.py").exists()
    T.OlmoConfig(**{**CONFIG, "hidden_size": 32768, "num_attention_heads": 256, "num_key_value_heads": 256,
                    "intermediate_size": 4096}).save_pretrained(tmp_path / "wide")
    (tmp_path / "wide" / "config.json").write_text((tmp_path / "wide" / "config.json").read_text().replace(
        '"model_type"', '"architectures": ["OlmoForCausalLM"], "model_type"'))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    done = _plan(tmp_path / "wide", capsys=capsys)
    assert done.returncode == 2 and "hidden size 32768" in done.stderr and "GiB of fp32 weights" in done.stderr
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2**20  # KiB: under 1 GiB more
