"""The package's import graph, read from the source: every ``import`` statement of every module of
``megatron_ext/``, function-local ones included, so it holds for lazy imports too, and needs neither
Megatron nor torch. ``tests/unit/test_layering.py`` holds the graph to its layers;
``tools/render_docs.py`` draws it in docs/design.md (``unit-graph``)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "megatron_ext"


def modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name), and its file."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (``from pkg import module`` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = {f"{source}.{alias.name}" for alias in node.names} & known.keys()
            found.update(submodules or ({source} & known.keys()))
    found.discard(name)
    return found


def module_graph(root: Path = REPO) -> dict[str, set[str]]:
    """Each module and the package's modules it imports."""
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def unit(module: str) -> str:
    """The unit a module belongs to: a top-level module or subpackage's name (``training``,
    ``hardware``); ``""`` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each unit and the other units its modules import."""
    units: dict[str, set[str]] = defaultdict(set)
    for module, imported in graph.items():
        units[unit(module)].update(unit(m) for m in imported if unit(m) != unit(module))
    return dict(units)
