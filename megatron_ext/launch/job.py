"""What a launcher runs (:class:`Job`, :class:`Resources`), what it says about it (:class:`JobState`)
and the interface every launcher implements (:class:`Launcher`).

A job is a program (a module run as ``python -m``: of the installed package, such as the trainer
``megatron_ext.cli.pretrain_encoder``, or of a checkout, such as its GPU suite ``benchmarks.gpu_suite``
run in the checkout; or a Python file), its arguments, environment, working directory and log, the resources it
asks for and the jobs it waits for. A launcher starts it where its scheduler says: the local one
in this process's machine, the SLURM one as a batch job. Nothing here knows a scheduler's commands.
"""

from __future__ import annotations

import argparse
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from megatron_ext.config_loading import ConfigError, coerce

TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
"""A time limit: ``minutes``, ``hours:minutes:seconds`` or ``days-hours[:minutes[:seconds]]``."""


@dataclass(frozen=True, kw_only=True)
class Resources:
    """What a job asks of its scheduler, in neutral terms; each launcher maps them to its own form
    (``nodes: 8`` is SLURM's ``--nodes=8``; the local launcher runs one node). ``extras`` are a
    launcher's own flags, by launcher name (``slurm: [--partition=gpu]``), added after the neutral
    ones and read by that launcher only."""

    nodes: int | None = None
    gpus_per_node: int | None = None
    """GPUs (and trainer processes) per node."""
    time: str | None = None
    """Time limit: minutes, ``HH:MM:SS`` or ``D-HH:MM:SS``."""
    extras: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if value is not None and value < (1 if name == "nodes" else 0):
                raise ValueError(f"{name}: expected {'at least 1' if name == 'nodes' else '0 or more'}, got {value}")
        if self.time is not None and not TIME.match(self.time):
            raise ValueError(f"time: expected minutes, HH:MM:SS or D-HH:MM:SS, got {self.time!r}")

    @classmethod
    def from_config(cls, value: Any, where: str) -> Resources:
        """``{nodes: 8, gpus_per_node: 8, time: "24:00:00", slurm: [--partition=gpu]}``: the neutral
        keys, and one list of flags per registered launcher (checked by that launcher)."""
        from megatron_ext.launch.registry import LAUNCHERS, launcher_class

        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping (nodes, gpus_per_node, time, or a launcher's "
                              f"extra flags: {', '.join(LAUNCHERS)}), got {value!r}")
        neutral = {"nodes": int | None, "gpus_per_node": int | None, "time": str | None}
        unknown = sorted(set(value) - set(neutral) - set(LAUNCHERS))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(neutral)} and the "
                              f"launchers' extra flags {sorted(LAUNCHERS)}")
        kwargs = {key: coerce(value[key], kind, f"{where}.{key}") for key, kind in neutral.items() if key in value}
        extras = {}
        for name in LAUNCHERS:
            if name in value:
                flags = coerce(value[name], tuple[str, ...], f"{where}.{name}")
                try:
                    launcher_class(name).check_extras(flags, f"{where}.{name}")
                except ValueError as err:
                    raise ConfigError(str(err)) from None
                extras[name] = flags
        try:
            return cls(**kwargs, extras=extras)
        except ValueError as err:
            raise ConfigError(f"{where}: {err}") from None

    @property
    def time_s(self) -> int | None:
        """The time limit in seconds (None: none asked for), read as SLURM reads it: ``M``, ``M:S``,
        ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``."""
        if self.time is None:
            return None
        days, _, clock = self.time.rpartition("-")
        parts = [int(part) for part in clock.split(":")]
        if days:
            hours, minutes, seconds = (*parts, 0, 0)[:3]
        elif len(parts) == 3:
            hours, minutes, seconds = parts
        else:
            hours, (minutes, seconds) = 0, (*parts, 0)[:2]
        return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds

    def over(self, base: Resources) -> Resources:
        """These resources over ``base``: the values set here win, extras come after ``base``'s."""
        extras = {name: (*base.extras.get(name, ()), *self.extras.get(name, ()))
                  for name in {*base.extras, *self.extras}}
        return replace(base, **{k: getattr(self, k) for k in ("nodes", "gpus_per_node", "time")
                                if getattr(self, k) is not None}, extras=extras)


@dataclass(frozen=True, kw_only=True)
class Job:
    """One job: what to run, with what, where its output goes, what it asks for."""

    name: str
    """Its name at the scheduler (``<study>.<run>``)."""
    module: str | None = None
    """The program, run as ``python -m``: a module of the installed package (``megatron_ext.cli.evaluate``,
    the trainer ``programs.TRAINER``), or one importable in ``workdir`` (a checkout's ``benchmarks.gpu_suite``)."""
    script: Path | None = None
    """Or the program as a Python file, run as ``python <script>``: a file of no package; an absolute
    path (the job may run elsewhere). Exactly one of ``module`` and ``script`` is set."""
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    """Added to the launcher's environment."""
    workdir: Path | None = None
    """Where it runs; None: the launcher's working directory."""
    log: Path
    """The stem of its output files: each launcher adds what tells its jobs and tasks apart
    (local: ``<log>.log``; SLURM: ``<log>-<job id>.out``)."""
    resources: Resources = field(default_factory=Resources)
    array_size: int = 1
    """Copies of the program started together, sharing its work (a job array)."""
    per_gpu: bool = False
    """One process per GPU of each node, under torchrun (the trainer); else one process per copy."""
    progress: Callable[[], object] | None = None
    """What a resumable exit (``exit_codes.RESUMABLE_EXIT_CODE``) must have advanced for a
    launcher that restarts jobs itself to start it again (the newest checkpoint's step); None: a
    resumable exit ends the job."""

    def __post_init__(self) -> None:
        if self.array_size < 1:
            raise ValueError(f"job {self.name}: array_size must be >= 1, got {self.array_size}")
        if (self.module is None) == (self.script is None):
            raise ValueError(f"job {self.name}: give its program as module or as script, exactly one")
        if self.script is not None and not self.script.is_absolute():
            raise ValueError(f"job {self.name}: script must be an absolute path, got {self.script}")

    @property
    def program_name(self) -> str:
        """The program, for messages: its module, or its script's path."""
        return self.module if self.module is not None else str(self.script)


@dataclass(frozen=True, kw_only=True)
class JobState:
    """A job as its launcher sees it."""

    status: Literal["pending", "running", "ended"]
    succeeded: bool | None = None
    """``ended``: whether it ended successfully (None: unknown)."""
    never_runs: bool = False
    """``pending``: it waits on a job that failed, and will not start."""
    stopped: bool = False
    """``ended``: it ended after this launcher was asked to stop."""
    exit_code: int | None = None
    detail: str = ""
    """The launcher's words: ``CANCELLED``, ``exit 2: error: ...``, ``(Priority)``."""
    log: Path | None = None
    """``ended``: the log that tells why it failed, where the launcher knows it (an array's failed copy)."""

    @property
    def live(self) -> bool:
        return self.status in ("pending", "running")


class JobEvents:
    """What a launcher tells while it follows jobs. Launchers that run the jobs themselves say when
    each starts, ends or restarts; the others call :meth:`poll` at their polling interval."""

    def started(self, job_id: str) -> None: ...

    def ended(self, job_id: str, state: JobState) -> None: ...

    def restarted(self, job_id: str, state: JobState) -> None:
        """It stopped resumably on its own (``state``) and was started again."""

    def stopping(self, job_id: str, signal_name: str) -> None:
        """A stop was asked for (``signal_name``); the running job saves and stops."""

    def tick(self, job_id: str) -> None:
        """The job is still running (at the launcher's progress interval)."""

    def poll(self) -> None:
        """A look at the queue is due."""


class Launcher(ABC):
    """Starts jobs and tells what became of them. One module per launcher, registered by name in
    :data:`megatron_ext.launch.LAUNCHERS`; its options come from :meth:`add_arguments`."""

    name: ClassVar[str]
    persistent: ClassVar[bool]
    """Whether its jobs outlive this process (then their ids are kept, and a later process asks
    after them) or end with it."""
    one_job_at_a_time: ClassVar[bool] = False
    """Whether it runs a study's training jobs in turn (their times add up, so the study's ETA is
    their sum) rather than side by side as a batch scheduler may."""

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        """This launcher's command-line options (no option may be another launcher's)."""

    @classmethod
    @abstractmethod
    def from_args(cls, args: argparse.Namespace) -> Launcher:
        """The launcher with the options of :meth:`add_arguments`."""

    @classmethod
    def check_extras(cls, flags: tuple[str, ...], where: str) -> None:
        """Refuse extra flags (``resources.<name>``) that this launcher cannot pass on (ValueError)."""
        if flags:
            raise ValueError(f"{where}: the {cls.name} launcher takes no extra flags")

    @property
    @abstractmethod
    def follows(self) -> bool:
        """Whether :meth:`follow` is called after submitting (the local launcher: always, it runs
        the jobs; a batch scheduler's: when asked to wait)."""

    @abstractmethod
    def describe(self, job: Job, after: Sequence[str]) -> str:
        """The command line that submits or starts ``job`` (for dry runs)."""

    @abstractmethod
    def submit(self, job: Job, after: Sequence[str] = ()) -> str:
        """Queue ``job`` to start once every job of ``after`` has ended successfully (one that fails
        cancels it); its id."""

    @abstractmethod
    def states(self, job_ids: Sequence[str]) -> dict[str, JobState]:
        """The state of each job (one look at the scheduler for all)."""

    def state(self, job_id: str) -> JobState:
        return self.states([job_id])[job_id]

    @abstractmethod
    def stop(self, job_id: str) -> None:
        """Cancel a job (a queued one does not start)."""

    @abstractmethod
    def log_file(self, job: Job, job_id: str) -> Path:
        """Where ``job`` (submitted as ``job_id``) writes its output (its first copy's, for an array)."""

    @abstractmethod
    def follow(self, job_ids: Sequence[str], events: JobEvents) -> str | None:
        """Return once every job of ``job_ids`` has ended, telling ``events`` on the way; on SIGINT or
        SIGTERM, return that signal's name sooner (the local launcher's running job saves and stops
        first; a batch scheduler's jobs go on)."""
