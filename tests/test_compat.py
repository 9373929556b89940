"""Every private PyTorch name the package relies on still exists, and only compat.py imports one.

A failure in ``test_private_names_exist`` means a PyTorch upgrade removed or moved a private
name: the message names it and the installed torch version; find its replacement and change
``modelparallel/compat.py`` alone. A failure in ``test_only_compat_imports_private_names``
means a module imports a private PyTorch name directly: move the import into compat.py.
"""

import ast
import importlib
from pathlib import Path

import torch

import modelparallel

PACKAGE = Path(modelparallel.__file__).parent
COMPAT = PACKAGE / "compat.py"


def _private_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from torch... import name`` in ``path`` whose module path or name
    is private (a segment starting with ``_``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "transformers"):
            for alias in node.names:
                if any(seg.startswith("_") for seg in node.module.split(".")) or alias.name.startswith("_"):
                    out.append((node.module, alias.name))
    return out


def test_private_names_exist():
    names = _private_imports(COMPAT)
    assert names, "compat.py lists no private imports: the parser above no longer finds them"
    missing = []
    for module, name in names:
        try:
            if not hasattr(importlib.import_module(module), name):
                importlib.import_module(f"{module}.{name}")  # a submodule not loaded yet
        except ImportError as e:
            missing.append(f"{module}.{name} ({e})")
    assert not missing, (f"torch {torch.__version__} no longer provides {', '.join(missing)}; "
                         "replace it in modelparallel/compat.py")


def test_compat_exports_each_name():
    compat = importlib.import_module("modelparallel.compat")
    assert all(getattr(compat, name, None) is not None for name in compat.__all__)


def test_only_compat_imports_private_names():
    offenders = [f"{path.relative_to(PACKAGE)}: from {module} import {name}"
                 for path in sorted(PACKAGE.rglob("*.py")) if path != COMPAT
                 for module, name in _private_imports(path)]
    assert not offenders, "private PyTorch imports outside compat.py:\n" + "\n".join(offenders)


def test_device_mesh_unflatten_exists():
    """``compat.unflatten_mesh`` calls the private ``DeviceMesh._unflatten`` (an attribute, not an
    import, so the import check above cannot see it)."""
    from torch.distributed.device_mesh import DeviceMesh

    assert callable(getattr(DeviceMesh, "_unflatten", None)), \
        f"torch {torch.__version__} has no DeviceMesh._unflatten; replace it in modelparallel/compat.py"


def _unflatten_second_dim() -> tuple:
    """A (pp=1, dp=2) world mesh with ``dp`` split into (rep=1, shard=2) by name; returns the new
    mesh's dimension names and the ranks of its ``shard`` dimension."""
    from torch.distributed.device_mesh import init_device_mesh

    from modelparallel.compat import unflatten_mesh

    world = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    split = unflatten_mesh(world, "dp", (1, 2), ("rep", "shard"))
    return split.mesh_dim_names, split["shard"].mesh.tolist()


def test_unflatten_mesh_splits_the_named_dimension():
    """The dimension is named, not first: a wrong index or a name ``_unflatten`` refuses (torch 2.11
    refuses every name) fails here."""
    import harness

    for names, shard_ranks in harness.run(2, _unflatten_second_dim):
        assert names == ("pp", "rep", "shard")
        assert shard_ranks == [0, 1]


def test_unflatten_mesh_names_a_missing_dimension():
    from unittest import mock

    import pytest

    from modelparallel.compat import unflatten_mesh

    mesh = mock.Mock(mesh_dim_names=("pp", "dp"), device_type="meta")
    with pytest.raises(ValueError, match=r"'ep'.*\('pp', 'dp'\)"):
        unflatten_mesh(mesh, "ep", (1, 1), ("a", "b"))
    mesh._unflatten.assert_not_called()


def test_single_tensor_collectives_take_the_current_names():
    """torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (the old names warn
    on every call); compat takes the new names where they exist and the old ones elsewhere."""
    import torch.distributed as dist

    from modelparallel import compat

    for new, old in (("all_gather_single", "all_gather_into_tensor"),
                     ("reduce_scatter_single", "reduce_scatter_tensor")):
        assert getattr(compat, new) is (getattr(dist, new, None) or getattr(dist, old))


def _gather_and_scatter() -> tuple:
    import torch.distributed as dist

    from modelparallel.compat import all_gather_single, reduce_scatter_single

    rank = dist.get_rank()
    gathered = torch.empty(4)
    all_gather_single(gathered, torch.tensor([rank, 10.0 + rank]))
    mine = torch.empty(2)
    reduce_scatter_single(mine, torch.arange(4.0) * (rank + 1))
    return gathered.tolist(), mine.tolist()


def test_single_tensor_collectives_gather_and_reduce_scatter():
    import harness

    gathered, scattered = zip(*harness.run(2, _gather_and_scatter))
    assert list(gathered) == [[0.0, 10.0, 1.0, 11.0]] * 2
    # arange(4) x 1 + arange(4) x 2 = [0, 3, 6, 9], in halves
    assert list(scattered) == [[0.0, 3.0], [6.0, 9.0]]
