"""A study's state on disk: the study directory, what is left to train, and the progress it prints.

``run_study`` plans a study (:func:`megatron_ext.study.plan.plan_study`), writes the plan and one
recipe per run into the study directory (:func:`write_plan`) and hands the segments to the tree
scheduler (:mod:`megatron_ext.study.tree`), which submits them through a launcher
(:mod:`megatron_ext.launch`: ``local``, ``slurm``). It takes the segments in tree order (a parent
before its children) and knows what is done from the checkpoints: a segment is complete when the
newest complete checkpoint in its run's ``checkpoint.save`` is at the run's ``train_iters``.
Anything else is trained (again); the trainer resumes an interrupted run from its own newest
checkpoint.

The study directory (``runs/studies/<study name>`` unless given)::

    plan.json              the plan (plan_to_dict): the runs with their recipes, the segments, totals
    recipes/<run>.yaml     what ``pretrain_encoder.py --config`` reads for each run
    logs/<run>.log         the trainer's output (local launcher; every attempt appended)
    logs/<run>-<job>.out   the job's output (slurm launcher)
    jobs.json              the jobs submitted for each run, newest last (launchers whose jobs outlive it)

Paths in the recipes that are relative (the study's ``output`` templates, data paths of the base
recipes) are relative to the working directory of ``run_study``: the jobs run there (local: its
working directory; slurm: the submission directory).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.config_loading import UserError
from megatron_ext.fileio import write_atomic
from megatron_ext.study.plan import PlannedRun, Segment, StudyPlan, plan_to_dict
from megatron_ext.study.plan_text import tree_rows
from megatron_ext.progress import duration

STUDY_DIR = "runs/studies/{study}"
"""The study directory when none is given (relative to the working directory)."""

Status = Literal["complete", "running", "pending", "to do", "failed", "blocked"]

def say(line: str) -> None:
    """An output line of ``run_study``, flushed at once (its jobs write to their logs meanwhile)."""
    print(line, flush=True)


LOG_TAIL_LINES = 15
"""Lines of a failed job's log that are printed."""


@dataclass(frozen=True, kw_only=True)
class StudyDir:
    """Where ``run_study`` keeps a study's plan, recipes, logs and jobs."""

    root: Path

    @classmethod
    def for_plan(cls, plan: StudyPlan, root: str | os.PathLike | None) -> StudyDir:
        return cls(root=Path(root) if root is not None else Path(STUDY_DIR.format(study=plan.study.name)))

    @property
    def plan_json(self) -> Path:
        return self.root / "plan.json"

    @property
    def jobs_json(self) -> Path:
        return self.root / "jobs.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def recipe(self, run: str) -> Path:
        return self.root / "recipes" / f"{run}.yaml"

    def log(self, run: str) -> Path:
        return self.logs / f"{run}.log"

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Held while a ``run_study`` trains or submits, so that two never run the same segment."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "?"
                raise UserError(f"{self.root}: another run_study.py (pid {holder}) is executing this study; "
                                "wait for it to end or stop it") from None
            handle.truncate(0)
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            yield


def write_plan(plan: StudyPlan, study_dir: StudyDir) -> None:
    """``plan.json`` and one recipe per run (rewritten on every execution: the study file is the
    source; a file already holding the same bytes is rewritten with them)."""
    write_atomic(study_dir.plan_json, json.dumps(plan_to_dict(plan), indent=1) + "\n")
    for run in plan.runs:
        header = (f"# Run {run.name} of study {plan.study.name} ({plan.path}), written by "
                  "run_study:\n# edit the study file, not this recipe.\n")
        write_atomic(study_dir.recipe(run.name), header + yaml.safe_dump(run.recipe, sort_keys=False))


# -- what is done -----------------------------------------------------------------------------------


def saved_step(run: PlannedRun) -> int | None:
    """The step of the newest complete checkpoint in the run's ``checkpoint.save`` (None: none)."""
    checkpoint = Checkpoint.latest(run.recipe["checkpoint"]["save"])
    return None if checkpoint is None else checkpoint.step


def first_step(segment: Segment, run: PlannedRun, saved: int | None) -> int:
    """The step the trainer starts this segment's run from: its own newest checkpoint, else the
    branch step where its recipe branches from its parent, else 0."""
    if saved is not None:
        return saved
    if segment.start_from == "branch" and run.recipe["checkpoint"].get("branch_from"):
        return segment.branch_step
    return 0


@dataclass(frozen=True, kw_only=True)
class SegmentState:
    """A segment's status and what to say about it (a job, an exit code, a step)."""

    status: Status
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.status}: {self.detail}" if self.detail else self.status


def checkpoint_state(plan: StudyPlan, segment: Segment) -> SegmentState:
    """``complete``, or ``to do`` (saying where a partly trained run resumes)."""
    run = plan.run(segment.run)
    saved = saved_step(run)
    if saved == run.train_iters:
        return SegmentState(status="complete")
    return SegmentState(status="to do", detail=f"resumes at step {saved:,}" if saved is not None else "")


def steps_left(plan: StudyPlan, segment: Segment) -> int:
    """Steps the trainer still runs for this segment (0 when complete)."""
    run = plan.run(segment.run)
    return max(0, run.train_iters - first_step(segment, run, saved_step(run)))


# -- the tree ---------------------------------------------------------------------------------------


def tree_order(plan: StudyPlan) -> list[Segment]:
    """Every segment, parents before children (the order of the plan's tree)."""
    return [segment for _, segment in tree_rows(plan)]


def ancestors(plan: StudyPlan, run: str) -> list[str]:
    """The runs ``run``'s segment starts from, nearest first."""
    found = []
    parent = plan.segment(run).parent
    while parent is not None:
        found.append(parent)
        parent = plan.segment(parent).parent
    return found


def select_runs(plan: StudyPlan, only: Iterable[str] | None) -> set[str]:
    """The runs ``--only`` names and every run they start from (all runs when None)."""
    names = [r.name for r in plan.runs]
    if not only:
        return set(names)
    unknown = [name for name in only if name not in names]
    if unknown:
        raise UserError(f"--only: no run named {', '.join(unknown)} in study {plan.study.name}; its runs: "
                        + ", ".join(names))
    selected = set()
    for name in only:
        selected.update([name, *ancestors(plan, name)])
    return selected


def failed_ancestor(plan: StudyPlan, run: str, states: dict[str, SegmentState]) -> str | None:
    """The nearest ancestor of ``run`` that failed: ``run`` is blocked by it (None: none)."""
    for ancestor in ancestors(plan, run):
        if states[ancestor].status == "failed":
            return ancestor
    return None


def _start_label(segment: Segment) -> str:
    if segment.start_from == "scratch":
        return "scratch"
    return f"{segment.start_from} of {segment.parent} at {segment.branch_step:,}"


def format_status(plan: StudyPlan, study_dir: StudyDir, states: dict[str, SegmentState], *,
                  selected: set[str], launcher: str) -> str:
    """The status table: the tree, each segment's steps and start, and its state."""
    counts: dict[str, int] = {}
    for name in selected:
        counts[states[name].status] = counts.get(states[name].status, 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    scope = f"{len(selected)} of {len(plan.segments)} segments" if len(selected) < len(plan.segments) else \
        f"{len(plan.segments)} segments"
    lines = [f"study {plan.study.name} ({launcher}, {study_dir.root}): {scope}: {summary}"]
    rows = tree_rows(plan)
    name_width = max(len(name) for name, _ in rows) + 2
    spans = {s.run: f"[{s.start:,}, {s.end:,})" for _, s in rows}
    span_width = max(len(span) for span in spans.values()) + 2
    starts = {s.run: _start_label(s) for _, s in rows}
    start_width = max(len(start) for start in starts.values()) + 2
    lines.append(f"  {'segment':<{name_width}}{'steps':<{span_width}}{'starts from':<{start_width}}status")
    for name, segment in rows:
        state = str(states[segment.run]) if segment.run in selected else "(not selected)"
        lines.append(f"  {name:<{name_width}}{spans[segment.run]:<{span_width}}"
                     f"{starts[segment.run]:<{start_width}}{state}")
    return "\n".join(lines)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log, indented (empty when there is no log)."""
    if not path.is_file():
        return ""
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - 64 * 1024))
        text = handle.read().decode("utf-8", errors="replace")
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


class Progress:
    """The steps an execution trains: how many are done, and the ETA: the cost model's estimate of
    the segments left (``estimates``, ``study.cost.seconds_left``), scaled by the measured time
    over the estimate of the segments finished so far; without estimates, at the pace so far."""

    def __init__(self, steps: dict[str, int], estimates: dict[str, float] | None = None):
        self.steps = dict(steps)
        """Steps left in each segment to train, when the execution started."""
        self.estimates = estimates
        """The cost model's seconds for each segment's steps left (None: no speed known here)."""
        self.took: dict[str, float] = {}
        """Measured seconds of the segments finished, where known."""
        self.finished: list[str] = []
        self.dropped: list[str] = []
        self.started = time.monotonic()

    @property
    def total(self) -> int:
        return sum(n for run, n in self.steps.items() if run not in self.dropped)

    @property
    def done(self) -> int:
        return sum(self.steps[run] for run in self.finished)

    def finish(self, run: str, seconds: float | None = None) -> None:
        self.finished.append(run)
        if seconds is not None:
            self.took[run] = seconds

    def drop(self, run: str) -> None:
        """``run`` will not be trained by this execution (failed, blocked)."""
        self.dropped.append(run)

    def correction(self) -> float:
        """Measured over estimated seconds of the finished segments (1: none finished yet)."""
        estimated = sum(self.estimates[run] for run in self.took)
        return sum(self.took.values()) / estimated if estimated > 0 else 1.0

    def summary(self) -> str:
        elapsed = time.monotonic() - self.started
        segments = len(self.steps) - len(self.dropped)
        line = (f"study: {len(self.finished)}/{segments} segments, {self.done:,}/{self.total:,} steps, "
                f"elapsed {duration(elapsed)}")
        if self.estimates is not None and self.done < self.total:
            left = sum(self.estimates[run] for run in self.steps if run not in self.finished and run not in self.dropped)
            factor = self.correction()
            line += f", ETA {duration(left * factor)} (estimate" + (
                f" x{factor:.2f}, the measured pace of the segments trained)" if self.took else ")")
        elif 0 < self.done < self.total:
            line += f", ETA {duration(elapsed / self.done * (self.total - self.done))}"
        return line
