"""What starting the ``modelparallel`` command costs: its launcher imports none of the engine.

Every ``modelparallel train`` / ``run`` is a launcher process that parses arguments, checks them
and starts the ranks; importing transformers and the engine there (seconds) delays every launch.
A failure in the first test names what got imported: a module-level ``import torch`` (or of an
engine module) crept into ``modelparallel/cli/`` or ``sagemaker/launch.py``, or
``modelparallel/__init__.py`` imports a name eagerly again. A failure in the second means
``import modelparallel as smp`` lost a public name (``EXPORTS`` in ``modelparallel/__init__.py``
names a module or attribute that is not there), or a submodule's import replaced the function of
the same name (``smp.step``, ``smp.transform``).
"""

from __future__ import annotations

import importlib
import itertools
import json
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import modelparallel

PARSING = """
import json, sys
import modelparallel.cli
found = {"import": sorted(m for m in ("torch", "transformers") if m in sys.modules)}
for argv in (["--help"], ["train", "--help"]):
    try:
        modelparallel.cli.build_parser().parse_args(argv)
    except SystemExit:
        pass
    found[" ".join(argv)] = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(json.dumps(found))
"""


def _run(code: str, *args: str) -> dict:
    """The JSON line that ``code`` prints last, run in a fresh interpreter with ``args``."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_parsing_imports_neither_torch_nor_transformers():
    found = _run(PARSING)
    assert found == {"import": [], "--help": [], "train --help": []}, found


CHECKING = """
import json, sys
from modelparallel.cli import build_parser, train
args = build_parser().parse_args(["train", "--model", "gpt2-micro", "--tp", "2", "--pp", "2", "--data", sys.argv[1],
                                  "--seq-len", "16", "--out", sys.argv[2], "--save-every", "2", "--resume", "auto"])
print(json.dumps({"problems": train.check_args(args), "transformers": "transformers" in sys.modules,
                  "engine": sorted(m for m in sys.modules if m.startswith(("modelparallel.runtime",
                                                                           "modelparallel.checkpoint")))}))
"""


def test_launcher_checks_a_preset_run_without_transformers(tmp_path):
    """Every check before launch of a preset run (sizes, corpus, devices, resume lookup) needs
    torch at most (to count GPUs), not transformers or the engine."""
    (tmp_path / "a.py").write_text("x = 1\n" * 100)
    found = _run(CHECKING, str(tmp_path / "a.py"), str(tmp_path / "run"))
    assert found == {"problems": [], "transformers": False, "engine": []}, found


def test_every_public_name_resolves_to_its_object():
    """Every name of the table is the object its module holds, in ``dir(smp)``; the names that
    are also submodules stay the API's functions once those submodules are imported."""
    import modelparallel.step
    import modelparallel.transform  # noqa: F401 - imported for what it does to the package

    wrong = {}
    for name, (module, attr) in modelparallel.EXPORTS.items():
        real = importlib.import_module(module, "modelparallel")
        if getattr(modelparallel, name) is not (real if attr is None else getattr(real, attr)):
            wrong[name] = repr(getattr(modelparallel, name))
    assert wrong == {}
    assert not isinstance(modelparallel.step, types.ModuleType) and not isinstance(modelparallel.transform,
                                                                                  types.ModuleType)
    assert set(modelparallel.EXPORTS) <= set(dir(modelparallel))
    assert set(modelparallel.__all__) <= set(modelparallel.EXPORTS)
    submodules = {m.name for m in pkgutil.iter_modules(modelparallel.__path__)}
    assert modelparallel._SHADOWED == set(modelparallel.EXPORTS) & submodules - set(modelparallel._MODULES)


def test_device_variable_named_alike():
    """The help text names the device variable without importing ``devices`` (torch)."""
    from modelparallel import devices
    from modelparallel.cli import train

    assert train.DEVICE_ENV == devices.DEVICE_ENV


def test_preset_shape_checks_as_the_preset_config():
    """The launcher checks a preset through ``preset_shape`` (no transformers): every size check
    answers as it does for the preset's real config."""
    from modelparallel.cli.presets import PRESETS, preset_config, preset_shape, size_problems

    for name in PRESETS:
        for seq_len, tp, pp, ep in itertools.product((16, 4096), (1, 2, 3, 8), (1, 3, 9), (1, 2, 3)):
            real = size_problems(preset_config(name, seq_len), seq_len, tp, pp, ep)
            assert size_problems(preset_shape(name, seq_len), seq_len, tp, pp, ep) == real, (name, seq_len, tp, pp, ep)


RESUMING = """
import json, sys
from pathlib import Path
from modelparallel.cli import build_parser, resume, train

class Model:  # what the comparison reads of a Hugging Face config
    def to_dict(self):
        return {"n_layer": 2, "n_head": 4}

out, notes = Path(sys.argv[2]), []
tag, problems = resume.choose(out, "latest", None, 10, verify=True, notes=notes)
found = {"tag": tag, "problems": problems + resume.foreign_problems(out, tag, 2),
         "differences": resume.config_problems(out, tag, Model()),
         "matching": resume.matching_tags(out, Model(), tag),
         "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}
args = build_parser().parse_args(["train", "--model", "gpt2-micro", "--tp", "2", "--data", sys.argv[1], "--seq-len", "16",
                                  "--out", sys.argv[2], "--steps", "10", "--save-every", "2", "--resume"])
found["launch checks"] = train.check_args(args)
found["imported by them"] = sorted(m for m in sys.modules if m.startswith(
    ("torch.distributed.checkpoint", "modelparallel.runtime", "modelparallel.checkpoint.api")))
print(json.dumps(found))
"""


def _saved(ckpt: Path, tag: str, saved_at_ns: int, config: dict | None) -> None:
    """A committed partial checkpoint ``tag`` whose manifest lists one file with its checksum (what
    the launcher reads: manifest, checksums, the model config it records)."""
    from modelparallel.checkpoint.safety import commit

    directory = ckpt / f"{tag}_partial"
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    manifest = {"format": "modelparallel-partial", "parts": ["model"], "saved_at_ns": saved_at_ns,
                "files": {"__0_0.distcp": commit.file_checksum(directory / "__0_0.distcp")}}
    commit.write_manifest(directory, manifest if config is None else {**manifest, "config": config})


def test_the_resume_check_reads_checkpoints_without_torch(tmp_path):
    """``train --resume`` resolves, verifies and compares the checkpoint before launch through the
    checkpoint package's torch-free modules (``safety``, ``format``): importing the package's
    ``api`` or ``safety.errors`` (torch.distributed, DCP, the runtime) there cost seconds on every
    launch. The newest checkpoint records another model, so every step of the check reads one.
    The launch checks as a whole import torch (to count GPUs; transformers, for the model's
    config), never DCP or the engine."""
    from modelparallel.checkpoint.safety import commit

    (tmp_path / "a.py").write_text("x = 1\n" * 100)
    ckpt = tmp_path / "run" / "checkpoints"
    _saved(ckpt, "step2", 1, None)
    _saved(ckpt, "step4", 2, {"n_layer": 999})
    commit.write_newest(ckpt, "step4_partial")
    found = _run(RESUMING, str(tmp_path / "a.py"), str(tmp_path / "run"))
    assert {k: found[k] for k in ("tag", "problems", "differences", "matching", "torch")} == {
        "tag": "step4", "problems": [], "differences": ["config n_layer: checkpoint 999, model 2"],
        "matching": ["step2"], "torch": []}, found
    assert len(found["launch checks"]) == 1 and "n_layer: checkpoint 999" in found["launch checks"][0] \
        and "--resume-from step2" in found["launch checks"][0], found
    assert found["imported by them"] == [], found


def test_the_checkpoint_package_exports_on_first_use():
    """``modelparallel.checkpoint`` imports its names on first use (so the launcher's ``safety``
    imports do not import ``api``): each is its module's object, and ``CheckpointError`` is one
    class wherever it is imported from."""
    import modelparallel.checkpoint as ckpt
    from modelparallel.checkpoint.safety import durable, errors, failure
    from modelparallel.checkpoint.save import stream

    wrong = {name: module for name, module in ckpt.EXPORTS.items()
             if getattr(ckpt, name) is not getattr(importlib.import_module(module, ckpt.__name__), name)}
    assert wrong == {} and set(ckpt.__all__) == set(ckpt.EXPORTS) and set(ckpt.__all__) <= set(dir(ckpt))
    assert ckpt.CheckpointError is errors.CheckpointError is failure.CheckpointError and stream.named is durable.named
