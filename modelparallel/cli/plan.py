"""``modelparallel plan``: the tensor-parallel plan a model directory gets, printed, and written
as a model file on request.

For a ``model_type`` with a file in ``modelparallel/models`` that file's plan is printed (add
``--auto`` to see the automatic one instead); for any other Hugging Face model the automatic
plan is derived in this one process (each column/row pair's split simulated rank by rank on a
two-layer proxy of the model's class) and printed; the ranks verify it again against the
unsharded proxy when a model is wrapped. ``--save FILE`` writes it as a model file to review
and keep in ``modelparallel/models/``. A model it cannot place is refused, naming the module
(exit status 2). Nothing is downloaded and no weight is read: only ``config.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import user_path

HELP = "print the tensor-parallel plan of a model directory (and save it as a model file)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=user_path, help="a Hugging Face model directory (its config.json is read)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    p.add_argument("--save", type=user_path, metavar="FILE", help="write the plan as a model file (a .py to review and "
                   "keep in modelparallel/models/)")
    p.add_argument("--auto", action="store_true", help="derive the automatic plan even if a model file exists")


def _model(directory: Path):
    """The model of ``directory``'s config, built on the meta device (nothing allocated)."""
    import torch
    import transformers
    from transformers import AutoConfig

    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: " + ("not a directory" if directory.exists() else "no such directory"))
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory}: no config.json (expected a Hugging Face model directory)")
    config = AutoConfig.from_pretrained(directory)
    names = getattr(config, "architectures", None) or []
    cls = next((getattr(transformers, n) for n in names if hasattr(transformers, n)), None)
    if cls is None:
        raise ValueError(f"{directory}/config.json: no architecture transformers knows ({names or 'none named'})")
    with torch.device("meta"):
        return cls(config)


PROXY_MAX_BYTES = 2 * 2**30
"""Largest proxy the automatic plan builds here: it is real fp32 weights of two layers at the
model's full widths, so a very wide config would take gigabytes before anything is printed."""


def _check_proxy_size(model) -> None:
    """Refuse, naming the size, a model whose automatic-plan proxy exceeds ``PROXY_MAX_BYTES``
    (measured on the meta device: nothing allocated)."""
    import torch

    from ..tp.auto.proxy import proxy_config

    with torch.device("meta"):
        proxy = type(model)(proxy_config(model.config))
    size = sum(p.numel() for p in proxy.parameters()) * 4
    if size > PROXY_MAX_BYTES:
        hidden = getattr(model.config, "hidden_size", None) or getattr(model.config, "n_embd", "?")
        raise ValueError(f"the automatic plan's proxy of this model (two layers at its full widths, hidden size "
                         f"{hidden}) would hold {size / 2**30:.1f} GiB of fp32 weights, above the "
                         f"{PROXY_MAX_BYTES / 2**30:.0f} GiB this command builds; plan a copy of config.json with "
                         "the same head counts and architecture but narrower layers")


def plan(directory: Path, tp: int, save: Path | None = None, auto: bool = False) -> str:
    """The plan of ``directory``'s model as text (and ``save`` written).

    Raises:
        AutoPlanError: naming the module the automatic plan cannot place.
        ValueError / FileExistsError: an unknown architecture, a degree below 1, an existing ``save``.
    """
    from ..models import architecture_for
    from ..tp.auto.plan import derive
    from ..tp.auto.render import describe, model_file
    from .presets import size_problems

    if tp < 1:
        raise ValueError(f"--tp {tp}: the degree is at least 1")
    if save is not None and (save.exists() or save.is_symlink()):
        what = "is a symlink" if save.is_symlink() else "exists"
        raise FileExistsError(f"{save} {what}; choose a new file")
    model = _model(directory)
    builtin = getattr(architecture_for(model), "spec", None)
    unfit = size_problems(model.config, 1, tp)  # what ``train`` refuses; the automatic plan says its own
    if builtin is not None and not auto and unfit:
        raise ValueError(f"--tp {tp}: {'; '.join(unfit)}")
    if builtin is None or auto:
        _check_proxy_size(model)
    spec = builtin if builtin is not None and not auto else derive(model, tp).spec
    source = f"built in (modelparallel/models/{model.config.model_type}.py)" if spec is builtin else \
        "automatic (no model file; verified again over the ranks when the model is wrapped)"
    if save is not None:
        with open(save, "x", encoding="utf-8") as f:  # never through a link made since the check
            f.write(model_file(model, spec, tp))
    return f"{type(model).__name__}: {source}\n{describe(spec, tp)}"


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..tp.auto.plan import AutoPlanError

    try:
        print(plan(args.model, args.tp, args.save, args.auto))
    except (AutoPlanError, ValueError, FileExistsError, OSError) as e:
        print(f"modelparallel plan: {e}", file=sys.stderr)
        return 2
    if args.save is not None:
        print(f"wrote {args.save}")
    return 0
