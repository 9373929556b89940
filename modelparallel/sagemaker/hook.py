"""SageMaker's module names resolved to this package, for one process: an import hook.

``smdistributed.modelparallel.torch`` (v1) is ``modelparallel.sagemaker.v1`` and ``torch.sagemaker``
(v2) is ``modelparallel.sagemaker.v2``: both give every name of ``import modelparallel as smp``
(the same objects, so ``smp.DistributedModel is modelparallel.DistributedModel`` and pickles name
``modelparallel``), v1 with the engine's ``init``, v2 with the ``init`` and ``transform`` that
install v2's PyTorch patches. Below either root, ``.a.b`` is ``modelparallel.sagemaker.a.b`` for
the modules that exist only to mirror SageMaker (``MIRRORED``: ``nn``, ``utils``...) and
``modelparallel.a.b`` for the engine's own (``delayed_param``, ``checkpoint``...); the alias is the
module object itself. ``smdistributed`` and ``smdistributed.modelparallel`` are small stand-in
packages (scripts read ``smdistributed.modelparallel.__version__``). Nothing is written to disk:
the finder sits first on ``sys.meta_path`` and answers only for those names (a string test, no
import), so every other import, ``torch``'s own lazy submodules included, goes on as before. A
SageMaker module this package does not have raises ``ModuleNotFoundError`` naming it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

ROOTS = {"smdistributed.modelparallel.torch": "modelparallel.sagemaker.v1",
         "torch.sagemaker": "modelparallel.sagemaker.v2"}
"""SageMaker's root module paths -> the module each is here."""

MIRRORED = ("cp", "grad_norm", "logger", "moe", "nn", "patches", "state", "tensor_parallel", "utils")
"""The first name below a root of the SageMaker modules that live in ``modelparallel.sagemaker``;
every other submodule is the engine's (``modelparallel.<name>``)."""

STAND_INS = ("smdistributed", "smdistributed.modelparallel", "smdistributed.dataparallel",
             "smdistributed.dataparallel.torch", "smdistributed.dataparallel.torch.torch_smddp")
"""Parent packages of the v1 path that exist only to hold it, and SageMaker's data-parallel
backend module, which scripts import only to make the ``smddp`` backend name known (under
``modelparallel run`` it is: ``sagemaker.torch_calls``)."""


def target_of(name: str) -> str | None:
    """The module ``name`` resolves to here, or None if it is not a SageMaker path we alias."""
    for root, ours in ROOTS.items():
        if name == root:
            return ours
        if name.startswith(root + "."):
            rest = name[len(root) + 1:]
            home = "modelparallel.sagemaker" if rest.split(".")[0] in MIRRORED else "modelparallel"
            return f"{home}.{rest}"
    return None


def _handled(name: str) -> bool:
    return name in STAND_INS or name.startswith("smdistributed.") or target_of(name) is not None


def _exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


class _Loader(importlib.abc.Loader):
    """Loads an alias by putting the real module in ``sys.modules`` under the alias's name (the
    import system returns whatever ``sys.modules`` holds once ``exec_module`` is done)."""

    def create_module(self, spec):
        return None  # an empty module, replaced in exec_module

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__spec__.name
        if name in STAND_INS:
            module.__path__ = []
            if name == "smdistributed.modelparallel":
                from .. import __version__

                module.__version__ = __version__
            return
        sys.modules[name] = importlib.import_module(module.__spec__.loader_state)


class SageMakerFinder(importlib.abc.MetaPathFinder):
    """The finder ``sagemaker_imports`` puts first on ``sys.meta_path``."""

    def find_spec(self, fullname: str, path=None, target=None):
        if not _handled(fullname):
            return None
        ours = target_of(fullname)
        if fullname not in STAND_INS:
            if ours is None:
                raise ModuleNotFoundError(f"No module named {fullname!r}: modelparallel provides "
                                          "smdistributed.modelparallel.torch and torch.sagemaker only", name=fullname)
            if not _exists(ours):
                raise ModuleNotFoundError(f"No module named {fullname!r}: SageMaker's module {fullname} is not "
                                          f"provided by modelparallel (it would be {ours})", name=fullname)
        spec = importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        spec.loader_state = ours
        return spec


def _installed() -> SageMakerFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, SageMakerFinder)), None)


def install() -> SageMakerFinder:
    """Resolve SageMaker's module names for the rest of this process (idempotent)."""
    finder = _installed()
    if finder is None:
        finder = SageMakerFinder()
        sys.meta_path.insert(0, finder)
    return finder


def uninstall() -> None:
    """Remove the finder and every alias it put in ``sys.modules`` (and ``torch.sagemaker``)."""
    finder = _installed()
    if finder is not None:
        sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if _handled(n)]:
        del sys.modules[name]
    torch = sys.modules.get("torch")
    if torch is not None and "sagemaker" in vars(torch):
        delattr(torch, "sagemaker")


@contextlib.contextmanager
def sagemaker_imports():
    """Inside the block, ``import smdistributed.modelparallel.torch as smp`` and ``import
    torch.sagemaker as tsm`` give this package (for notebooks and tests; ``modelparallel run``
    installs it for a whole script). Modules imported inside keep what they bound; the names
    stop resolving when the block ends, unless they were already set up before it."""
    if _installed() is not None:
        yield
        return
    install()
    try:
        yield
    finally:
        uninstall()
