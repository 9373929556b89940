"""User data stored as plain data, and rebuilt from an allow-list: no code named by a file runs.

User content and ``smp.save`` objects are read back with ``torch.load(weights_only=True)``, which
builds tensors and plain containers only. A few kinds of value that are data, not code, are
stored as tagged dicts of plain data (``to_plain``) and rebuilt on load (``from_plain``) by the
one constructor this module names for the tag, never by a class or function the file names:

* ``collections.defaultdict`` whose factory is a built-in type (or None);
* numpy scalars and arrays of boolean and numeric dtypes (stored as tensors, returned by numpy);
* Hugging Face configs: ``PretrainedConfig`` and the config classes transformers registers for
  a ``model_type``, stored as ``to_dict()`` and rebuilt with that registered class's
  ``from_dict`` (a custom config class is refused at save time: its code is not known here).

A user dict that uses one of the reserved keys is stored escaped, so every dict comes back as it
was saved, whatever its keys.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

DEFAULTDICT = "__modelparallel_defaultdict__"
"""``{DEFAULTDICT: factory name, "items": {...}}``: a defaultdict (also what older versions wrote)."""
VALUE = "__modelparallel_value__"
"""``{VALUE: kind, ...}``: a numpy value or a Hugging Face config."""
ESCAPED = "__modelparallel_dict__"
"""``{ESCAPED: [[key, value], ...]}``: a user dict holding a reserved key."""
_RESERVED = (DEFAULTDICT, VALUE, ESCAPED)
FACTORIES = {f.__name__: f for f in (int, float, str, list, dict, set, tuple, bool)}
_NUMPY_KINDS = "biufc"  # bool, signed, unsigned, float, complex
_LEAVES = (torch.Tensor, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def to_plain(obj: Any) -> Any:
    """``obj`` with every value of the kinds above turned into tagged plain data, containers
    rebuilt as their own types; ``from_plain`` undoes it.

    Raises:
        TypeError: a ``defaultdict`` of another factory, a numpy value of another dtype, or a
            config class transformers does not register (each would need code to rebuild).
    """
    if isinstance(obj, collections.defaultdict):
        return _defaultdict(obj)
    if isinstance(obj, collections.OrderedDict):
        return collections.OrderedDict((k, to_plain(v)) for k, v in obj.items())
    if type(obj) is dict:
        if any(isinstance(k, str) and k in _RESERVED for k in obj):
            return {ESCAPED: [[k, to_plain(v)] for k, v in obj.items()]}
        return {k: to_plain(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(to_plain(v) for v in obj)
    if type(obj).__module__.split(".")[0] == "numpy":  # before the leaves: np.float64 is a float
        return _numpy(obj)
    if isinstance(obj, _LEAVES):
        return obj
    return _config(obj) if _is_hf_config(obj) else obj


def from_plain(obj: Any) -> Any:
    """Undo ``to_plain``."""
    if type(obj) is dict:
        if set(obj) == {DEFAULTDICT, "items"}:
            return collections.defaultdict(FACTORIES.get(obj[DEFAULTDICT]),
                                           {k: from_plain(v) for k, v in obj["items"].items()})
        if set(obj) == {ESCAPED} and isinstance(obj[ESCAPED], list):
            return {k: from_plain(v) for k, v in obj[ESCAPED]}
        if VALUE in obj:
            return _rebuild(obj)
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, collections.OrderedDict):
        return collections.OrderedDict((k, from_plain(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(from_plain(v) for v in obj)
    return obj


def _defaultdict(obj: collections.defaultdict) -> dict:
    factory = obj.default_factory
    if factory is not None and FACTORIES.get(getattr(factory, "__name__", None)) is not factory:
        raise TypeError(f"a defaultdict with default_factory={factory!r} cannot be stored (only None or "
                        f"one of {sorted(FACTORIES)}): convert it to a dict first")
    return {DEFAULTDICT: factory.__name__ if factory else None, "items": {k: to_plain(v) for k, v in obj.items()}}


def _numpy(obj: Any) -> Any:
    import numpy as np

    if not isinstance(obj, (np.generic, np.ndarray)):
        return obj
    array = np.asarray(obj)
    if array.dtype.kind not in _NUMPY_KINDS or array.dtype.byteorder == ">":
        raise TypeError(f"a numpy value of dtype {array.dtype} cannot be stored safely (numeric and boolean "
                        "dtypes only); convert it to a tensor or a Python value first")
    return {VALUE: "numpy", "scalar": isinstance(obj, np.generic), "data": torch.from_numpy(array.copy())}


def _is_hf_config(obj: Any) -> bool:
    try:
        from transformers import PretrainedConfig
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(obj, PretrainedConfig)


def _config_class(name: str, model_type: str | None) -> type | None:
    """The config class transformers registers under ``model_type`` if it is named ``name``
    (``PretrainedConfig`` itself for the base class); None otherwise."""
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if name == PretrainedConfig.__name__:
        return PretrainedConfig
    try:
        cls = CONFIG_MAPPING[model_type]
    except (KeyError, TypeError):
        return None
    return cls if cls.__name__ == name else None


def _config(obj: Any) -> dict:
    name, model_type = type(obj).__name__, getattr(obj, "model_type", None)
    if _config_class(name, model_type) is not type(obj):
        raise TypeError(f"a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored safely: only "
                        "PretrainedConfig and the config classes transformers registers can be rebuilt "
                        "without running code from the file (store config.to_dict() instead)")
    return {VALUE: "hf_config", "class": name, "model_type": model_type, "config": to_plain(obj.to_dict())}


def _rebuild(obj: dict) -> Any:
    """A tagged value, rebuilt by the constructor this module names for its tag."""
    kind = obj.get(VALUE)
    if kind == "numpy" and isinstance(obj.get("data"), torch.Tensor):
        array = obj["data"].numpy()
        return array[()] if obj.get("scalar") else array
    if kind == "hf_config" and isinstance(obj.get("config"), dict):
        cls = _config_class(obj.get("class"), obj.get("model_type"))
        if cls is None:
            raise ValueError(f"stored Hugging Face config class {obj.get('class')!r} (model_type "
                             f"{obj.get('model_type')!r}) is not one transformers registers")
        return cls.from_dict(from_plain(obj["config"]))
    raise ValueError(f"unknown stored value {kind!r} (written by a newer version, or damaged)")
