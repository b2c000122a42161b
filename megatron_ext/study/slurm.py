"""The SLURM executor: one job per segment, each waiting for its parent's job.

Each segment is submitted as ``sbatch --parsable examples/launch/slurm.sbatch`` with ``RECIPE`` =
its recipe, the job name ``<study>.<run>``, its output in ``logs/<run>-<job id>.out``, and, while
its parent is not complete, ``--dependency=afterok:<the parent's job>``: a branch or a continued
pretraining starts once its parent's job has ended successfully. ``--kill-on-invalid-dep=yes``:
when a parent's job fails, SLURM cancels the jobs waiting on it (and theirs), so a failure stops
its descendants only. The launch script requeues its job when the trainer stops resumably (a time
limit's warning, preemption), so a job ends COMPLETED once its run is complete.

sbatch flags, in this order (a later one wins): the study's ``sbatch:``, the size's ``sbatch:``
(its resources), then the command line's ``--sbatch-arg``. The environment of the executor is the
jobs' (sbatch exports it), with ``RECIPE``, ``REPO_DIR`` and ``PYTHON`` (``$PYTHON``, else this
Python) set; the jobs run in the executor's working directory (the submission directory).

The jobs submitted for each run are kept in ``jobs.json`` (newest last). Rerunning the command
looks at each segment's newest job (``squeue``) and checkpoint: complete segments are skipped,
pending and running jobs are left alone, and a segment whose job failed or was cancelled, or that
never had one, is submitted again, with its descendants: a pending descendant still waiting on the
old job is cancelled and submitted again after the new one.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_ext import processes
from megatron_ext.config_loading import UserError
from megatron_ext.fileio import write_atomic
from megatron_ext.study.execute import (
    job_environment,
    Progress,
    SegmentState,
    StudyDir,
    checkpoint_state,
    failed_ancestor,
    format_status,
    log_tail,
    repository_file,
    say,
    steps_left,
    tree_order,
)
from megatron_ext.study.plan import Segment, StudyPlan
from megatron_ext.study.spec import check_sbatch_flags
from megatron_ext.training.stop import RESUMABLE_EXIT_CODE

RUNNING_STATES = {"RUNNING", "CONFIGURING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING"}
"""``squeue`` states of a job that has started (and not ended)."""

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                "REVOKED"}
"""States of a job that has ended; any other state is a pending one (PENDING, REQUEUED,
REQUEUE_HOLD, SUSPENDED, ...). PREEMPTED and NODE_FAIL are not final here: the launch scripts'
jobs (``--requeue``) are pending again right after, and a rerun must not submit a second job on
the same save directory meanwhile; one that is not requeued leaves ``squeue`` after ``MinJobAge``
and is then seen as failed."""

NEVER_SATISFIED = "DependencyNeverSatisfied"
"""``squeue``'s reason for a job whose dependency failed."""


@dataclass(frozen=True, kw_only=True)
class SlurmOptions:
    """How the SLURM executor submits and follows jobs."""

    sbatch_args: tuple[str, ...] = ()
    """sbatch flags for every job, after the study's and the size's (``--sbatch-arg``)."""
    wait: bool = False
    """Follow the jobs until none is pending or running."""
    poll_interval: float = 30.0
    """Seconds between looks at the queue while following."""

    def __post_init__(self) -> None:
        try:
            check_sbatch_flags(self.sbatch_args, "--sbatch-arg")
        except ValueError as err:
            raise UserError(f"{err} (e.g. --sbatch-arg=--partition=gpu)") from None
        if self.poll_interval <= 0:
            raise UserError(f"--poll-interval: expected seconds > 0, got {self.poll_interval}")


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    """One job submitted for a run."""

    job_id: int
    submitted: str
    """When (ISO 8601, local time)."""
    after: int | None
    """The parent's job it waits for (``--dependency=afterok``); None: none."""


@dataclass(frozen=True, kw_only=True)
class QueuedJob:
    """A job as ``squeue`` reports it."""

    state: str
    reason: str


def _command(argv: list[str], *, env: dict[str, str] | None = None, attempts: int = 3) -> str:
    """Run a SLURM client command; its stdout. Retried: a client on a busy login node can lose its
    connection to slurmctld."""
    for attempt in range(attempts):
        try:
            result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        except FileNotFoundError:
            raise UserError(f"{argv[0]}: command not found; the slurm executor needs SLURM's client commands "
                            "(sbatch, squeue, scancel)") from None
        if result.returncode == 0:
            return result.stdout
        if attempt == attempts - 1 or argv[0] == "sbatch":  # a refused submission is not retried
            message = result.stderr.strip().replace("\n", "; ") or f"exit code {result.returncode}"
            raise UserError(f"{' '.join(argv)}: {message}")
        time.sleep(2)
    raise AssertionError("unreachable")


def submit(argv: list[str], *, env: dict[str, str], what: str) -> int:
    """Run ``sbatch --parsable ...``; the job id it prints."""
    output = _command(argv, env=env).strip()
    try:
        return int(output.split(";")[0])
    except ValueError:
        raise UserError(f"sbatch for {what}: expected a job id (--parsable), got {output!r}") from None


def queued_jobs() -> dict[int, QueuedJob]:
    """This user's jobs that slurmctld still knows (ended ones for ``MinJobAge``), by id."""
    jobs = {}
    for line in _command(["squeue", "--me", "--states=all", "--noheader", "--format=%i|%T|%r"]).splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if job.isdigit():
            jobs[int(job)] = QueuedJob(state=state, reason=reason)
    return jobs


class JobsFile:
    """``jobs.json``: the jobs submitted for each run, newest last (written atomically)."""

    def __init__(self, path: Path, study: str):
        self.path = path
        self.study = study
        self.runs: dict[str, list[JobRecord]] = {}
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                self.runs = {run: [JobRecord(**record) for record in records]
                             for run, records in data["runs"].items()}
            except (ValueError, KeyError, TypeError) as err:
                raise UserError(f"{path}: not a jobs file of run_study.py ({err}); "
                                "move it away to start afresh") from None

    def latest(self, run: str) -> JobRecord | None:
        records = self.runs.get(run)
        return records[-1] if records else None

    def add(self, run: str, record: JobRecord) -> None:
        self.runs.setdefault(run, []).append(record)
        runs = {run: [asdict(record) for record in records] for run, records in self.runs.items()}
        data = {"study": self.study, "runs": runs}
        write_atomic(self.path, json.dumps(data, indent=1) + "\n")


class SlurmExecutor:
    """Submits and follows the selected segments of ``plan`` (see the module docstring)."""

    def __init__(self, plan: StudyPlan, study_dir: StudyDir, selected: set[str], options: SlurmOptions, *,
                 out: Callable[[str], None] = say):
        self.plan = plan
        self.study_dir = study_dir
        self.selected = selected
        self.options = options
        self.out = out
        self.jobs = JobsFile(study_dir.jobs_json, plan.study.name)
        self.order = [s for s in tree_order(plan) if s.run in selected]
        self.stop_signal: str | None = None

    # -- status -------------------------------------------------------------------------------------

    def job_log(self, run: str, job_id: int) -> Path:
        return self.study_dir.logs / f"{run}-{job_id}.out"

    def states(self) -> dict[str, SegmentState]:
        """Every segment's state from its newest job and its checkpoints (the queue is read first,
        so a job that ends meanwhile is seen with its checkpoint)."""
        queue = queued_jobs()
        states: dict[str, SegmentState] = {}
        for segment in tree_order(self.plan):
            states[segment.run] = self._state(segment, queue, states)
        return states

    def _state(self, segment: Segment, queue: dict[int, QueuedJob],
               states: dict[str, SegmentState]) -> SegmentState:
        record = self.jobs.latest(segment.run)
        job = queue.get(record.job_id) if record else None
        failed = failed_ancestor(self.plan, segment.run, states)
        if job is not None and job.state not in FINAL_STATES:
            if job.state in RUNNING_STATES:
                return SegmentState(status="running", detail=f"job {record.job_id}")
            if failed is not None or job.reason == NEVER_SATISFIED:
                return SegmentState(status="blocked", detail=f"job {record.job_id} waits on a failed job"
                                    + (f" ({failed})" if failed else ""))
            reason = f" ({job.reason})" if job.reason not in ("", "None") else ""
            return SegmentState(status="pending", detail=f"job {record.job_id}{reason}")
        done = checkpoint_state(self.plan, segment)
        if done.status == "complete":
            return SegmentState(status="complete", detail=f"job {record.job_id}" if record else "")
        if failed is not None:
            return SegmentState(status="blocked", detail=f"{failed} failed")
        if record is not None:
            ended = job.state if job is not None else "ended (no longer in squeue)"
            return SegmentState(status="failed", detail=f"job {record.job_id} {ended}, log "
                                f"{self.job_log(segment.run, record.job_id)}")
        return done

    def table(self, states: dict[str, SegmentState]) -> str:
        return format_status(self.plan, self.study_dir, states, selected=self.selected, executor="slurm")

    # -- submission ---------------------------------------------------------------------------------

    def sbatch_command(self, segment: Segment, after: int | str | None) -> tuple[list[str], dict[str, str]]:
        """The sbatch command line of ``segment`` (waiting for job ``after``), and the environment it adds."""
        run = self.plan.run(segment.run)
        size = next(s for s in self.plan.study.sizes if s.name == run.size)
        argv = ["sbatch", "--parsable", f"--job-name={self.plan.study.name}.{run.name}",
                f"--output={self.study_dir.logs.resolve() / run.name}-%j.out",
                *self.plan.study.sbatch, *size.sbatch, *self.options.sbatch_args, "--kill-on-invalid-dep=yes"]
        if after is not None:
            argv.append(f"--dependency=afterok:{after}")
        argv.append(str(repository_file("examples/launch/slurm.sbatch")))
        env = {"RECIPE": str(self.study_dir.recipe(run.name).resolve()), **job_environment()}
        return argv, env

    def _submit(self, segment: Segment, after: int | None) -> int:
        argv, env = self.sbatch_command(segment, after)
        self.study_dir.logs.mkdir(parents=True, exist_ok=True)
        job_id = submit(argv, env={**os.environ, **env}, what=segment.run)
        self.jobs.add(segment.run, JobRecord(job_id=job_id, submitted=datetime.datetime.now().isoformat(
            timespec="seconds"), after=after))
        return job_id

    def submit(self, states: dict[str, SegmentState], *, dry_run: bool) -> None:
        """Submit every selected segment that is neither complete nor queued (module docstring)."""
        queue = queued_jobs()
        waiting_on: dict[str, int | str] = {}  # run -> the job that completes it (dry run: a placeholder)
        resubmitted: set[str] = set()
        for segment in self.order:
            if states[segment.run].status == "complete":
                continue
            record = self.jobs.latest(segment.run)
            job = queue.get(record.job_id) if record else None
            if job is not None and job.state not in FINAL_STATES:
                stale = job.state not in RUNNING_STATES and (
                    segment.parent in resubmitted or job.reason == NEVER_SATISFIED)
                if not stale:
                    waiting_on[segment.run] = record.job_id
                    continue
                if dry_run:
                    self.out(f"would cancel job {record.job_id} of {segment.run} (it waits on a failed job)")
                else:
                    _command(["scancel", str(record.job_id)])
                    self.out(f"cancelled job {record.job_id} of {segment.run}: it waited on a failed job")
            after = None
            if segment.parent is not None and states[segment.parent].status != "complete":
                after = waiting_on[segment.parent]  # the parent came first in tree order
            if dry_run:
                argv, env = self.sbatch_command(segment, after)
                self.out(f"  RECIPE={env['RECIPE']} {' '.join(argv)}")
                waiting_on[segment.run] = f"<job of {segment.run}>"
            else:
                job_id = self._submit(segment, after)
                self.out(f"submitted {segment.run}: job {job_id}" + (f", after job {after}" if after else ""))
                waiting_on[segment.run] = job_id
            resubmitted.add(segment.run)

    # -- the command --------------------------------------------------------------------------------

    def run(self, *, dry_run: bool) -> int:
        """0: submitted (``wait``: every selected segment complete); 1 (``wait``): a segment failed or
        is blocked; 75: stopped following on a signal (the jobs go on). Unless ``dry_run``, the
        caller holds the study directory's lock."""
        states = self.states()
        self.out(self.table(states))
        if all(states[r].status == "complete" for r in self.selected):
            self.out("nothing to submit: every selected segment is complete")
            return 0
        if dry_run:
            self.out("would submit (in the working directory; <job of X>: the job id X gets):")
            self.submit(states, dry_run=True)
            return 0
        self.submit(states, dry_run=False)
        states = self.states()
        self.out(self.table(states))
        if not self.options.wait:
            return 0
        with processes.signal_handlers((signal.SIGINT, signal.SIGTERM), self._on_signal):
            states = self._follow(states)
        self.out(self.table(states))
        if self.stop_signal is not None:
            self.out(f"stopped following on {self.stop_signal}; the jobs go on: "
                     "run the same command to follow them")
            return RESUMABLE_EXIT_CODE
        return 0 if all(states[r].status == "complete" for r in self.selected) else 1

    def _on_signal(self, signum: int, frame) -> None:
        self.stop_signal = signal.Signals(signum).name

    def _follow(self, states: dict[str, SegmentState]) -> dict[str, SegmentState]:
        """Print each change of a selected segment's state until none is pending or running."""
        progress = Progress({s.run: steps_left(self.plan, s) for s in self.order
                             if states[s.run].status in ("pending", "running")})
        while any(states[r].status in ("pending", "running") for r in self.selected):
            deadline = time.monotonic() + self.options.poll_interval
            while time.monotonic() < deadline and self.stop_signal is None:
                time.sleep(min(1.0, self.options.poll_interval))
            if self.stop_signal is not None:
                break
            current = self.states()
            for segment in self.order:
                old, new = states[segment.run], current[segment.run]
                if old.status == new.status:
                    continue
                line = f"{time.strftime('%H:%M:%S')} {segment.run}: {old.status} -> {new}"
                if segment.run in progress.steps and new.status == "complete":
                    progress.finish(segment.run)
                    line += f" | {progress.summary()}"
                elif segment.run in progress.steps and new.status in ("failed", "blocked"):
                    progress.drop(segment.run)
                self.out(line)
                record = self.jobs.latest(segment.run)
                tail = log_tail(self.job_log(segment.run, record.job_id)) if record is not None else ""
                if new.status == "failed" and tail:
                    self.out(tail)
            states = current
        return states
