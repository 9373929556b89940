"""Per-rank sizes: the head counts a sharded attention module reshapes with.

HF attention modules cache sizes (``num_heads``, ``split_size``) as attributes, or read them from
the model config they hold (Phi-3 slices its fused q|k|v output at
``self.config.num_attention_heads * head_dim``). After sharding each rank holds 1/degree of the
heads, so those sizes must be the rank's. A plain attribute is overwritten; a dotted one
(``config.num_attention_heads``) is given through a ``ConfigView``: the module's own view of the
shared config, answering its per-rank values and reading everything else from the shared object
(whose other modules, and the user, keep seeing the global values).
"""

from __future__ import annotations

from typing import Any


class ConfigView:
    """A module's view of a shared config object with a few attributes overridden.

    Reads of an overridden attribute answer the override; every other read and every write goes
    to the shared object, so later changes (``set_attn_implementation``...) reach the view too.
    """

    def __init__(self, base: Any):
        self.__dict__["_mp_base"] = base

    def __getattr__(self, name: str) -> Any:  # only reached for names the view does not hold
        if name == "_mp_base":
            raise AttributeError(name)
        return getattr(self._mp_base, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            setattr(self._mp_base, name, value)

    def override(self, name: str, value: Any) -> None:
        """Answer ``value`` for ``name`` from now on (the shared object keeps its own)."""
        self.__dict__[name] = value

    def __repr__(self) -> str:
        own = {k: v for k, v in self.__dict__.items() if k != "_mp_base"}
        return f"ConfigView({type(self._mp_base).__name__}, per-rank {own})"


def read(module: Any, attr: str) -> Any:
    """The value of ``attr`` on ``module``, following dots (``config.num_attention_heads``)."""
    obj = module
    for name in attr.split("."):
        obj = getattr(obj, name)
    return obj


def write(module: Any, attr: str, value: Any) -> None:
    """Give ``module`` the per-rank ``value`` of ``attr``: set a plain attribute; for a dotted one
    (``holder.name``, one level), override ``name`` in the module's own ``ConfigView`` of ``holder``.

    Raises:
        ValueError: for a path of more than two names.
    """
    names = attr.split(".")
    if len(names) == 1:
        setattr(module, attr, value)
        return
    if len(names) != 2:
        raise ValueError(f"per-rank attribute {attr!r}: at most one dot (an attribute of an object the module holds)")
    holder = getattr(module, names[0])
    if not isinstance(holder, ConfigView):
        holder = ConfigView(holder)
        setattr(module, names[0], holder)
    holder.override(names[1], value)
