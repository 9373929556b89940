"""State-dict translation under this package's documented path: the engine's key tables and
translation (``modelparallel/models/_translate.py``) re-exported, and SageMaker's pair of functions
per architecture (``translate_state_dict_to_hf_<arch>``,
``translate_hf_state_dict_to_smdistributed_<arch>``) built from an architecture's key table."""

from __future__ import annotations

from collections.abc import Callable

from ....models import table_for  # noqa: F401 - re-exported
from ....models._translate import (  # noqa: F401 - re-exported
    KeyTable, causal_mask, from_hf, from_hf_items, from_hub, masked_bias, to_hf, to_hf_items)


def sagemaker_functions(table: KeyTable, name: str, module: str, config_arg: bool = False) -> tuple[Callable, Callable]:
    """SageMaker's pair of translation functions for one architecture, generated from its table:
    ``translate_state_dict_to_hf_<name>(state_dict, max_seq_len=None, [config=None,]
    legacy_buffers=False)`` and ``translate_hf_state_dict_to_smdistributed_<name>(state_dict)``.

    Args:
        table: the architecture's key table.
        name: the architecture's name in SageMaker's function names (``gptneo``).
        module: the module that binds them under those names (so they pickle by reference, as
            functions passed to other processes must).
        config_arg: whether the export takes the model ``config`` (GPT-Neo's local-window masks).

    Returns:
        (to HF, from HF) functions.
    """
    if config_arg:
        def export(state_dict, max_seq_len=None, config=None, legacy_buffers=False):
            return to_hf(table, state_dict, max_seq_len, legacy_buffers, config)
    else:
        def export(state_dict, max_seq_len=None, legacy_buffers=False):
            return to_hf(table, state_dict, max_seq_len, legacy_buffers)

    def import_(state_dict):
        return from_hf(table, state_dict)

    export.__module__ = import_.__module__ = module
    export.__name__ = export.__qualname__ = f"translate_state_dict_to_hf_{name}"
    export.__doc__ = (f"Distributed-format {table.arch} state dict (``DistributedModel.state_dict()``) -> HF "
                      f"state dict; see ``to_hf``." + (" Give the model ``config`` with ``max_seq_len`` for "
                      "per-layer masks that depend on it." if config_arg else ""))
    import_.__name__ = import_.__qualname__ = f"translate_hf_state_dict_to_smdistributed_{name}"
    import_.__doc__ = f"HF {table.arch} state dict -> distributed format, for ``DistributedModel.load_state_dict``."
    return export, import_
