"""The local launcher: jobs on this machine, one at a time, in the order they were submitted.

A job is its program (a module, run as ``python -m``, or a Python file) started in a session of its own, its output appended
to ``<log>.log`` (an array's copies: ``<log>.worker<i>.log``, started together, on CPU each with its
share of the cores). A trainer job (``per_gpu``) with ``--nproc-per-node`` > 1 runs under torchrun
through the packaged ``single_node.sh``. A job starts once the jobs it waits for have ended
successfully; one that failed cancels it (and the jobs waiting on it).

- Exit code: a trainer's own, from its exit-status file (``exit_codes.EXIT_STATUS_ENV``: torchrun
  says 1 for any failing worker), with its one-line reason.
- A job that stops resumably on its own (exit 75) is started again for as long as each start
  advances its ``progress`` (the newest checkpoint).
- SIGINT or SIGTERM while following: passed on to the running job as SIGTERM (a trainer saves the
  step in flight and exits 75); nothing more starts. The jobs die with this process.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext import processes
from megatron_ext.config_loading import UserError
from megatron_ext.exit_codes import EXIT_STATUS_ENV, RESUMABLE_EXIT_CODE
from megatron_ext.launch.programs import TRAINER, program_args, script
from megatron_ext.launch.job import Job, JobEvents, JobState, Launcher

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True, kw_only=True)
class LocalOptions:
    nproc_per_node: int | None = None
    """Processes per trainer; None: the job's ``gpus_per_node`` (else 1). More than 1: torchrun."""
    progress_interval: float = 600.0
    """Seconds between the ticks of a running job."""

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UserError(f"--nproc-per-node: expected at least 1, got {self.nproc_per_node}")
        if self.progress_interval <= 0:
            raise UserError(f"--progress-interval: expected seconds > 0, got {self.progress_interval}")


@dataclass(frozen=True, kw_only=True)
class Exit:
    code: int
    """The program's exit code (a trainer's own, where torchrun would only say 1)."""
    reason: str
    """A trainer's one-line reason (``done at step 40``, ``error: ...``); empty when it wrote none."""
    log: Path | None = None
    """The log of this copy of the job."""

    def describe(self) -> str:
        code = f"killed by {signal.Signals(-self.code).name}" if self.code < 0 else f"exit {self.code}"
        return f"{code}: {self.reason}" if self.reason else code


def read_exit_status(path: Path, code: int, log: Path | None = None) -> Exit:
    """The exit: ``code`` (the process's), or where that is an error, the trainer's own code from
    its exit-status file (torchrun exits 1 for any failing worker, 75 included)."""
    if not path.is_file():
        return Exit(code=code, reason="", log=log)
    written, _, reason = path.read_text().strip().partition(" ")
    path.unlink()
    if code != 0 and written.lstrip("-").isdigit():
        code = int(written)
    return Exit(code=code, reason=reason, log=log)


@dataclass(kw_only=True)
class _Queued:
    job: Job
    after: tuple[str, ...]
    state: JobState = field(default_factory=lambda: JobState(status="pending"))


class _Stop:
    """The handler of :data:`STOP_SIGNALS`: records the request and passes SIGTERM on to the running
    processes. It prints nothing (a handler may interrupt a print)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.running: list[subprocess.Popen] = []

    def __call__(self, signum: int, frame) -> None:
        self.signal = signal.Signals(signum).name
        self.pass_on()

    def pass_on(self) -> None:
        for process in self.running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)


class LocalLauncher(Launcher):
    name = "local"
    persistent = False
    one_job_at_a_time = True

    def __init__(self, options: LocalOptions | None = None):
        self.options = options or LocalOptions()
        self.queue: dict[str, _Queued] = {}
        self._ids = itertools.count(1)

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                           help="processes per trainer; N > 1: torchrun over N GPUs [the study's "
                                "resources.gpus_per_node, else 1]")
        group.add_argument("--progress-interval", type=float, default=600.0, metavar="SECONDS",
                           help="seconds between lines saying where the running job is [600]")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LocalLauncher:
        return cls(LocalOptions(nproc_per_node=args.nproc_per_node, progress_interval=args.progress_interval))

    @property
    def follows(self) -> bool:
        return True

    # -- commands -----------------------------------------------------------------------------------

    def processes_per_node(self, job: Job) -> int:
        if not job.per_gpu:
            return 1
        if self.options.nproc_per_node is not None:
            return self.options.nproc_per_node
        return job.resources.gpus_per_node or 1

    def command(self, job: Job) -> tuple[list[str], dict[str, str]]:
        """The command of one copy of ``job``, and the environment it adds to the job's."""
        if job.resources.nodes not in (None, 1):
            raise UserError(f"job {job.name}: the local launcher runs one node, the job asks for "
                            f"{job.resources.nodes} (resources.nodes)")
        nproc = self.processes_per_node(job)
        if nproc == 1:
            return [sys.executable, *program_args(job), *job.args], {}
        if job.module != TRAINER:
            raise UserError(f"job {job.name}: only the trainer runs several processes per node, not {job.program_name}")
        # RECIPE empty: the job's arguments name the recipe.
        return (["bash", str(script("single_node.sh")), *job.args],
                {"GPUS_PER_NODE": str(nproc), "PYTHON": sys.executable, "RECIPE": ""})

    def describe(self, job: Job, after: Sequence[str]) -> str:
        command, env = self.command(job)
        prefix = "".join(f"{k}={v} " for k, v in {**job.env, **env}.items())
        copies = f"  (x{job.array_size})" if job.array_size > 1 else ""
        return f"{prefix}{' '.join(command)}{copies}"

    def log_file(self, job: Job, job_id: str, copy: int | None = None) -> Path:
        if job.array_size > 1:
            return job.log.parent / f"{job.log.name}.worker{copy or 0}.log"
        return job.log.parent / f"{job.log.name}.log"

    def _exit_status_file(self, job: Job) -> Path:
        return job.log.parent / f".{job.log.name}.exit-status"

    # -- the queue ----------------------------------------------------------------------------------

    def submit(self, job: Job, after: Sequence[str] = ()) -> str:
        self.command(job)  # refuse what cannot run here before anything starts
        job_id = f"local-{next(self._ids)}"
        self.queue[job_id] = _Queued(job=job, after=tuple(after))
        return job_id

    def states(self, job_ids: Sequence[str]) -> dict[str, JobState]:
        return {job_id: self.queue[job_id].state if job_id in self.queue else
                JobState(status="ended", detail="not a job of this process") for job_id in job_ids}

    def stop(self, job_id: str) -> None:
        queued = self.queue[job_id]
        if queued.state.status == "pending":
            queued.state = JobState(status="ended", succeeded=False, detail="cancelled")

    def follow(self, job_ids: Sequence[str], events: JobEvents) -> str | None:
        stop = _Stop()
        with processes.signal_handlers(STOP_SIGNALS, stop):
            for job_id in job_ids:
                if stop.signal is not None:
                    break
                queued = self.queue[job_id]
                if queued.state.status != "pending":
                    continue
                failed = [a for a in queued.after if not self.queue[a].state.succeeded]
                if failed:
                    queued.state = JobState(status="ended", succeeded=False,
                                            detail=f"cancelled: job {failed[0]} did not succeed")
                    events.ended(job_id, queued.state)
                    continue
                queued.state = self._run(job_id, queued.job, events, stop)
                events.ended(job_id, queued.state)
        if stop.signal is not None:  # what was not started ends with this process
            for job_id in job_ids:
                if self.queue[job_id].state.status == "pending":
                    self.queue[job_id].state = JobState(status="ended", stopped=True, detail="not started")
        # (a stopped job that never started has no exit code)
        return stop.signal

    def _run(self, job_id: str, job: Job, events: JobEvents, stop: _Stop) -> JobState:
        """The job until it ends (started again while it stops resumably and progresses)."""

        while True:
            before = job.progress() if job.progress is not None else None
            self.queue[job_id].state = JobState(status="running")
            events.started(job_id)
            exits = self._start_and_wait(job_id, job, events, stop)
            failed = next((e for e in exits if e.code != 0), None)
            result = failed or exits[0]
            state = JobState(status="ended", succeeded=failed is None, stopped=stop.signal is not None,
                             exit_code=result.code, detail=result.describe(), log=result.log)
            if (stop.signal is None and result.code == RESUMABLE_EXIT_CODE and len(exits) == 1
                    and job.progress is not None and job.progress() != before):
                events.restarted(job_id, state)
                continue
            return state

    def _start_and_wait(self, job_id: str, job: Job, events: JobEvents, stop: _Stop) -> list[Exit]:
        from megatron_ext import hardware

        command, extra_env = self.command(job)
        status_file = self._exit_status_file(job)
        status_file.parent.mkdir(parents=True, exist_ok=True)
        status_file.unlink(missing_ok=True)
        env = {**os.environ, **job.env, **extra_env}
        if job.array_size == 1:
            env[EXIT_STATUS_ENV] = str(status_file)
        elif "OMP_NUM_THREADS" not in job.env and not hardware.on_gpu():
            # On CPU each copy gets its share of the cores (torch would give every one all of them).
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // job.array_size))
        launcher = os.getpid()
        running = []
        for copy in range(job.array_size):
            with open(self.log_file(job, job_id, copy), "ab") as log:
                log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.name} launcher, job {job.name}: "
                          f"{' '.join(command)}\n".encode())
                log.flush()
                running.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=job.workdir,
                                                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                                preexec_fn=lambda: processes.die_with_parent(launcher)))
        stop.running = running
        announced = False
        last_tick = time.monotonic()
        try:
            while any(process.poll() is None for process in running):
                if stop.signal is not None and not announced:
                    stop.pass_on()  # also when the signal came before the processes were known
                    events.stopping(job_id, stop.signal)
                    announced = True
                time.sleep(0.2)
                if time.monotonic() - last_tick >= self.options.progress_interval:
                    last_tick = time.monotonic()
                    events.tick(job_id)
        finally:
            stop.running = []
        codes = [process.wait() for process in running]
        if job.array_size == 1:
            return [read_exit_status(status_file, codes[0], self.log_file(job, job_id))]
        return [Exit(code=code, reason="", log=self.log_file(job, job_id, copy)) for copy, code in enumerate(codes)]


LAUNCHER = LocalLauncher
