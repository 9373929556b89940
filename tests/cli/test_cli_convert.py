"""``modelparallel convert``: HF directory -> distributed format -> HF directory, loaded by HF.

A failure means modelparallel/cli/convert.py writes something HF or DistributedModel cannot read.
"""

import os
import stat
import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

from modelparallel.cli.convert import convert


def test_convert_round_trip_loads_without_warnings(tmp_path, capsys):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=101, n_positions=16)).eval()
    model.save_pretrained(tmp_path / "hf")
    umask = os.umask(0o027)  # not the usual 022, so a fixed mode cannot pass by chance
    try:
        _convert_both_ways(tmp_path, model)
    finally:
        os.umask(umask)


def _convert_both_ways(tmp_path, model, umask=0o027):
    cmd = [sys.executable, "-m", "modelparallel.cli", "convert", str(tmp_path / "hf"), str(tmp_path / "dist"),
           "--to", "distributed"]
    subprocess.run(cmd, check=True, capture_output=True)
    from safetensors.torch import load_file
    dist = load_file(tmp_path / "dist" / "model.safetensors")
    assert dist["transformer.h.0.attn.c_attn.weight"].shape == (32, 3, 32)
    convert(tmp_path / "dist", tmp_path / "back", "hf")
    hf_logging.set_verbosity_warning()
    back, info = GPT2LMHeadModel.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.arange(10).reshape(1, 10)
    torch.testing.assert_close(back.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()
    for f in ("dist/model.safetensors", "back/model.safetensors", "back/config.json"):
        assert stat.S_IMODE((tmp_path / f).stat().st_mode) == 0o666 & ~umask, f  # the user's umask
    with pytest.raises(FileExistsError, match="already holds"):
        convert(tmp_path / "dist", tmp_path / "back", "hf")


def test_convert_names_a_damaged_source_file(tmp_path):
    """A truncated weights file fails with its path in the message, before the destination exists."""
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=31, n_positions=8))
    model.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a complete safetensors file"):
        convert(tmp_path / "hf", tmp_path / "dist", "distributed")
    assert not (tmp_path / "dist").exists()


def test_every_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    """Missing source, a file, bad JSON, destination a file, no weights, a partial checkpoint, a
    ``config.json`` that is a FIFO:
    each one line naming the path, exit status 2, nothing written."""
    from modelparallel.cli import main

    GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=31, n_positions=8)).save_pretrained(
        tmp_path / "hf")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "bad_json").mkdir()
    (tmp_path / "bad_json" / "config.json").write_text("{not json")
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "step4_partial").mkdir()
    (tmp_path / "step4_partial" / "checkpoint_manifest.json").write_text("{}")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.json")  # opened blocking, the read would wait for a writer forever
    cases = [(tmp_path / "missing", tmp_path / "d1", "missing: no such directory"),
             (tmp_path / "a_file", tmp_path / "d2", "a_file is a file; the source must be a model directory"),
             (tmp_path / "bad_json", tmp_path / "d3", "bad_json/config.json: not valid JSON"),
             (tmp_path / "hf", tmp_path / "a_file", "a_file is a file; the destination must be a directory"),
             (tmp_path / "no_weights", tmp_path / "d5", "no_weights: no *.safetensors files"),
             (tmp_path / "step4_partial", tmp_path / "d6", "step4_partial is a modelparallel checkpoint without "
                                                           "config.json"),
             (tmp_path / "fifo", tmp_path / "d7", "fifo/config.json: not a regular file (a FIFO)")]
    capsys.readouterr()
    for source, dest, needle in cases:
        assert main(["convert", str(source), str(dest), "--to", "distributed"]) == 2, needle
        out, err = capsys.readouterr()
        assert needle in err and len(err.strip().splitlines()) == 1 and out == "", err
        assert "Traceback" not in err and not (dest.is_dir() and any(dest.iterdir())), err
