"""SageMaker's submodule paths under ``modelparallel`` as well: a script that writes ``modelparallel``
for ``torch.sagemaker`` (``from modelparallel.moe.moe_config import MoEConfig``,
``modelparallel.nn.huggingface.gpt2``, ``modelparallel.patches.checkpoint``) gets the modules that
live in ``modelparallel.sagemaker``, the same module objects (entered in ``sys.modules`` under both
names, so nothing is loaded twice). ``modelparallel.compat.sagemaker_imports``, the path the README
gives notebooks, is the hook's ``sagemaker_imports`` (``compat`` itself, an engine module, does
not import the surface).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from types import ModuleType

from .hook import MIRRORED, sagemaker_imports

KEPT_AS_ATTRIBUTE = ("state",)
"""``modelparallel.state`` is the ``smp.state`` object; its module is ``modelparallel.sagemaker.state``."""


def _tree(top: str) -> list[ModuleType]:
    """``modelparallel.sagemaker.<top>`` and every module below it, imported."""
    root = importlib.import_module(f"{__package__}.{top}")
    found = [root]
    for info in pkgutil.walk_packages(getattr(root, "__path__", []), root.__name__ + "."):
        found.append(importlib.import_module(info.name))
    return found


def register(package: ModuleType) -> None:
    """Enter each mirrored module under ``package``'s name as well (``package`` is ``modelparallel``,
    passed by its ``__init__`` while it is being imported)."""
    for top in MIRRORED:
        if top in KEPT_AS_ATTRIBUTE:
            continue
        for module in _tree(top):
            sys.modules.setdefault(package.__name__ + module.__name__[len(__package__):], module)
        if not hasattr(package, top):
            setattr(package, top, sys.modules[f"{__package__}.{top}"])
    importlib.import_module(f"{package.__name__}.compat").sagemaker_imports = sagemaker_imports
