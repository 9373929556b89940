"""The operations the fault-injection test runs, each as (setup, run, check) on every rank.

``setup(root)`` prepares a trial without faults and returns its context; ``run(ctx)`` is the
operation under injection; ``check(ctx, error)`` (faults off again) returns what is wrong after
it: for a save, the previous newest checkpoint must still load bit for bit and every visible
checkpoint pass its checksums; for a load, a failure must leave model, optimizer state,
hyperparameters and loss scaler exactly as they were, and a success must load exactly what was
saved. Not a test module: imported by test_checkpoint_faults.py and run inside its ranks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import modelparallel as smp
from ckpt_helpers import build, changed, snapshot
from modelparallel import runtime
from modelparallel.checkpoint.safety import commit
from modelparallel.distributed.checkpoint.state_dict_loader import load as v2_load
from modelparallel.distributed.checkpoint.state_dict_saver import save as v2_save


def _tp() -> int:
    """Every trial runs at TP = the number of ranks."""
    import torch.distributed as dist

    return dist.get_world_size()


def _fresh(tp: int, seed: int = 9):
    """A trained model and optimizer of ``seed`` in the series' job (``start``: one ``smp.init``
    per series, since every init makes new process groups whose threads are never freed)."""
    return build(seed=seed, tp=tp, steps=1, init=False)


def start() -> None:
    """The job a series of trials runs in: TP = the number of ranks."""
    smp.init({"tensor_parallel_degree": _tp(), "random_seed": 0})


def _loads_as(path: Path, tag: str | None, want: dict, tp: int, partial: bool = True) -> list[str]:
    """Resume ``tag`` into a fresh model: [] if it equals ``want`` (model part, and optimizer
    part too for a partial checkpoint), else what differs or the error."""
    model, optimizer = _fresh(tp)
    try:
        smp.resume_from_checkpoint(path, tag, partial=partial)
    except Exception as e:  # noqa: BLE001 - reported
        return [f"{tag}: no longer loads: {str(e).splitlines()[0]}"]
    got = snapshot(model, optimizer if partial else None)
    keys = want if partial else {k: v for k, v in want.items() if k.startswith("model/")}
    return [f"{tag}: {k} differs" for k in changed(keys, {k: got.get(k) for k in keys})][:3]


def _visible_intact(path: Path) -> list[str]:
    out = []
    for suffix in ("_partial", ""):
        for _, name in commit.saved_checkpoints(path, suffix) if path.is_dir() else []:
            manifest = commit.read_manifest(path / name)
            out += [p for rel, e in manifest["files"].items() if (p := commit.verify_file(path / name, rel, e))]
    return out


class PartialSave:
    """A partial save (with retention) while checkpoint ``a`` is the newest."""

    def setup(self, root: Path) -> dict:
        model, optimizer = _fresh(_tp(), seed=0)
        smp.save_checkpoint(root, "a", user_content={"step": 1})
        before = snapshot(model, optimizer)
        ids = torch.arange(8).reshape(1, 8) % 64
        model.backward(model(ids, labels=ids).loss)
        optimizer.step()
        return {"root": root, "a": before, "b": snapshot(model, optimizer)}

    def run(self, ctx: dict) -> None:
        smp.save_checkpoint(ctx["root"], "b", user_content={"step": 2}, num_kept_partial_checkpoints=1)

    def check(self, ctx: dict, error: str | None) -> list[str]:
        root, newest = ctx["root"], commit.read_newest(ctx["root"])
        problems = _visible_intact(root)
        if newest not in ("a_partial", "b_partial"):
            return problems + [f"newest names {newest!r}"]
        if error is None and newest != "b_partial":
            problems.append("the save reported success but newest is not b")
        problems += _loads_as(root, newest.removesuffix("_partial"), ctx[newest[0]], _tp())
        if newest == "b_partial" and (root / "a_partial").is_dir():  # retention failed: a still whole
            problems += _loads_as(root, "a", ctx["a"], _tp())
        return problems


class FullSave(PartialSave):
    """A full (Hugging Face directory) save while full checkpoint ``a`` is the newest."""

    def setup(self, root: Path) -> dict:
        model, optimizer = _fresh(_tp(), seed=0)
        smp.save_checkpoint(root, "a", partial=False)
        before = snapshot(model)
        with torch.no_grad():
            model.module.transformer.wpe.weight.add_(1.0)
        return {"root": root, "a": before, "b": snapshot(model)}

    def run(self, ctx: dict) -> None:
        smp.save_checkpoint(ctx["root"], "b", partial=False)

    def check(self, ctx: dict, error: str | None) -> list[str]:
        root, newest = ctx["root"], commit.read_newest(ctx["root"])
        problems = _visible_intact(root)
        if newest not in ("a", "b"):
            return problems + [f"newest names {newest!r}"]
        if error is None and newest != "b":
            problems.append("the save reported success but newest is not b")
        for tag in sorted({"a", newest}):  # the same order on every rank: loads are collectives
            problems += _loads_as(root, tag, ctx[tag], _tp(), partial=False)
        return problems


class PartialResume:
    """``resume_from_checkpoint`` of a partial checkpoint into a trained model."""

    partial = True

    def save(self, root: Path) -> None:
        smp.save_checkpoint(root, "a", user_content={"step": 1}, partial=self.partial)

    def setup(self, root: Path) -> dict:
        model, optimizer = _fresh(_tp(), seed=0)
        self.save(root)
        want = snapshot(model, optimizer)
        model, optimizer = _fresh(_tp(), seed=1)
        return {"root": root, "want": want, "model": model, "optimizer": optimizer,
                "before": snapshot(model, optimizer)}

    def run(self, ctx: dict) -> None:
        smp.resume_from_checkpoint(ctx["root"], "a", partial=self.partial)

    def check(self, ctx: dict, error: str | None) -> list[str]:
        now = snapshot(ctx["model"], ctx["optimizer"])
        if error is not None:
            armed = runtime.current().pending_resume is not None
            return [f"a failed resume changed {k}" for k in changed(ctx["before"], now)][:3] + \
                (["a failed resume left a load pending"] if armed else [])
        want = ctx["want"] if self.partial else {**ctx["before"], **{k: v for k, v in ctx["want"].items()
                                                                    if k.startswith("model/")}}
        return [f"resumed {k} differs from what was saved" for k in changed(want, now)][:3]


class FullResume(PartialResume):
    partial = False


class LegacyLoad:
    """``smp.load`` of the per-rank files ``smp.save(..., partial=True)`` wrote. Not a collective
    (as in SageMaker): a fault fails the load on the rank that met it only."""

    collective = False

    def setup(self, root: Path) -> dict:
        model, _ = _fresh(_tp(), seed=0)
        root.mkdir(parents=True, exist_ok=True)
        state = {k: v.clone() for k, v in model.local_state_dict().items()}
        smp.save({"model": model.local_state_dict(), "step": 3}, str(root / "ck.pt"), partial=True)
        smp.barrier()
        return {"root": root, "want": state}

    def run(self, ctx: dict) -> None:
        ctx["got"] = smp.load(str(ctx["root"] / "ck.pt"))

    def check(self, ctx: dict, error: str | None) -> list[str]:
        if error is not None:
            return []
        got = ctx["got"]["model"]
        return [f"smp.load returned another {k}" for k, v in ctx["want"].items() if not torch.equal(got[k], v)][:3]


class CliResume(PartialResume):
    """The ranks' side of ``modelparallel train --resume``: ``train_job.resume_run``."""

    def save(self, root: Path) -> None:
        smp.save_checkpoint(root / "checkpoints", "step2", user_content={"step": 2, "history": {"loss": [1.0, 0.5]}})

    def run(self, ctx: dict) -> None:
        from modelparallel.cli import train_job

        class Sampler:
            def skip(self, n):
                self.skipped = n

        args = argparse.Namespace(out=ctx["root"], resume_tag="step2", steps=10)
        step, hist = train_job.resume_run(args, Sampler())
        if step != 2 or hist["loss"] != [1.0, 0.5]:
            raise AssertionError(f"resume_run returned step {step}, history {hist}")


def _v2_state(model, step: int) -> dict:
    """What a v2 script saves: the module's state dict (DTensors at TP > 1) and a plain value."""
    return {"model": model.module.state_dict(), "step": step}


def _v2_loads_as(path: Path, want: dict) -> list[str]:
    """Load ``path`` with the v2 call into a fresh model: [] if it equals ``want``."""
    model, _ = _fresh(_tp())
    state = _v2_state(model, -1)
    try:
        v2_load(state, checkpoint_id=str(path))
    except Exception as e:  # noqa: BLE001 - reported
        return [f"{path.name}: no longer loads: {str(e).splitlines()[0]}"]
    got = {**snapshot(model), "step": state["step"]}
    return [f"{path.name}: {k} differs" for k in changed(want, got)][:3]


class V2Save:
    """A v2 ``state_dict_saver.save`` over checkpoint ``ck`` already saved there (from step 1)."""

    def setup(self, root: Path) -> dict:
        model, _ = _fresh(_tp(), seed=0)
        v2_save(_v2_state(model, 1), checkpoint_id=str(root / "ck"))
        before = {**snapshot(model), "step": 1}
        with torch.no_grad():
            model.module.transformer.wpe.weight.add_(1.0)
        return {"root": root, "model": model, "a": before, "b": {**snapshot(model), "step": 2}}

    def run(self, ctx: dict) -> None:
        v2_save(_v2_state(ctx["model"], 2), checkpoint_id=str(ctx["root"] / "ck"))

    def check(self, ctx: dict, error: str | None) -> list[str]:
        path = ctx["root"] / "ck"
        try:
            manifest = commit.read_manifest(path)
            problems = [p for rel, e in manifest["files"].items() if (p := commit.verify_file(path, rel, e))]
        except (OSError, ValueError) as e:
            problems = [f"ck is no longer a checkpoint: {e}"]
        a, b = _v2_loads_as(path, ctx["a"]), _v2_loads_as(path, ctx["b"])
        if error is None and b:
            problems += ["the save reported success but ck does not load as saved"] + b
        elif a and b:
            problems += a
        return problems


class V2Load:
    """A v2 ``state_dict_loader.load`` into a trained model's state dict."""

    def setup(self, root: Path) -> dict:
        model, _ = _fresh(_tp(), seed=0)
        v2_save(_v2_state(model, 3), checkpoint_id=str(root / "ck"))
        want = {**snapshot(model), "step": 3}
        model, _ = _fresh(_tp(), seed=1)
        state = _v2_state(model, 0)
        return {"root": root, "model": model, "state": state, "want": want, "before": {**snapshot(model), "step": 0}}

    def run(self, ctx: dict) -> None:
        v2_load(ctx["state"], checkpoint_id=str(ctx["root"] / "ck"))

    def check(self, ctx: dict, error: str | None) -> list[str]:
        now = {**snapshot(ctx["model"]), "step": ctx["state"]["step"]}
        if error is not None:
            return [f"a failed load changed {k}" for k in changed(ctx["before"], now)][:3]
        return [f"loaded {k} differs from what was saved" for k in changed(ctx["want"], now)][:3]


OPERATIONS = {"partial save": PartialSave(), "full save": FullSave(), "partial resume": PartialResume(),
              "full resume": FullResume(), "smp.load": LegacyLoad(), "train --resume": CliResume(),
              "v2 save": V2Save(), "v2 load": V2Load()}
