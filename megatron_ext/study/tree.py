"""The tree scheduler: a study's segments as jobs of any launcher, a parent's before its children's.

Each selected segment that is not complete becomes one trainer job (:meth:`TreeScheduler.job`):
``python -m megatron_ext.cli.pretrain_encoder --config <study dir>/recipes/<run>.yaml``, named ``<study>.<run>``, logging to
``<study dir>/logs/<run>``, with the resources of its size over the study's. It waits for its
parent's job while the parent is not complete (a branch or a continued pretraining starts once
its parent has ended successfully; a parent that fails cancels it). The launcher decides where
and when jobs run: the local one runs them here one after another, the SLURM one queues them.

What is done is known from the checkpoints (a segment is complete when the newest complete
checkpoint in its run's ``checkpoint.save`` is at ``train_iters``) and from the jobs: those of
this process, and for launchers whose jobs outlive it, the ones kept in ``jobs.json`` (newest
last). Rerunning the command skips complete segments, leaves pending and running jobs alone, and
submits again a segment whose job failed, was cancelled, or that never had one, with its
descendants: a pending descendant still waiting on the old job is cancelled and submitted again
after the new one.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.fileio import write_atomic
from megatron_ext.launch import TRAINER, Job, JobEvents, JobState, Launcher
from megatron_ext.study.state import (
    Progress,
    SegmentState,
    StudyDir,
    checkpoint_state,
    failed_ancestor,
    first_step,
    format_status,
    log_tail,
    say,
    saved_step,
    steps_left,
    tree_order,
)
from megatron_ext.study.plan import Segment, StudyPlan
from megatron_ext.progress import duration
from megatron_ext.exit_codes import RESUMABLE_EXIT_CODE


def stored_id(job_id: str) -> int | str:
    """A job id as the jobs files keep it (a number where it is one)."""
    return int(job_id) if job_id.isdigit() else job_id


@dataclass(frozen=True, kw_only=True)
class SubmittedJob:
    """One job submitted for a run."""

    job_id: int | str
    submitted: str
    """When (ISO 8601, local time)."""
    after: int | str | None
    """The parent's job it waits for; None: none."""


class JobsFile:
    """``jobs.json``: the jobs submitted for each run, newest last (written atomically)."""

    def __init__(self, path: Path, study: str):
        self.path = path
        self.study = study
        self.runs: dict[str, list[SubmittedJob]] = {}
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                self.runs = {run: [SubmittedJob(**record) for record in records]
                             for run, records in data["runs"].items()}
            except (ValueError, KeyError, TypeError) as err:
                raise UserError(f"{path}: not a jobs file of run_study.py ({err}); "
                                "move it away to start afresh") from None

    def latest(self, run: str) -> SubmittedJob | None:
        records = self.runs.get(run)
        return records[-1] if records else None

    def add(self, run: str, record: SubmittedJob) -> None:
        self.runs.setdefault(run, []).append(record)
        runs = {run: [asdict(record) for record in records] for run, records in self.runs.items()}
        write_atomic(self.path, json.dumps({"study": self.study, "runs": runs}, indent=1) + "\n")


class TreeScheduler(JobEvents):
    """Submits and follows the selected segments of ``plan`` through ``launcher`` (module docstring)."""

    def __init__(self, plan: StudyPlan, study_dir: StudyDir, selected: set[str], launcher: Launcher, *,
                 out: Callable[[str], None] = say,
                 estimate_seconds: Callable[[list[Segment]], dict[str, float] | None] | None = None):
        # estimate_seconds: each segment's estimated seconds left (study.cost.seconds_left), for the
        # ETA of launchers that run the jobs in turn; None: the ETA from the pace so far.
        self.estimate_seconds = estimate_seconds
        self.plan = plan
        self.study_dir = study_dir
        self.selected = selected
        self.launcher = launcher
        self.out = out
        self.jobs = JobsFile(study_dir.jobs_json, plan.study.name) if launcher.persistent else None
        self.order = [s for s in tree_order(plan) if s.run in selected]
        self.job_ids: dict[str, str] = {}
        """Each run's newest job: this process's, else (persistent launchers) the jobs file's."""
        if self.jobs is not None:
            self.job_ids = {run: str(records[-1].job_id) for run, records in self.jobs.runs.items() if records}
        self.job_states: dict[str, JobState] = {}
        self.current: dict[str, SegmentState] = {}
        self.progress = Progress({})
        self._runs: dict[str, str] = {}  # job id -> run
        self._submitted: dict[str, Job] = {}  # job id -> the Job this process submitted under it
        self._tags: dict[str, str] = {}
        self._started: dict[str, float] = {}
        self._this_start: dict[str, float] = {}

    # -- jobs and states ----------------------------------------------------------------------------

    def job(self, segment: Segment) -> Job:
        run = self.plan.run(segment.run)
        size = next(s for s in self.plan.study.sizes if s.name == run.size)
        return Job(name=f"{self.plan.study.name}.{run.name}", module=TRAINER,
                   args=("--config", str(self.study_dir.recipe(run.name).absolute())),
                   log=self.study_dir.logs / run.name, resources=size.resources.over(self.plan.study.resources),
                   per_gpu=True, progress=lambda: saved_step(run))

    def states(self) -> dict[str, SegmentState]:
        """Every segment's state from its newest job and its checkpoints (the jobs are looked at
        first, so a job that ends meanwhile is seen with its checkpoint)."""
        self.job_states = {}
        if self.job_ids:
            by_id = self.launcher.states(list(self.job_ids.values()))
            self.job_states = {run: by_id[job_id] for run, job_id in self.job_ids.items()}
        states: dict[str, SegmentState] = {}
        for segment in tree_order(self.plan):
            states[segment.run] = self._state(segment, states)
        self.current = states
        return states

    def _label(self, run: str) -> str:
        return f"job {self.job_ids[run]}" if self.launcher.persistent and run in self.job_ids else ""

    def _state(self, segment: Segment, states: dict[str, SegmentState]) -> SegmentState:
        run, label = segment.run, self._label(segment.run)
        job = self.job_states.get(run)
        failed = failed_ancestor(self.plan, run, states)
        if job is not None and job.status == "running":
            return SegmentState(status="running", detail=label)
        if job is not None and job.status == "pending":
            if failed is not None or job.never_runs:
                return SegmentState(status="blocked", detail=f"{label} waits on a failed job".strip()
                                    + (f" ({failed})" if failed else ""))
            return SegmentState(status="pending", detail=f"{label} {job.detail}".strip())
        done = checkpoint_state(self.plan, segment)
        if done.status == "complete":
            return SegmentState(status="complete", detail=label)
        if failed is not None:
            return SegmentState(status="blocked", detail=f"{failed} failed")
        if job is None or (job.stopped and job.exit_code is None):  # none, or one that never started
            return done
        if job.stopped:
            saved = saved_step(self.plan.run(run))
            at = f"; resumes at step {saved:,}" if saved is not None else ""
            return SegmentState(status="to do", detail=f"stopped ({job.detail}){at}")
        detail = f"{label} {job.detail}".strip()
        if job.succeeded:
            train_iters = self.plan.run(run).train_iters
            detail += f", but its newest checkpoint is at step {saved_step(self.plan.run(run))}, not {train_iters}"
        log = job.log or self._log_file(self.job_ids[run])
        return SegmentState(status="failed", detail=f"{detail}; log {log}")

    def table(self, states: dict[str, SegmentState]) -> str:
        return format_status(self.plan, self.study_dir, states, selected=self.selected, launcher=self.launcher.name)

    def live_job(self, run: str) -> str | None:
        """``run``'s newest job while it is pending or running (at the last look), else None."""
        state = self.job_states.get(run)
        return self.job_ids[run] if state is not None and state.live else None

    def live_jobs(self) -> list[str]:
        """The jobs of the selected segments still pending or running (at the last look)."""
        return [self.job_ids[s.run] for s in self.order if s.run in self.job_states and self.job_states[s.run].live]

    # -- submission ---------------------------------------------------------------------------------

    def submit(self, states: dict[str, SegmentState], *, dry_run: bool) -> None:
        """Submit every selected segment that is neither complete nor queued (module docstring)."""
        waiting_on: dict[str, str] = {}  # run -> the job that completes it (dry run: a placeholder)
        resubmitted: set[str] = set()
        submitted = []
        for segment in self.order:
            run = segment.run
            if states[run].status == "complete":
                continue
            job = self.job_states.get(run)
            if job is not None and job.live:
                stale = job.status != "running" and (segment.parent in resubmitted or job.never_runs)
                if not stale:
                    waiting_on[run] = self.job_ids[run]
                    continue
                if dry_run:
                    self.out(f"would cancel job {self.job_ids[run]} of {run} (it waits on a failed job)")
                else:
                    self.launcher.stop(self.job_ids[run])
                    self.out(f"cancelled job {self.job_ids[run]} of {run}: it waited on a failed job")
            after = []
            if segment.parent is not None and states[segment.parent].status != "complete":
                after = [waiting_on[segment.parent]]  # the parent came first in tree order
            if dry_run:
                self.out(f"  {self.launcher.describe(self.job(segment), after)}")
                waiting_on[run] = f"<job of {run}>"
            else:
                new_job = self.job(segment)
                job_id = self.launcher.submit(new_job, after)
                self.job_ids[run], self.job_states[run], self._runs[job_id] = job_id, JobState(status="pending"), run
                self._submitted[job_id] = new_job
                submitted.append(job_id)
                if self.jobs is not None:
                    self.jobs.add(run, SubmittedJob(job_id=stored_id(job_id), submitted=datetime.datetime.now().isoformat(
                        timespec="seconds"), after=stored_id(after[0]) if after else None))
                    self.out(f"submitted {run}: job {job_id}" + (f", after job {after[0]}" if after else ""))
                waiting_on[run] = job_id
            resubmitted.add(run)
        self._tags = {job_id: f"[{i}/{len(submitted)}] {self._runs[job_id]}" for i, job_id in enumerate(submitted, 1)}

    # -- the command --------------------------------------------------------------------------------

    def run(self, *, dry_run: bool) -> int:
        """0: every selected segment complete (a launcher that does not follow: submitted); 1: a
        segment failed or is blocked; 75: stopped on a signal (rerun to continue). Unless
        ``dry_run``, the caller holds the study directory's lock."""
        states = self.states()
        self.out(self.table(states))
        if all(states[r].status == "complete" for r in self.selected):
            self.out("nothing to run: every selected segment is complete")
            return 0
        if dry_run:
            self.out("would submit, in this order (in the working directory; <job of X>: the job X gets):")
            self.submit(states, dry_run=True)
            return 0
        self.submit(states, dry_run=False)
        if self.launcher.persistent:
            states = self.states()
            self.out(self.table(states))
        if not self.launcher.follows:
            return 0
        following = self.live_jobs()
        runs = [self._run_of(job_id) for job_id in following]
        estimates = None
        if self.estimate_seconds is not None and self.launcher.one_job_at_a_time:  # a sum holds only in turn
            estimates = self.estimate_seconds([self.plan.segment(run) for run in runs])
        self.progress = Progress({run: steps_left(self.plan, self.plan.segment(run)) for run in runs}, estimates)
        stopped = self.launcher.follow(following, self)
        states = self.states()
        self.out(self.table(states))
        if stopped is not None:
            self.out(f"stopped following on {stopped}; the jobs go on: run the same command to follow them"
                     if self.launcher.persistent else f"stopped on {stopped}: run the same command to continue")
            return RESUMABLE_EXIT_CODE
        return 0 if all(states[r].status == "complete" for r in self.selected) else 1

    def _log_file(self, job_id: str) -> Path:
        """The log of ``job_id``: of the Job submitted under it, or (a job of an earlier process, read from
        the jobs file) of the Job its run's segment makes, which names the same files."""
        job = self._submitted.get(job_id) or self.job(self.plan.segment(self._run_of(job_id)))
        return self.launcher.log_file(job, job_id)

    def _run_of(self, job_id: str) -> str:
        if job_id not in self._runs:
            self._runs.update({j: run for run, j in self.job_ids.items()})
        return self._runs[job_id]

    # -- what the launcher tells (JobEvents) ----------------------------------------------------------

    def started(self, job_id: str) -> None:
        run = self.plan.run(self._run_of(job_id))
        self._started.setdefault(job_id, time.monotonic())
        self._this_start[job_id] = time.monotonic()
        segment = self.plan.segment(run.name)
        self.out(f"{self._tags[job_id]}: training steps {first_step(segment, run, saved_step(run)):,} to "
                 f"{run.train_iters:,} (log {self._log_file(job_id)})")

    def tick(self, job_id: str) -> None:
        run = self.plan.run(self._run_of(job_id))
        step = _last_logged_step(Path(run.config.logging.log_dir) / "metrics.jsonl")
        where = f"step {step:,}/{run.train_iters:,}" if step is not None else "starting"
        running = duration(time.monotonic() - self._this_start[job_id])
        self.out(f"{self._tags[job_id]}: {where}, running for {running} | {self.progress.summary()}")

    def stopping(self, job_id: str, signal_name: str) -> None:
        self.out(f"{signal_name} received: {self._run_of(job_id)} saves its step in flight and stops; "
                 "the study stops after it")

    def restarted(self, job_id: str, state: JobState) -> None:
        self.out(f"{self._tags[job_id]}: the trainer stopped by itself ({state.detail}); resuming it")

    def ended(self, job_id: str, state: JobState) -> None:
        run = self._run_of(job_id)
        self.job_states[run] = state
        new = self._state(self.plan.segment(run), self.current)
        self.current[run] = new
        tag = self._tags[job_id]
        if new.status == "complete":
            seconds = time.monotonic() - self._started.get(job_id, time.monotonic())
            self.progress.finish(run, seconds)
            took = duration(seconds)
            self.out(f"{tag}: complete in {took} | {self.progress.summary()}")
        elif new.status == "failed":
            self.progress.drop(run)
            log = state.log or self._log_file(job_id)
            self.out(f"{tag}: FAILED ({new.detail}); the last lines of its log:\n" + log_tail(log))
        elif new.status == "blocked":
            self.progress.drop(run)
            self.out(f"{tag}: blocked ({new.detail})")

    def poll(self) -> None:
        """Print each change of a selected segment's state."""
        old = self.current
        current = self.states()
        for segment in self.order:
            before, after = old[segment.run], current[segment.run]
            if before.status == after.status:
                continue
            line = f"{time.strftime('%H:%M:%S')} {segment.run}: {before.status} -> {after}"
            if segment.run in self.progress.steps and after.status == "complete":
                self.progress.finish(segment.run)
                line += f" | {self.progress.summary()}"
            elif segment.run in self.progress.steps and after.status in ("failed", "blocked"):
                self.progress.drop(segment.run)
            self.out(line)
            if after.status == "failed" and segment.run in self.job_ids:
                tail = log_tail(self._log_file(self.job_ids[segment.run]))
                if tail:
                    self.out(tail)


def _last_logged_step(path: Path) -> int | None:
    """The step of the newest train record in a ``metrics.jsonl`` (None: none yet)."""
    if not path.is_file():
        return None
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - 8192))
        lines = handle.read().decode("utf-8", errors="replace").splitlines()
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "train":
            return int(record["step"])
    return None
