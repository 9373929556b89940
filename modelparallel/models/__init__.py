"""Architectures: one ``Architecture`` record per Hugging Face ``model_type``, one lookup.

Each module here (any whose name does not start with ``_``) describes one built-in architecture
and exports ``ARCHITECTURE``, its record (plan, key table, and where it applies: pipeline split,
context-parallel attention, experts, SageMaker names); adding the file is all it takes to build
it in. A model this package does not know gets its record from ``register_architecture``, held
by the model's config class (so the library keeps no registry of its own); it takes precedence
over a built-in record of the same ``model_type``. ``architecture_for`` is the one lookup.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import MappingProxyType, ModuleType
from typing import Mapping

from ._architecture import Architecture

__all__ = ["BUILT_IN", "Architecture", "architecture_for", "register_architecture", "table_for"]

_ATTRIBUTE = "_mp_architecture"
"""The config-class attribute holding a registered record."""


def _modules() -> list[ModuleType]:
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


def _check(module: ModuleType) -> ModuleType:
    """Refuse an architecture module that does not export a record with a key table."""
    record = getattr(module, "ARCHITECTURE", None)
    if not isinstance(record, Architecture) or record.table is None:
        raise TypeError(f"{module.__name__} must export ARCHITECTURE (an Architecture with a key table), "
                        f"got {type(record).__name__}")
    return module


BUILT_IN: Mapping[str, Architecture] = MappingProxyType(
    {m.ARCHITECTURE.model_type: m.ARCHITECTURE for m in map(_check, _modules())})
"""``model_type`` -> the record of every file of this package (read-only, built once)."""


def _config_of(model_or_config):
    """A model's config, a config itself, or the config class transformers registers under a
    ``model_type`` string (None for an unknown one)."""
    if isinstance(model_or_config, str):
        from transformers import CONFIG_MAPPING

        try:
            return CONFIG_MAPPING[model_or_config]
        except KeyError:
            return None
    return getattr(model_or_config, "config", model_or_config)


def architecture_for(model_or_config) -> Architecture | None:
    """The record of an HF model, of its config, or of a ``model_type`` string.

    A record registered for the config's class (or a base class with the same ``model_type``)
    comes first, then the built-in record of the ``model_type``.

    Returns:
        The ``Architecture``, or None for a model neither registered nor built in.
    """
    config = _config_of(model_or_config)
    model_type = model_or_config if isinstance(model_or_config, str) else getattr(config, "model_type", None)
    registered = getattr(config, _ATTRIBUTE, None)
    if isinstance(registered, Architecture) and registered.model_type == model_type:
        return registered
    return BUILT_IN.get(model_type)


def register_architecture(config_class: type, architecture: Architecture) -> None:
    """Make ``architecture`` the record of every model whose config is a ``config_class``: its
    plan then shards it under tensor parallelism, and its key table, pipeline split, context and
    expert data serve the other dimensions, as for a built-in architecture.

    The record is kept on the class (as ``tp_register`` keeps registrations on module classes):
    register in every process, before the model is wrapped. Registering again replaces it.

    Args:
        config_class: the model's ``PretrainedConfig`` subclass; its ``model_type`` must be the
            record's.
        architecture: the record (see ``Architecture``).

    Raises:
        TypeError: ``architecture`` is not an ``Architecture`` or ``config_class`` not a class.
        ValueError: the record's ``model_type`` is not the config class's.
    """
    if not isinstance(architecture, Architecture):
        raise TypeError(f"register_architecture takes an Architecture, got {type(architecture).__name__}")
    if not isinstance(config_class, type):
        raise TypeError(f"register_architecture takes the model's config class, got {config_class!r}")
    model_type = getattr(config_class, "model_type", None)
    if model_type != architecture.model_type:
        raise ValueError(f"{config_class.__name__}.model_type is {model_type!r}, the record's is "
                         f"{architecture.model_type!r}: a record serves one model_type")
    setattr(config_class, _ATTRIBUTE, architecture)


def table_for(model_type: str | None):
    """The state-dict key table of an HF ``model_type`` (``KeyTable``), or None if it has none."""
    return getattr(architecture_for(model_type), "table", None) if model_type else None
