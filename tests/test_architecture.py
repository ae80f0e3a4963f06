"""The package's layers (docs/architecture.md): every module of `lightning_varuna` belongs to one and imports nothing
from a higher one (imports inside functions and under ``TYPE_CHECKING`` included), each package says what its layer
owns, and the page's table, picture and names say what the code does."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_docs import _dotted_names, _resolve

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "lightning_varuna"
PAGE = ROOT / "docs" / "architecture.md"

# The one list of the layers: each top-level module or package of `lightning_varuna` (``__init__``: the package's own
# `__init__.py`) and its layer. A module may import from its own layer and those below. docs/architecture.md shows it.
LAYERS: dict[str, int] = {
    **dict.fromkeys(
        [
            "_lightning_private",
            "_torch_private",
            "_optuna_private",
            "random_states",
            "hook_wrapping",
            "cutpoint",
            "slurm",
            "storage",
        ],
        0,
    ),
    "data": 1,
    "partition": 2,
    "checkpoint": 3,
    "pipeline": 4,
    "profiling": 5,
    "spilling": 6,
    "callbacks": 7,
    "strategies": 8,
    **dict.fromkeys(["multimodel", "grad_norm", "cli", "demos", "comparing", "step_runs"], 9),
    "__init__": 10,
}


def _module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, for its ``__init__.py``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(module: str, source: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """The package's modules that ``module`` imports, with the line of each import: anywhere in the file (inside
    functions and ``if TYPE_CHECKING:`` too), relative imports resolved; ``from a import b`` imports ``a.b`` where that
    is a module, else ``a``."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            found += [(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, node.lineno) for a in node.names]
    root = PACKAGE.name
    return [(name, line) for name, line in found if name == root or name.startswith(root + ".")]


def _layer_key(module: str) -> str:
    """The entry of `LAYERS` that ``module`` belongs to: its top-level module or package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _import_edges() -> list[tuple[str, str, int]]:
    """Every import of one of the package's modules by another: (importer, imported, line)."""
    files = _module_files()
    edges = []
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for imported, line in imported_modules(module, path.read_text(), is_package, set(files)):
            edges.append((module, imported, line))
    return edges


def test_every_module_has_a_layer():
    unlisted = sorted(m for m in _module_files() if _layer_key(m) not in LAYERS)
    assert not unlisted, f"modules in no layer: {unlisted}; add them to LAYERS and to docs/architecture.md's table"
    stale = sorted(set(LAYERS) - {_layer_key(m) for m in _module_files()})
    assert not stale, f"LAYERS lists {stale}, which the package does not have"


def test_no_import_runs_up_the_layers():
    upward = sorted(
        f"{a} -> {b} (layer {LAYERS[_layer_key(a)]} imports layer {LAYERS[_layer_key(b)]}, line {line})"
        for a, b, line in _import_edges()
        if LAYERS.get(_layer_key(b), -1) > LAYERS.get(_layer_key(a), 99)
    )
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_import_scan_sees_every_import():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import lightning_varuna.storage\n"
        "from . import layout\n"
        "from ..pipeline.step import MicroBatchedStep\n"
        "from lightning_varuna import CutPoint\n"
        "if TYPE_CHECKING:\n"
        "    from lightning_varuna.strategies.varuna import VarunaStrategy\n"
        "def f():\n"
        "    from lightning_varuna.multimodel import trainer\n"
    )
    known = {"lightning_varuna.checkpoint.layout", "lightning_varuna.multimodel.trainer"}
    names = [name for name, _ in imported_modules("lightning_varuna.checkpoint.sharded", source, False, known)]
    assert sorted(names) == [
        "lightning_varuna",
        "lightning_varuna.checkpoint.layout",
        "lightning_varuna.multimodel.trainer",
        "lightning_varuna.pipeline.step",
        "lightning_varuna.storage",
        "lightning_varuna.strategies.varuna",
    ]


def test_every_package_says_what_its_layer_owns():
    for module, path in _module_files().items():
        if path.name != "__init__.py" or module == PACKAGE.name:
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert f"layer {LAYERS[_layer_key(module)]}" in docstring, (
            f"{path.relative_to(ROOT)}: its docstring should say its layer (layer {LAYERS[_layer_key(module)]}) and "
            "what the layer owns"
        )


def test_the_page_shows_the_layers():
    rows = re.findall(r"^\| (\d+) \| (.*?) \|", PAGE.read_text(), flags=re.MULTILINE)
    shown = {name: int(layer) for layer, names in rows for name in re.findall(r"`(\w+)`", names)}
    assert shown == LAYERS


def test_the_picture_shows_the_imports():
    """The flowchart's arrows are the imports between the packages of layers 1 to 9 (the foundation, which all may
    import, and the package's own `__init__` are left out)."""
    drawn = {name for name, layer in LAYERS.items() if 0 < layer < 10}
    imports = {
        (_layer_key(a), _layer_key(b))
        for a, b, _ in _import_edges()
        if _layer_key(a) != _layer_key(b) and {_layer_key(a), _layer_key(b)} <= drawn
    }
    flowchart = next(block for block in re.findall(r"```mermaid\n(.*?)```", PAGE.read_text(), re.DOTALL))
    arrows = set(re.findall(r"^\s*(\w+) --> (\w+)\s*$", flowchart, flags=re.MULTILINE))
    assert arrows == imports, f"missing from the picture: {imports - arrows}; not imported: {arrows - imports}"


def test_the_page_names_real_code():
    names = _dotted_names(PAGE)
    assert len(names) > 30  # the hops of the three trainers
    for dotted in names:
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as error:
            raise AssertionError(f"docs/architecture.md names `{dotted}`, which does not resolve: {error}") from error
