"""Built-in architectures, one module each, found by listing this package.

A module here (any whose name does not start with ``_``) describes one HF architecture and
exports ``SPEC`` (its ``ArchSpec``: plan, packed weights, loss kind) and ``TABLE`` (its
``KeyTable`` for state-dict translation), and optionally ``EXPERTS`` (a mixture-of-experts
architecture's ``ExpertLayout``), ``SAGEMAKER`` (a ``SageMakerLayout``: where SageMaker's module
names fall in it), for a causal decoder that context parallelism can run, ``CONTEXT`` (its
``ContextSpec``), and, if it can be pipelined, ``PIPELINE`` (its ``PipelineSplit``: where the
blocks are, what runs before and after them). Adding the file is all it takes to register it.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from torch import nn

from ..context.spec import ContextSpec
from ..expert.layout import ExpertLayout
from ._translate import KeyTable
from ..pipeline.split import PipelineSplit
from ..tp.plan import ArchSpec
from ._sagemaker import SageMakerLayout


def _modules() -> list[ModuleType]:
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


def _check(module: ModuleType) -> ModuleType:
    """Refuse an architecture module that does not export a matching SPEC and TABLE."""
    spec, table = getattr(module, "SPEC", None), getattr(module, "TABLE", None)
    if not isinstance(spec, ArchSpec) or not isinstance(table, KeyTable) or table.arch != spec.model_type:
        raise TypeError(f"{module.__name__} must export SPEC (an ArchSpec) and TABLE (a KeyTable) for the same "
                        f"model_type, got {type(spec).__name__} and {type(table).__name__}")
    if not isinstance(getattr(module, "EXPERTS", ExpertLayout("", "")), ExpertLayout):
        raise TypeError(f"{module.__name__}.EXPERTS must be an ExpertLayout")
    if not isinstance(getattr(module, "CONTEXT", None), (ContextSpec, type(None))):
        raise TypeError(f"{module.__name__}.CONTEXT must be a ContextSpec")
    return module


_ALL = [_check(m) for m in _modules()]
ARCHITECTURES: dict[str, ArchSpec] = {m.SPEC.model_type: m.SPEC for m in _ALL}
TABLES: dict[str, KeyTable] = {m.SPEC.model_type: m.TABLE for m in _ALL}
PIPELINES: dict[str, PipelineSplit] = {m.SPEC.model_type: m.PIPELINE for m in _ALL
                                       if isinstance(getattr(m, "PIPELINE", None), PipelineSplit)}
EXPERT_LAYOUTS: dict[str, ExpertLayout] = {m.SPEC.model_type: m.EXPERTS for m in _ALL if hasattr(m, "EXPERTS")}
CONTEXTS: dict[str, ContextSpec] = {m.SPEC.model_type: m.CONTEXT for m in _ALL if getattr(m, "CONTEXT", None)}
LAYOUTS: dict[str, SageMakerLayout] = {m.SPEC.model_type: m.SAGEMAKER for m in _ALL if hasattr(m, "SAGEMAKER")}


def spec_for(model: nn.Module) -> ArchSpec | None:
    """The built-in spec for an HF model, or None if its architecture has none."""
    return ARCHITECTURES.get(getattr(getattr(model, "config", None), "model_type", None))


def experts_for(model: nn.Module) -> ExpertLayout | None:
    """The built-in expert layout of an HF mixture-of-experts model, or None."""
    return EXPERT_LAYOUTS.get(getattr(getattr(model, "config", None), "model_type", None))


def context_spec_for(model: nn.Module) -> ContextSpec | None:
    """The built-in ``ContextSpec`` of an HF model, or None if context parallelism cannot run it."""
    return CONTEXTS.get(getattr(getattr(model, "config", None), "model_type", None))


def table_for(model_type: str | None) -> KeyTable | None:
    """The key table of an HF ``model_type``, or None if it has no translation."""
    return TABLES.get(model_type)


def pipeline_split_for(model: nn.Module) -> PipelineSplit | None:
    """The built-in pipeline split for an HF model, or None if its architecture has none."""
    return PIPELINES.get(getattr(getattr(model, "config", None), "model_type", None))


def sagemaker_layout_for(model: nn.Module) -> SageMakerLayout | None:
    """Where SageMaker's module names fall in an HF model, or None if its architecture has none."""
    return LAYOUTS.get(getattr(getattr(model, "config", None), "model_type", None))
