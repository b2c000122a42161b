"""The package's import graph: no circles, and every import runs down the layers of docs/design.md.

Read from the source (``tools/import_graph.py``: every ``import`` statement, function-local ones
included), so it holds for lazy imports too and needs neither Megatron nor torch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tools.import_graph import PACKAGE, module_graph, modules, unit, unit_graph

ROOT = Path(__file__).resolve().parents[2]

LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer) for layer in (
    # bottom: asks nothing of the rest of the package
    {"config_loading", "fileio", "transformer_impl", "hardware", "processes", "assets", "claims", "progress",
     "exit_codes"},
    {"megatron_compat", "process_group"},  # megatron-core workarounds (CUDA calls on CPU ...); process-group start-up
    {"tokenizer", "phases", "schedule", "objectives", "model"},  # objectives/: one module per objective
    {"performance"},  # FLOPs, memory, device peaks, measured speeds, the cost model (a run config read by its fields)
    {"data", "checkpoint"},
    {"training"},
    {"hf"},
    {"eval"},
    {"launch"},  # jobs and launchers (local, slurm): starts the trainer and the evaluation as programs
    {"study"},  # reads training configs, runs the trainer, reports the study's evaluations
    {"cli"},
))
"""Units (a top-level module or a subpackage) from the bottom up; an import may only name a unit
of its own layer or one below."""


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return module_graph(ROOT)


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``edges`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_between_modules(graph):
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_import_circle_between_packages(graph):
    units = unit_graph(graph)
    assert _cycle(units) is None, " -> ".join(_cycle(units))


def test_every_import_runs_down_the_layers(graph):
    layer_of = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    units = {unit(m) for m in graph} - {""}
    assert units <= layer_of.keys(), f"place {sorted(units - layer_of.keys())} in LAYERS (and docs/design.md)"
    upward = [f"{module} -> {imported}" for module, targets in sorted(graph.items()) for imported in sorted(targets)
              if unit(module) and unit(imported) and layer_of[unit(imported)] > layer_of[unit(module)]]
    assert not upward, "imports running up the layers:\n" + "\n".join(upward)


def test_objectives_are_reached_through_the_package(graph):
    """Outside ``objectives/`` the package imports ``megatron_ext.objectives`` (its registry and
    base types), never one objective's module; inside, an objective's module imports ``base``, the
    word tables of ``words`` and at most the objective it varies (``mlm``). Adding an objective then
    touches the package alone."""
    inside = {m for m in graph if unit(m) == "objectives"}
    reaching_in = [f"{module} -> {imported}" for module, targets in sorted(graph.items()) if module not in inside
                   for imported in sorted(targets & inside) if imported != f"{PACKAGE}.objectives"]
    assert not reaching_in, "import megatron_ext.objectives instead:\n" + "\n".join(reaching_in)
    allowed = {f"{PACKAGE}.objectives.base", f"{PACKAGE}.objectives.mlm", f"{PACKAGE}.objectives.words"}
    objective_modules = inside - {f"{PACKAGE}.objectives", *allowed}
    assert objective_modules >= {f"{PACKAGE}.objectives.{name}" for name in ("clm", "whole_word", "span", "mntp")}
    crossing = [f"{module} -> {imported}" for module in sorted(objective_modules)
                for imported in sorted(graph[module] & inside - allowed)]
    assert not crossing, "objectives importing each other:\n" + "\n".join(crossing)


def test_the_checker_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


SCHEDULER_COMMANDS = re.compile(r"\b(sbatch|squeue|scontrol|sacct|scancel|srun)\b")


def _code_strings(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module that are not documentation (a string statement: a module's,
    class's or function's docstring, or an attribute's below it)."""
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def test_only_the_launch_layer_runs_scheduler_commands():
    """SLURM's commands (and flags named after them) appear in the code of ``megatron_ext/launch/``
    only: a scheduler is one launcher module, not a branch elsewhere (docstrings may name them)."""
    found = []
    for name, path in modules(ROOT).items():
        if name.startswith(f"{PACKAGE}.launch"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)] + \
                [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
        for text in [c.value for c in _code_strings(tree)] + names:
            if SCHEDULER_COMMANDS.search(text):
                found.append(f"{path.relative_to(ROOT)}: {text[:80]!r}")
    assert not found, "\n".join(found)
