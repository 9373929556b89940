"""The engine imports nothing from the SageMaker compatibility surface (read with ``ast``).

The engine (runtime, meshes, tp/, pipeline/, context/, expert/, training/, materialize/,
checkpoint/, models/...) must not import the surface: ``modelparallel/sagemaker/`` (SageMaker's
mirror modules, its v1 and v2 entry points, v2's PyTorch patches), ``modelparallel/distributed/``
(v2's checkpoint paths) and ``checkpoint/sagemaker/`` and ``checkpoint/utils.py``; nor the package's own
``__init__`` (which puts the two together). Imports inside functions count, and so does
``importlib.import_module("...")`` with a literal name. The surface, the CLI and ``__init__`` may
import anything.

A failure names each arrow as ``engine module:line -> surface module``. Move what the engine needs
down into the engine (the surface re-exports it), or move the importing code up into the surface.
"""

import ast
import re
from pathlib import Path

import modelparallel

PACKAGE = Path(modelparallel.__file__).parent

SURFACE = (r"sagemaker(\..+)?", r"distributed(\..+)?", r"checkpoint\.sagemaker(\..+)?", r"checkpoint\.utils")
NEITHER = (r"cli(\..+)?", r"run", r"__main__")
"""Module names below ``modelparallel.``: the surface, and what is neither engine nor surface."""



def kind(module: str) -> str | None:
    """"engine", "surface", "facade" (the package itself), "other", or None outside the package."""
    if module == "modelparallel":
        return "facade"
    if not module.startswith("modelparallel."):
        return None
    rest = module[len("modelparallel."):]
    if any(re.fullmatch(p, rest) for p in NEITHER):
        return "other"
    return "surface" if any(re.fullmatch(p, rest) for p in SURFACE) else "engine"


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package) for every ``.py`` file under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def imported(name: str, is_pkg: bool, node: ast.AST, known: dict) -> list[str]:
    """The modules one import statement (or ``import_module("...")`` call) in module ``name`` reaches."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        package = name.split(".") if is_pkg else name.split(".")[:-1]
        base = package[:len(package) - node.level + 1] if node.level else []
        source = ".".join(base + ([node.module] if node.module else []))
        return [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
        if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def arrows(root: Path) -> set[tuple[str, int, str]]:
    """Every (engine module, line, surface-or-facade module) import under package ``root``."""
    known = modules(root)
    found = set()
    for name, (path, is_pkg) in known.items():
        if kind(name) != "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in imported(name, is_pkg, node, known):
                if kind(target) in ("surface", "facade"):
                    found.add((name, node.lineno, target))
    return found


def test_engine_imports_no_surface():
    found = sorted(arrows(PACKAGE))
    assert not found, "engine -> surface imports:\n" + "\n".join(f"  {m}:{line} -> {t}" for m, line, t in found)


def test_finds_every_kind_of_import(tmp_path):
    """The reader itself: a module-level, a relative, a lazy and an ``import_module`` arrow into the
    surface are all found, and imports of the engine are not."""
    root = tmp_path / "modelparallel"
    (root / "sagemaker" / "nn").mkdir(parents=True)
    (root / "tp").mkdir()
    for f in ("__init__.py", "sagemaker/__init__.py", "sagemaker/nn/__init__.py", "tp/__init__.py", "runtime.py"):
        (root / f).write_text("")
    (root / "tp" / "walk.py").write_text(
        "import importlib\n"
        "from .. import runtime\n"
        "from ..sagemaker import nn\n"
        "import modelparallel.sagemaker\n"
        "def f():\n"
        "    from ..sagemaker.nn import Layer\n"
        "    return importlib.import_module('modelparallel.sagemaker.nn')\n"
        "from .. import __version__\n")
    assert arrows(root) == {("modelparallel.tp.walk", 3, "modelparallel.sagemaker.nn"),
                            ("modelparallel.tp.walk", 4, "modelparallel.sagemaker"),
                            ("modelparallel.tp.walk", 6, "modelparallel.sagemaker.nn"),
                            ("modelparallel.tp.walk", 7, "modelparallel.sagemaker.nn"),
                            ("modelparallel.tp.walk", 8, "modelparallel")}
