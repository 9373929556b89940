"""SageMaker's submodule paths under ``modelparallel`` as well: a script that writes ``modelparallel``
for ``torch.sagemaker`` (``from modelparallel.moe.moe_config import MoEConfig``,
``modelparallel.nn.huggingface.gpt2``, ``modelparallel.patches.checkpoint``) gets the modules that
live in ``modelparallel.sagemaker``, the same module objects (entered in ``sys.modules`` under both
names, so nothing is loaded twice). ``modelparallel.compat.sagemaker_imports``, the path the README
gives notebooks, is the hook's ``sagemaker_imports`` (``compat`` itself, an engine module, does
not import the surface).

Both are answered when the path is imported, not when ``modelparallel`` is: a finder first on
``sys.meta_path`` answers only for those names (a string test, no import), so ``import
modelparallel`` imports none of the engine (see the package's docstring).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

from .hook import MIRRORED, _exists, _Loader, sagemaker_imports

KEPT_AS_ATTRIBUTE = ("state",)
"""``modelparallel.state`` is the ``smp.state`` object; its module is ``modelparallel.sagemaker.state``."""


class _CompatLoader(importlib.machinery.SourceFileLoader):
    """``modelparallel.compat``'s own loader, which then adds the hook's ``sagemaker_imports``."""

    def exec_module(self, module: ModuleType) -> None:
        super().exec_module(module)
        module.sagemaker_imports = sagemaker_imports


class MirrorFinder(importlib.abc.MetaPathFinder):
    """Answers ``<package>.<mirrored>[.x]`` with ``modelparallel.sagemaker.<mirrored>[.x]`` (the
    module object itself, as the hook's aliases are) and loads ``<package>.compat`` with
    ``_CompatLoader``; every other name is left to the finders after it."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(self.package + "."):
            return None
        rest = fullname[len(self.package) + 1:]
        if rest == "compat":
            return self._compat_spec(fullname, path)
        if rest.split(".")[0] not in MIRRORED or rest.split(".")[0] in KEPT_AS_ATTRIBUTE:
            return None
        ours = f"{__package__}.{rest}"
        if not _exists(ours):
            return None  # the import fails naming ``fullname``, as for any missing module
        spec = importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        spec.loader_state = ours
        return spec

    @staticmethod
    def _compat_spec(fullname: str, path):
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _CompatLoader(spec.loader.name, spec.loader.path)
        return spec


def register(package: ModuleType) -> None:
    """Answer SageMaker's paths under ``package``'s name from now on (``package`` is
    ``modelparallel``, passed by its ``__init__`` while it is being imported); idempotent."""
    if not any(isinstance(f, MirrorFinder) and f.package == package.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, MirrorFinder(package.__name__))
    compat = sys.modules.get(f"{package.__name__}.compat")
    if compat is not None:  # imported before the finder was there (a reload of the package)
        compat.sagemaker_imports = sagemaker_imports
