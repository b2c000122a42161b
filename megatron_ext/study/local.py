"""The local executor: a study's segments one after another on this machine.

Each segment is one trainer process, ``python pretrain_encoder.py --config recipes/<run>.yaml``
(with ``nproc_per_node`` > 1: ``examples/launch/single_node.sh``, torchrun over this machine's
GPUs), started in the executor's working directory; its output is appended to ``logs/<run>.log``.

- A complete segment is skipped. A segment starts once its parent (the run it branches from, or a
  continued pretraining's source) is complete.
- A segment fails when its trainer exits with an error (its last log lines are printed), or ends
  without a checkpoint at ``train_iters``. Its descendants are then blocked; the rest of the tree
  goes on, and the executor exits 1.
- A trainer that stops resumably on its own (exit 75: a recipe's ``exit_duration_in_mins`` or
  ``exit_interval``) is started again for as long as each start saves a later step.
- SIGINT or SIGTERM to the executor: passed on to the running trainer as SIGTERM (it saves the
  step in flight and exits 75); the executor then starts nothing more and exits 75: the same
  command continues the study. The trainer runs in a session of its own, so a terminal's Ctrl-C
  reaches it only through the executor, and it is killed with the executor if that is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_ext import processes
from megatron_ext.config_loading import UserError
from megatron_ext.study.execute import (
    REPO_DIR,
    Progress,
    SegmentState,
    StudyDir,
    checkpoint_state,
    failed_ancestor,
    first_step,
    format_status,
    log_tail,
    repository_file,
    say,
    saved_step,
    steps_left,
    tree_order,
)
from megatron_ext.study.plan import PlannedRun, Segment, StudyPlan
from megatron_ext.training.step_log import duration
from megatron_ext.training.stop import EXIT_STATUS_ENV, RESUMABLE_EXIT_CODE

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Signals that stop the executor after the running trainer has saved."""


@dataclass(frozen=True, kw_only=True)
class LocalOptions:
    """How the local executor starts trainers and reports on them."""

    nproc_per_node: int = 1
    """Processes per trainer: 1 runs ``pretrain_encoder.py`` itself; more run it under torchrun
    through ``examples/launch/single_node.sh`` (one per GPU)."""
    progress_interval: float = 600.0
    """Seconds between the lines saying where a running segment is."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UserError(f"--nproc-per-node: expected at least 1, got {self.nproc_per_node}")
        if self.progress_interval <= 0:
            raise UserError(f"--progress-interval: expected seconds > 0, got {self.progress_interval}")


def trainer_command(recipe: Path, options: LocalOptions) -> tuple[list[str], dict[str, str]]:
    """The command that trains ``recipe``, and the environment it adds."""
    if options.nproc_per_node == 1:
        return [sys.executable, str(repository_file("pretrain_encoder.py")), "--config", str(recipe)], {}
    return (["bash", str(repository_file("examples/launch/single_node.sh"))],
            {"RECIPE": str(recipe), "GPUS_PER_NODE": str(options.nproc_per_node), "PYTHON": sys.executable,
             "REPO_DIR": str(REPO_DIR)})


class _StopRequest:
    """The executor's handler of :data:`STOP_SIGNALS`: records the request and passes SIGTERM on to
    the running trainer. It prints nothing (a handler may interrupt a print); the loop says it."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.trainer: subprocess.Popen | None = None

    def __call__(self, signum: int, frame) -> None:
        self.signal = signal.Signals(signum).name
        self.pass_on()

    def pass_on(self) -> None:
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.send_signal(signal.SIGTERM)


@dataclass(frozen=True, kw_only=True)
class TrainerExit:
    code: int
    """The trainer's exit code (its own, where torchrun would only say 1)."""
    reason: str
    """The trainer's one-line reason (``done at step 40``, ``stopped after step 12/40 ...``,
    ``error: ...``); empty when it wrote none (killed)."""

    def describe(self) -> str:
        code = f"killed by {signal.Signals(-self.code).name}" if self.code < 0 else f"exit {self.code}"
        return f"{code}: {self.reason}" if self.reason else code


def _read_exit_status(path: Path, code: int) -> TrainerExit:
    """The trainer's exit: ``code`` (the process's), or where that is an error, the trainer's own
    code from its exit-status file (torchrun exits 1 for any failing worker, 75 included)."""
    if not path.is_file():
        return TrainerExit(code=code, reason="")
    written, _, reason = path.read_text().strip().partition(" ")
    path.unlink()
    if code != 0 and written.lstrip("-").isdigit():
        code = int(written)
    return TrainerExit(code=code, reason=reason)


def _last_logged_step(run: PlannedRun) -> int | None:
    """The step of the newest train record in the run's ``metrics.jsonl`` (None: none yet)."""
    path = Path(run.config.logging.log_dir) / "metrics.jsonl"
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


class LocalExecutor:
    """Runs the selected segments of ``plan`` (see the module docstring)."""

    def __init__(self, plan: StudyPlan, study_dir: StudyDir, selected: set[str], options: LocalOptions, *,
                 out: Callable[[str], None] = say):
        self.plan = plan
        self.study_dir = study_dir
        self.selected = selected
        self.options = options
        self.out = out
        self.stop = _StopRequest()
        self.states = {s.run: checkpoint_state(plan, s) for s in plan.segments}

    def table(self) -> str:
        return format_status(self.plan, self.study_dir, self.states, selected=self.selected, executor="local")

    def run(self, *, dry_run: bool) -> int:
        """0: every selected segment complete; 1: one failed (its descendants blocked); 75: stopped
        on request (run again to continue). Unless ``dry_run``, the caller holds the study
        directory's lock."""
        self.out(self.table())
        todo = [s for s in tree_order(self.plan)
                if s.run in self.selected and self.states[s.run].status != "complete"]
        if not todo:
            self.out("nothing to train: every selected segment is complete")
            return 0
        if dry_run:
            self.out("would train, in this order (in the working directory):")
            for segment in todo:
                command, env = trainer_command(self.study_dir.recipe(segment.run), self.options)
                prefix = "".join(f"{k}={v} " for k, v in env.items() if k != "REPO_DIR")
                self.out(f"  {prefix}{' '.join(command)}")
            return 0
        from megatron_ext.study.cost import seconds_left

        progress = Progress({s.run: steps_left(self.plan, s) for s in todo},
                            seconds_left(self.plan, todo, gpus=self.options.nproc_per_node, say=self.out))
        with processes.signal_handlers(STOP_SIGNALS, self.stop):
            for index, segment in enumerate(todo, 1):
                if self.stop.signal is not None:
                    break
                tag = f"[{index}/{len(todo)}] {segment.run}"
                failed = failed_ancestor(self.plan, segment.run, self.states)
                if failed is not None:
                    self.states[segment.run] = SegmentState(status="blocked", detail=f"{failed} failed")
                    progress.drop(segment.run)
                    self.out(f"{tag}: blocked ({failed} failed)")
                    continue
                started = time.monotonic()
                state = self._run_segment(segment, tag, progress)
                self.states[segment.run] = state
                if state.status == "complete":
                    progress.finish(segment.run, time.monotonic() - started)
                    took = duration(time.monotonic() - started)
                    self.out(f"{tag}: complete in {took} | {progress.summary()}")
                elif state.status == "failed":
                    progress.drop(segment.run)
                    self.out(f"{tag}: FAILED ({state.detail}); the last lines of its log:\n"
                             + log_tail(self.study_dir.log(segment.run)))
        self.out(self.table())
        if self.stop.signal is not None:
            self.out(f"stopped on {self.stop.signal}: run the same command to continue")
            return RESUMABLE_EXIT_CODE
        return 1 if any(self.states[r].status in ("failed", "blocked") for r in self.selected) else 0

    def _run_segment(self, segment: Segment, tag: str, progress: Progress) -> SegmentState:
        """Train one segment until it is complete, fails or is stopped."""
        run = self.plan.run(segment.run)
        while True:
            before = saved_step(run)
            self.out(f"{tag}: training steps {first_step(segment, run, before):,} to {run.train_iters:,} "
                     f"(log {self.study_dir.log(run.name)})")
            result = self._train(run, tag, progress)
            saved = saved_step(run)
            if self.stop.signal is not None:
                at = f"; resumes at step {saved:,}" if saved is not None else ""
                return SegmentState(status="to do", detail=f"stopped ({result.describe()}){at}")
            if result.code == 0 and saved == run.train_iters:
                return SegmentState(status="complete")
            progressed = saved is not None and (before is None or saved > before)
            if result.code == RESUMABLE_EXIT_CODE and progressed:
                self.out(f"{tag}: the trainer stopped by itself ({result.describe()}); resuming it")
                continue
            detail = result.describe()
            if result.code == 0:
                detail += f", but its newest checkpoint is at step {saved}, not {run.train_iters}"
            return SegmentState(status="failed", detail=f"{detail}; log {self.study_dir.log(run.name)}")

    def _train(self, run: PlannedRun, tag: str, progress: Progress) -> TrainerExit:
        """One trainer process, to its end."""
        command, extra_env = trainer_command(self.study_dir.recipe(run.name), self.options)
        status_file = self.study_dir.exit_status(run.name)
        status_file.parent.mkdir(parents=True, exist_ok=True)
        status_file.unlink(missing_ok=True)
        env = {**os.environ, **extra_env, EXIT_STATUS_ENV: str(status_file)}
        executor = os.getpid()
        with open(self.study_dir.log(run.name), "ab") as log:
            now = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"=== {now} tools/run_study.py: {' '.join(command)}\n".encode())
            log.flush()
            trainer = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                       preexec_fn=lambda: processes.die_with_parent(executor))
        self.stop.trainer = trainer
        announced = False
        started = last_report = time.monotonic()
        try:
            while True:
                if self.stop.signal is not None and not announced:
                    self.stop.pass_on()  # also when the signal came before the trainer was known
                    self.out(f"{self.stop.signal} received: {run.name} saves its step in flight and stops; "
                             "the study stops after it")
                    announced = True
                try:
                    code = trainer.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() - last_report >= self.options.progress_interval:
                    last_report = time.monotonic()
                    step = _last_logged_step(run)
                    where = f"step {step:,}/{run.train_iters:,}" if step is not None else "starting"
                    running = duration(last_report - started)
                    self.out(f"{tag}: {where}, running for {running} | {progress.summary()}")
        finally:
            self.stop.trainer = None
        return _read_exit_status(status_file, code)
