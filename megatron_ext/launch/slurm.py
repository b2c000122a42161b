"""The SLURM launcher: each job a batch job of a packaged launch script.

A job is submitted as ``sbatch --parsable --job-name=<name> --output=<log>-%j.out <resources>
<extras> <--sbatch-arg> --kill-on-invalid-dep=yes [--dependency=afterok:<jobs>] <script> <args>``,
the script being the program's: ``slurm.sbatch`` for the trainer (srun + torchrun on every node,
requeued on a resumable stop), ``evaluate.sbatch`` for the evaluation workers (an array of
``array_size`` tasks, ``--array=0-<n-1>``, output ``<log>-%A_%a.out``), and for any other
one-process program (such as a checkout's GPU suite, ``-m benchmarks.gpu_suite``) ``program.sbatch``, which
runs ``$PYTHON <program> <args>``. Resources map to
``--nodes``, ``--gpus-per-node`` (a one-process task: ``--gpus``) and ``--time``; then the study's ``slurm:`` extras, then the
command line's ``--sbatch-arg`` (a later flag wins). ``--kill-on-invalid-dep=yes``: a job whose
dependency failed is cancelled by SLURM, and so are the jobs waiting on it. The jobs get the
submitting environment (sbatch exports it) with the job's own and ``PYTHON`` (``$PYTHON``, else
this Python), and run in the job's working directory (else this one, the submission directory).

A job's state is ``squeue``'s (this user's jobs that slurmctld still knows, for ``MinJobAge``
after they end); an array's is its tasks' together (live while one is, COMPLETED when all are).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_ext import processes
from megatron_ext.config_loading import UserError
from megatron_ext.launch.programs import TRAINER, program_args, script
from megatron_ext.launch.job import Job, JobEvents, JobState, Launcher

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

BATCH_SCRIPTS = {TRAINER: "slurm.sbatch", "megatron_ext.cli.evaluate": "evaluate.sbatch"}
"""The packaged launch script that runs each program as a batch job."""

PROGRAM_SCRIPT = "program.sbatch"
"""The packaged launch script of a one-process program with none of its own in :data:`BATCH_SCRIPTS`
(a one-process job): it runs ``"$PYTHON" "$@"``."""


def check_sbatch_flags(flags: tuple[str, ...], where: str) -> None:
    """Each of ``flags`` is one sbatch option (``--nodes=8``), not a script or a positional value."""
    for flag in flags:
        if not flag.startswith("-"):
            raise ValueError(f"{where}: {flag!r} is not an sbatch option; write each as --name=value")


@dataclass(frozen=True, kw_only=True)
class SlurmOptions:
    sbatch_args: tuple[str, ...] = ()
    """sbatch flags for every job, after the resources and extras (``--sbatch-arg``)."""
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


def run_command(argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
                attempts: int = 3) -> str:
    """Run a SLURM client command; its stdout. Retried: a client on a busy login node can lose its
    connection to slurmctld (a refused submission is not retried)."""
    for attempt in range(attempts):
        try:
            result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
        except FileNotFoundError:
            raise UserError(f"{argv[0]}: command not found; the slurm launcher needs SLURM's client commands "
                            "(sbatch, squeue, scancel)") from None
        if result.returncode == 0:
            return result.stdout
        if attempt == attempts - 1 or argv[0] == "sbatch":
            message = result.stderr.strip().replace("\n", "; ") or f"exit code {result.returncode}"
            raise UserError(f"{' '.join(argv)}: {message}")
        time.sleep(2)
    raise AssertionError("unreachable")


def resource_flags(job: Job) -> list[str]:
    """The job's neutral resources as sbatch flags. A trainer (``per_gpu``) asks for GPUs per node
    (``slurm.sbatch`` starts one rank per GPU of each node); a one-process job (each task of an
    array) runs on one node and asks for its GPUs (``--gpus``, the option ``evaluate.sbatch`` sets)."""
    resources, flags = job.resources, []
    if not job.per_gpu and resources.nodes not in (None, 1):
        raise UserError(f"job {job.name}: one process per task runs on one node, the job asks for "
                        f"{resources.nodes} (resources.nodes)")
    if resources.nodes is not None:
        flags.append(f"--nodes={resources.nodes}")
    if resources.gpus_per_node is not None:
        flags.append(f"--gpus-per-node={resources.gpus_per_node}" if job.per_gpu else f"--gpus={resources.gpus_per_node}")
    if resources.time is not None:
        flags.append(f"--time={resources.time}")
    return flags


def batch_script(job: Job) -> list[str]:
    """The packaged batch script that runs ``job``'s program, with what it needs before the job's
    arguments: the program's own (:data:`BATCH_SCRIPTS`), else :data:`PROGRAM_SCRIPT` and the
    program after the interpreter (one process per task)."""
    if job.module in BATCH_SCRIPTS:
        return [str(script(BATCH_SCRIPTS[job.module]))]
    if job.per_gpu:
        raise UserError(f"job {job.name}: the slurm launcher starts one process per GPU for "
                        f"{', '.join(BATCH_SCRIPTS)} only, not {job.program_name}")
    return [str(script(PROGRAM_SCRIPT)), *program_args(job)]


class SlurmLauncher(Launcher):
    name = "slurm"
    persistent = True

    def __init__(self, options: SlurmOptions | None = None):
        self.options = options or SlurmOptions()
        self._signal: str | None = None

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--sbatch-arg", action="append", default=[], metavar="FLAG",
                           help="an sbatch flag for every job, e.g. --sbatch-arg=--partition=gpu (repeatable; "
                                "after the study's resources)")
        group.add_argument("--wait", action="store_true", help="follow the study's jobs until they end")
        group.add_argument("--poll-interval", type=float, default=30.0, metavar="SECONDS",
                           help="--wait: seconds between looks at the queue [30]")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SlurmLauncher:
        return cls(SlurmOptions(sbatch_args=tuple(args.sbatch_arg), wait=args.wait, poll_interval=args.poll_interval))

    @classmethod
    def check_extras(cls, flags: tuple[str, ...], where: str) -> None:
        check_sbatch_flags(flags, where)

    @property
    def follows(self) -> bool:
        return self.options.wait

    # -- submission ---------------------------------------------------------------------------------

    def command(self, job: Job, after: Sequence[str]) -> tuple[list[str], dict[str, str]]:
        """The sbatch command line of ``job``, and the environment it adds to the job's."""
        batch = batch_script(job)
        array = [f"--array=0-{job.array_size - 1}"] if job.array_size > 1 else []
        pattern = "%A_%a" if job.array_size > 1 else "%j"
        argv = ["sbatch", "--parsable", *array, f"--job-name={job.name}",
                f"--output={job.log.parent.resolve() / job.log.name}-{pattern}.out", *resource_flags(job),
                *job.resources.extras.get(self.name, ()), *self.options.sbatch_args, "--kill-on-invalid-dep=yes"]
        if after:
            argv.append("--dependency=afterok:" + ":".join(map(str, after)))
        argv += [*batch, *job.args]
        env = {"PYTHON": os.environ.get("PYTHON", sys.executable)}
        if job.per_gpu:
            env["RECIPE"] = ""  # the job's arguments name the recipe
        return argv, env

    def describe(self, job: Job, after: Sequence[str]) -> str:
        argv, _ = self.command(job, after)
        return "".join(f"{k}={v} " for k, v in job.env.items()) + " ".join(argv)

    def submit(self, job: Job, after: Sequence[str] = ()) -> str:
        argv, env = self.command(job, after)
        job.log.parent.mkdir(parents=True, exist_ok=True)
        output = run_command(argv, env={**os.environ, **job.env, **env}, cwd=job.workdir).strip()
        job_id = output.split(";")[0]
        if not job_id.isdigit():
            raise UserError(f"sbatch for {job.name}: expected a job id (--parsable), got {output!r}")
        return job_id

    def log_file(self, job: Job, job_id: str) -> Path:
        task = "_0" if job.array_size > 1 else ""
        return job.log.parent / f"{job.log.name}-{job_id}{task}.out"

    # -- the queue ----------------------------------------------------------------------------------

    def states(self, job_ids: Sequence[str]) -> dict[str, JobState]:
        rows: dict[str, list[tuple[str, str]]] = {}
        # %F: the array job's id (a plain job's own); a pending array is one row, "7_[0-1]".
        for line in run_command(["squeue", "--me", "--states=all", "--noheader",
                                 "--format=%i|%T|%r|%F"]).splitlines():
            job, state, reason, array = (line.strip().split("|") + ["", "", ""])[:4]
            key = array if array.isdigit() else job
            rows.setdefault(key, []).append((state, reason))
        return {job_id: _state(rows.get(str(job_id), [])) for job_id in job_ids}

    def stop(self, job_id: str) -> None:
        run_command(["scancel", str(job_id)])

    def follow(self, job_ids: Sequence[str], events: JobEvents) -> str | None:
        self._signal = None
        with processes.signal_handlers((signal.SIGINT, signal.SIGTERM), self._on_signal):
            while any(state.live for state in self.states(job_ids).values()):
                deadline = time.monotonic() + self.options.poll_interval
                while time.monotonic() < deadline and self._signal is None:
                    time.sleep(min(1.0, self.options.poll_interval))
                if self._signal is not None:
                    break
                events.poll()
            if self._signal is None:
                # A job that ended between the last look and the loop's check is reported too (the
                # study's last transition line was once lost that way).
                events.poll()
        return self._signal

    def _on_signal(self, signum: int, frame) -> None:
        self._signal = signal.Signals(signum).name


def _state(rows: list[tuple[str, str]]) -> JobState:
    """A job's state from its ``squeue`` rows (an array's tasks: several)."""
    if not rows:
        return JobState(status="ended", detail="ended (no longer in squeue)")
    live = [(state, reason) for state, reason in rows if state not in FINAL_STATES]
    if live:
        running = [state for state, _ in live if state in RUNNING_STATES]
        if running:
            return JobState(status="running", detail=running[0])
        reason = live[0][1]
        return JobState(status="pending", never_runs=reason == NEVER_SATISFIED,
                        detail=f"({reason})" if reason not in ("", "None") else "")
    failed = [state for state, _ in rows if state != "COMPLETED"]
    return JobState(status="ended", succeeded=not failed, detail=failed[0] if failed else "COMPLETED")


LAUNCHER = SlurmLauncher
