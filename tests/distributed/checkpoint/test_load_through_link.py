"""Loads through a path the user named with links in it: ``ckpt/latest -> step_100``, a root
linked to a mounted volume. The named path is resolved once, at the start; inside the checkpoint
no link is followed.

Each case saves a tiny model on 2 ranks, links to it, scrambles the model and loads through the
link; the loaded tensors must equal, bit for bit, the model's own values taken before the save.
A failure in a v2 case points at ``state_dict_loader.load`` (``safe_open.resolve_named``); in a
v1 case at ``checkpoint.api.locate`` / ``safety.files.inside``. The refusals (a data file inside
the checkpoint that is a symlink, a v1 tag directory that is one, a save over a link) point at
``safety.safe_open.open_inside``, ``safety.manifest.safe_name``, ``directory.check_replaceable``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import harness
from modelparallel.distributed.checkpoint.state_dict_loader import load
from modelparallel.distributed.checkpoint.state_dict_saver import save


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)  # the same replicated model on every rank
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _scramble(params) -> None:
    with torch.no_grad():
        for p in params:
            p.fill_(-7.0)  # no saved value is -7.0: a load that changes nothing is caught


def _on_rank0(fn) -> None:
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _error_of(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    raise AssertionError("raised nothing")


def _link_inside(step: Path, outside: Path) -> None:
    """``step/__0_0.distcp`` replaced by a symlink to a byte-identical copy (same size and CRC32:
    only the link itself can be refused)."""
    data = step / "__0_0.distcp"
    assert data.stat().st_size > 0, "rank 0's data file holds tensors"
    shutil.copyfile(data, outside)
    data.unlink()
    data.symlink_to(outside)


def v2_through_links(tmp: str) -> dict:
    root = Path(tmp)
    model = _tiny()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save({"model": model.state_dict()}, checkpoint_id=str(root / "vol" / "step_100"))
    _on_rank0(lambda: ((root / "vol" / "latest").symlink_to("step_100"), (root / "mnt").symlink_to(root / "vol")))
    named = {"final": root / "vol" / "latest", "parent": root / "mnt" / "step_100", "both": root / "mnt" / "latest",
             "ranks name it differently": root / "vol" / ("latest" if dist.get_rank() == 0 else "step_100")}
    equal = {}
    for case, path in named.items():
        _scramble(model.parameters())
        load({"model": model.state_dict()}, checkpoint_id=str(path))
        equal[case] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    msgs = {"save over latest": _error_of(save, {"model": model.state_dict()}, checkpoint_id=str(named["final"]))}
    dist.barrier()
    _on_rank0(lambda: _link_inside(root / "vol" / "step_100", root / "vol" / "copy.distcp"))
    _scramble(model.parameters())
    msgs["inside"] = _error_of(load, {"model": model.state_dict()}, checkpoint_id=str(named["final"]))
    unchanged = all(bool((v == -7.0).all()) for v in model.state_dict().values())
    return {"equal": equal, "msgs": msgs, "unchanged": unchanged}


def test_v2_load_follows_the_named_path_once_and_nothing_inside(tmp_path):
    for r in harness.run(2, v2_through_links, str(tmp_path)):
        assert r["equal"] == {"final": True, "parent": True, "both": True, "ranks name it differently": True}, r
        inside = r["msgs"]["inside"]
        assert f"{tmp_path / 'vol' / 'step_100' / '__0_0.distcp'}: a symlink" in inside, inside
        assert "put the file itself there" in inside and "resolved to" in inside and r["unchanged"], r
        save_over = r["msgs"]["save over latest"]
        assert f"{tmp_path / 'vol' / 'latest'} is a symlink (to step_100)" in save_over, save_over
        assert "give the directory itself" in save_over, save_over
    assert (tmp_path / "vol" / "latest").is_symlink(), "the save left the link alone"


def _gpt2() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=8,
                                      bos_token_id=0, eos_token_id=0))


def _local(model) -> dict:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in model.module.state_dict().items()}


def v1_through_links(tmp: str) -> dict:
    import modelparallel as smp

    root = Path(tmp)
    smp.init({"tensor_parallel_degree": 2, "random_seed": 0})
    model = smp.DistributedModel(_gpt2())
    before = _local(model)
    smp.save_checkpoint(root / "vol", "t", model=model)
    full = {k: v.detach().clone() for k, v in _gpt2().state_dict().items()}  # plain tensors for smp.save
    smp.save(full, root / "vol" / "weights.pt", partial=False)
    _on_rank0(lambda: ((root / "link").symlink_to(root / "vol"), (root / "mnt").symlink_to(root),
                       (root / "vol" / "alias_partial").symlink_to("t_partial"),
                       (root / "vol" / "latest.pt").symlink_to("weights.pt")))
    equal = {}
    for case, path, tag in (("final", root / "link", "t"), ("parent", root / "mnt" / "vol", "t"),
                            ("both, by newest", root / "mnt" / "link", None)):
        _scramble(model.parameters())
        smp.resume_from_checkpoint(path, tag=tag, load_optimizer=False)
        after = _local(model)
        equal[case] = all(torch.equal(after[k], before[k]) for k in before)
    loaded = smp.load(root / "mnt" / "link" / "latest.pt", partial=False)
    equal["smp.load"] = loaded.keys() == full.keys() and all(torch.equal(loaded[k], full[k]) for k in full)
    tag_link = _error_of(smp.resume_from_checkpoint, root / "link", tag="alias", load_optimizer=False)
    return {"equal": equal, "tag link": tag_link}


def test_v1_resume_and_smp_load_follow_the_named_path_not_a_tag_link(tmp_path):
    for r in harness.run(2, v1_through_links, str(tmp_path)):
        assert r["equal"] == {"final": True, "parent": True, "both, by newest": True, "smp.load": True}, r
        assert "'alias_partial' is a symlink (to t_partial)" in r["tag link"], r["tag link"]
    assert os.path.islink(tmp_path / "vol" / "alias_partial")
