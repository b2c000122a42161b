"""What a GPU visit runs: first what can still move a default or a target, then a known side only
when its code or the device kind changed since it was last timed.

GPU time is rare (minutes per visit, often none), so ``benchmarks/gpu_suite.py``'s default plan does
not re-time an answer the committed visits already hold. This module decides, from the committed
visit folders (``benchmarks/results/gpu_visits/<kind>-<date>/``, read by ``benchmarks.gpu_visits.
read_visits``) and the tree the suite runs from, with no git (a GPU machine gets a copy of the tree
without its history) and no torch (the suite's own process stays light):

- **Known sides** (``KNOWN_SIDES``: the Hugging Face baseline, the local spec, CUDA graphs, whose
  answers were stable over visits): re-measured when no visit on this device kind timed the side at
  the 1B row, or when the side's code changed since that visit. "Its code" is a fingerprint over the
  files and functions it runs (``KnownSide.sources``); each visit records the fingerprints of the tree
  it ran (``fingerprints.json`` in its folder, written by the suite; for visits before 2026-11-28
  backfilled from their commit with ``python -m benchmarks.visit_plan --backfill VISIT_DIR``).
- **gpu tests**: those not yet passed on this device kind (read from the visits' ``gpu_check_*.json``);
  a test whose file changed is not exempt by an old pass only if its node id changed, so a visit with
  time runs ``gpu_tests`` (all of them) with ``--stages``.

    python -m benchmarks.visit_plan --kind h100          # what the next H100 visit would re-measure
    python -m benchmarks.visit_plan --backfill benchmarks/results/gpu_visits/h100-2026-11-27
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from benchmarks.gpu_visits import FINGERPRINTS_FILE, GpuVisit, ThroughputSide, read_visit, read_visits
from megatron_ext.config_loading import UserError
VISITS_DIR = REPO / "benchmarks" / "results" / "gpu_visits"
KNOWN_ROW = "1b seq 2048 bf16"
"""The row whose known sides the plan tracks (the one every visit times first)."""

@dataclasses.dataclass(frozen=True, kw_only=True)
class KnownSide:
    """A throughput side whose answer a visit already holds: what it runs that the recipe's own
    side does not. (What every side runs, the engine and the step, moves the recipe's side too, which
    every visit times: a known side is re-timed when what only it runs changes, or the device kind.)"""

    name: str
    """The side's name in ``throughput.py`` (``hf``, or a variant of ``throughput.VARIANTS``)."""
    settings: dict
    """How a recorded side is recognised whatever it was called then (a visit's default side ran the
    local spec before 2026-11-27): its ``settings`` as ``throughput.describe`` records them; ``hf``: none."""
    sources: tuple[str, ...]
    """Files (``path``) and top-level definitions (``path::name``) whose text makes the side's own code."""


KNOWN_SIDES = {side.name: side for side in (
    KnownSide(name="hf", settings={}, sources=("benchmarks/throughput.py::hf_model",
                                               "benchmarks/throughput.py::HF_MICRO_BATCH_80GB", "requirements.txt")),
    KnownSide(name="local_spec", settings={"transformer_impl": "local", "cuda_graphs": "none"},
              sources=("megatron_ext/model/spec.py", "megatron_ext/model/attention.py")),
    KnownSide(name="local_spec_cuda_graphs", settings={"transformer_impl": "local", "cuda_graphs": "megatron"},
              sources=("megatron_ext/model/spec.py", "megatron_ext/model/attention.py",
                       "megatron_ext/training/cuda_graphs.py")),
    KnownSide(name="te_spec_cuda_graphs", settings={"transformer_impl": "te", "cuda_graphs": "megatron"},
              sources=("megatron_ext/training/cuda_graphs.py",)),
)}


def _definition_text(source: str, name: str) -> str | None:
    """The text of the top-level function, class or assignment ``name`` in ``source``."""
    tree = ast.parse(source)
    for node in tree.body:
        names = ([node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else
                 [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)])
        if name in names:
            return ast.get_source_segment(source, node)
    return None


def _code_only(python: str) -> str:
    """Python source as its syntax tree without docstrings: comments and docs change no timing."""
    tree = ast.parse(python)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def fingerprint(side: KnownSide, read: Callable[[str], str | None]) -> str:
    """sha256 over the side's sources as ``read(path)`` gives them (Python without its comments and
    docstrings; a missing source counts as absent)."""
    digest = hashlib.sha256()
    for source in side.sources:
        path, _, name = source.partition("::")
        text = read(path)
        if text is not None and name:
            text = _definition_text(text, name)
        if text is not None and path.endswith(".py"):
            text = _code_only(text)
        digest.update(f"{source}\0{text if text is not None else '<absent>'}\0".encode())
    return digest.hexdigest()[:16]


def _read_tree(root: Path) -> Callable[[str], str | None]:
    def read(path: str) -> str | None:
        try:
            return (root / path).read_text()
        except OSError:
            return None
    return read


def _read_commit(commit: str, root: Path = REPO) -> Callable[[str], str | None]:
    def read(path: str) -> str | None:
        out = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=root, capture_output=True, text=True)
        return out.stdout if out.returncode == 0 else None
    return read


def tree_fingerprints(root: Path = REPO) -> dict[str, str]:
    """Every known side's fingerprint in the tree at ``root`` (what a visit records of itself)."""
    return {name: fingerprint(side, _read_tree(root)) for name, side in KNOWN_SIDES.items()}


def _known_name(record: ThroughputSide) -> str | None:
    if record.side == "hf":
        return "hf"
    if not record.settings:  # recorded before sides carried their settings: the variant's name says it
        return record.side if record.side in KNOWN_SIDES else None
    ran = {key: record.settings.get(key) for key in ("transformer_impl", "cuda_graphs")}
    return next((name for name, side in KNOWN_SIDES.items() if side.settings and side.settings == ran), None)


def timed_sides(visit: GpuVisit) -> set[str]:
    """The known sides a visit timed with a result (not an error) on ``KNOWN_ROW``, recognised by
    their recorded settings (``KnownSide.settings``)."""
    timed = set()
    for stage in visit.stages:
        for record in stage.sides():
            if record.row == KNOWN_ROW and record.tokens_per_s and (name := _known_name(record)):
                timed.add(name)
        for row in stage.figures.get("rows") or []:
            if row.get("row") == KNOWN_ROW and row.get("hf_tokens_per_s"):
                timed.add("hf")
    return timed


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    remeasure: bool
    reason: str


def plan_known_sides(kind: str, *, visits_dir: Path = VISITS_DIR,
                     current: dict[str, str] | None = None) -> dict[str, Decision]:
    """Per known side: re-measure it on a ``kind`` GPU, and why (module docstring)."""
    current = current if current is not None else tree_fingerprints()
    decisions = {}
    visits = [v for v in read_visits(visits_dir) if v.kind == kind]  # newest first
    for name in KNOWN_SIDES:
        last = next((v for v in visits if name in timed_sides(v)), None)
        if last is None:
            decisions[name] = Decision(remeasure=True, reason=f"never timed on an {kind.upper()} at {KNOWN_ROW}")
            continue
        recorded = (last.fingerprints() or {}).get(name)
        if recorded is None:
            decisions[name] = Decision(remeasure=True, reason=f"{last.name} recorded no fingerprint of its code")
        elif recorded != current[name]:
            decisions[name] = Decision(remeasure=True, reason=f"its code changed since {last.name}")
        else:
            decisions[name] = Decision(remeasure=False, reason=f"timed in {last.name}; code unchanged since")
    return decisions


def passed_gpu_tests(kind: str, *, visits_dir: Path = VISITS_DIR) -> set[str]:
    """Node ids of the ``gpu`` tests that passed on a ``kind`` GPU in any committed visit."""
    return {test for visit in read_visits(visits_dir) if visit.kind == kind
            for stage in visit.stages if stage.runs_gpu_tests for report in stage.gpu_test_reports()
            for test in report.passed()}


def write_fingerprints(visit: Path, fingerprints: dict[str, str], *, commit: str | None, how: str) -> Path:
    path = visit / FINGERPRINTS_FILE
    path.write_text(json.dumps({"commit": commit, "how": how, "sides": fingerprints}, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default=None, help="a device kind (h100, h200): print what its next visit re-measures")
    parser.add_argument("--backfill", type=Path, default=None, metavar="VISIT_DIR",
                        help="write VISIT_DIR/fingerprints.json from the visit's commit (git show; for visits "
                             "made before the suite recorded them)")
    args = parser.parse_args(argv)
    if args.backfill is not None:
        try:
            commit = read_visit(args.backfill).commit
        except UserError as error:
            parser.error(str(error))
        if not commit:
            parser.error(f"{args.backfill}/summary.json names no commit")
        prints = {name: fingerprint(side, _read_commit(commit)) for name, side in KNOWN_SIDES.items()}
        path = write_fingerprints(args.backfill, prints, commit=commit, how=f"backfilled from git show {commit}")
        print(f"wrote {path}")
        return 0
    if args.kind is None:
        parser.error("give --kind or --backfill")
    try:
        decisions, passed = plan_known_sides(args.kind), passed_gpu_tests(args.kind)
    except UserError as error:  # a visit folder's files, named
        parser.exit(2, f"visit_plan.py: error: {error}\n")
    for name, decision in decisions.items():
        print(f"{name:24} {'re-measure' if decision.remeasure else 'skip':10} {decision.reason}")
    print(f"gpu tests already passed on {args.kind}: {len(passed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
