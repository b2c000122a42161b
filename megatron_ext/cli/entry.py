"""What every entry point shares (``pretrain_encoder.py``, each tool under ``tools/`` and its
``megatron-ext-*`` command): how a bad input ends, and which third-party warnings reach the log.

An error the user can cause is a :class:`~megatron_ext.config_loading.UserError` naming the file,
key or flag and what was expected, wherever it is raised; an entry point prints it as ONE line,
``<tool>: error: <message>`` (`` (rank N)`` after ``error`` under torchrun, where every rank
reports its own), and exits with :data:`USER_ERROR_EXIT_CODE`. Command-line mistakes that argparse
finds are user errors too (:class:`ArgumentParser`). Any other exception is a bug and keeps its
traceback.

Third-party libraries warn at import and at first use, once per process, so a job of N ranks
printed each warning N times. :func:`third_party_warnings_once` (run when ``megatron_ext.cli`` is
imported, before any tool imports Megatron) shows each known one at most once, on rank 0, or not
at all where it says nothing to a user of this project (:data:`THIRD_PARTY_WARNINGS`).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from megatron_ext.config_loading import UserError
from megatron_ext.exit_codes import INTERRUPTED_EXIT_CODE, USER_ERROR_EXIT_CODE


DEBUG_ENV = "MEGATRON_EXT_DEBUG"
"""Set (to anything but empty or 0), a user error's line is followed by its traceback on stderr."""


def error_line(tool: str, error: BaseException | str) -> str:
    """``<tool>: error[ (rank N)]: <message>`` on one line: a message listing several problems on
    lines of their own gets them joined with ``; ``."""
    parts = [part.strip() for part in str(error).splitlines() if part.strip()] or [type(error).__name__]
    message = parts[0]
    for part in parts[1:]:
        message += (" " if message.endswith(":") else "; ") + part
    rank = os.environ.get("RANK")
    return f"{tool}: error{f' (rank {rank})' if rank else ''}: {message}"


def report_user_error(tool: str, error: UserError) -> int:
    """Print ``error`` as :func:`error_line` to stderr (its traceback after it under
    :data:`DEBUG_ENV`); returns its ``exit_code``, by default :data:`USER_ERROR_EXIT_CODE`."""
    print(error_line(tool, error), file=sys.stderr, flush=True)
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(error, file=sys.stderr)
    return getattr(error, "exit_code", USER_ERROR_EXIT_CODE)


def entry_point(tool: str) -> Callable[[Callable[[list[str] | None], int]], Callable[[list[str] | None], int]]:
    """Decorate a tool's ``main(argv)``: a :class:`UserError` becomes :func:`report_user_error`'s
    line and exit code; Ctrl-C one line and :data:`INTERRUPTED_EXIT_CODE`; anything else propagates (a
    traceback). ``tool``: the name the line starts
    with, the script's under ``tools/`` (e.g. ``train_tokenizer.py``)."""

    def decorate(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                return main(argv)
            except UserError as error:
                return report_user_error(tool, error)
            except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; outputs are written whole
                print(f"{tool}: interrupted (Ctrl-C); outputs finished before it are kept, none is half-written",
                      file=sys.stderr, flush=True)
                return INTERRUPTED_EXIT_CODE

        return run

    return decorate


class UsageError(UserError):
    """A command line argparse rejects (unknown flag, missing or malformed value); argparse names
    the flag."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are :class:`UsageError` (so one line, exit code 2,
    like every other bad input) instead of the usage text and ``SystemExit``; ``--help`` is unchanged.

    A flag is never guessed from a prefix (``allow_abbrev=False``, as Megatron-LM's parser): with
    guessing, Megatron's ``--optimizer sgd`` was read as ``--optimizer-format sgd``.
    ``explain_unknown(flag)`` may give the one-line refusal of a flag this parser does not take
    (the trainer's: ``megatron_flags.unsupported_flag_message``); None leaves argparse's."""

    NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
    """argparse's own pattern misses exponents (``--lr -1e-3`` read as an unknown flag ``-1e-3``)."""

    def __init__(self, *args, explain_unknown: Callable[[str], str | None] | None = None, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = self.NEGATIVE_NUMBER  # argparse's hook: what a value, not a flag, is
        self._explain_unknown = explain_unknown

    def parse_args(self, args=None, namespace=None):  # noqa: D102 (argparse's)
        namespace, extras = self.parse_known_args(args, namespace)
        if extras and self._explain_unknown is not None:
            for token in extras:
                if token.startswith("--") and (message := self._explain_unknown(token.split("=", 1)[0])):
                    raise UsageError(message)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def error(self, message: str):  # noqa: D102 (argparse's hook)
        raise UsageError(f"{message} (see --help)")


@dataclass(frozen=True)
class ThirdPartyWarning:
    """A warning some library prints the same way on every rank."""

    message: str
    """A regular expression its text starts with."""
    show: bool
    """Once, on rank 0 (True), or never (False)."""
    why: str
    """The reason for ``show``, kept next to the rule."""
    logger: str | None = None
    """The ``logging`` logger that emits it; None: a Python ``warnings.warn``."""


THIRD_PARTY_WARNINGS = (
    ThirdPartyWarning("Transformer Engine and Apex are not installed", False,
                      "the run's start-up line states the fallback (hardware.accelerator_summary)"),
    ThirdPartyWarning("Apex is not installed", False,
                      "the run's start-up line says whether apex is there (hardware.accelerator_summary)"),
    ThirdPartyWarning("absl.logging is not installed", False,
                      "Megatron logs through the logging module instead; nothing is lost"),
    ThirdPartyWarning("MimoModelConfig is experimental", False,
                      "Megatron imports it for itself; this project does not use MIMO models"),
    ThirdPartyWarning("GPTModel IS DEPRECATED", False,
                      "nothing a user can act on: docs/design.md says why the encoder still subclasses it",
                      logger="megatron.core.models.gpt.gpt_model"),
    ThirdPartyWarning("torch.distributed is disabled, unavailable or uninitialized", False,
                      "torch's note when a checkpoint is read in one process, as the export does on purpose"),
    ThirdPartyWarning("The argument order of load has been changed", False,
                      "torch's note to callers of its checkpoint load; Megatron's call is not the user's"),
    ThirdPartyWarning("Please use DTensor instead and we are deprecating ShardedTensor", False,
                      "torch's note on Megatron's checkpoint format, which a user cannot change"),
    ThirdPartyWarning("Using Megatron-FSDP without Transformer Engine", False,
                      "Megatron's note at import; this project does not use Megatron-FSDP",
                      logger="megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision"),
    ThirdPartyWarning("Detected Megatron Core, using Megatron-FSDP with Megatron", False,
                      "Megatron's note at import; this project does not use Megatron-FSDP",
                      logger="megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"),
    ThirdPartyWarning("Detected Megatron Core, using Megatron-FSDP with Megatron", False,
                      "the same note from the module beside it",
                      logger="megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp"),
    ThirdPartyWarning("MCore's async save is deprecated", False,
                      "the writer is a setting, checkpoint.async_strategy (mcore by default); docs/gpu.md, "
                      "\"Asynchronous saves\", says why mcore stays the default (megatron-core 0.19.2 takes "
                      "nvidia-resiliency-ext >= 0.6.0 only; PyPI offers it only to glibc >= 2.39 hosts, 0.4.1 "
                      "to older ones)",
                      logger="megatron.core.dist_checkpointing.strategies.torch"),
    ThirdPartyWarning("The TemporalAsyncCaller will be deprecated soon", False,
                      "NVRx's note at every save with a writer forked per save, which the CPU needs "
                      "(hardware.persistent_checkpoint_writer)",
                      logger="nvidia_resiliency_ext.checkpointing.async_ckpt.core"),
    ThirdPartyWarning("Could not determine rank from torch.distributed, RANK, or SLURM_PROCID", False,
                      "Megatron's note when asked for the rank before the process group exists (a one-process "
                      "run); the run's own lines say which rank speaks"),
    ThirdPartyWarning("No CUDA runtime is found", False,
                      "torch's note for building CUDA extensions, which nothing here does, on a machine "
                      "without CUDA", logger="torch.utils.cpp_extension"),
)
"""Megatron's own ``full scope is deprecated`` (its default ``cuda_graph_modules``) is avoided at
the source instead: ``model.builder`` passes the empty list it recommends."""


class _OnceFilter(logging.Filter):
    """Passes the first record matching each pattern (none where ``show`` is False), and every
    record matching none."""

    def __init__(self, entries: list[ThirdPartyWarning], *, rank0: bool):
        super().__init__()
        self.entries = [(re.compile(entry.message), entry.show and rank0) for entry in entries]
        self.seen: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for index, (pattern, show) in enumerate(self.entries):
            if pattern.match(message):
                if not show or index in self.seen:
                    return False
                self.seen.add(index)
        return True


def configure_logging(level: int = logging.WARNING) -> None:
    """The one set-up of ``logging`` for an entry point: records at ``level`` and above as
    ``LEVEL logger: message`` lines, with :data:`THIRD_PARTY_WARNINGS`' filters in place, and no
    Hugging Face progress bars (transformers' "Loading weights" bar of a model of seconds)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when transformers is imported
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    third_party_warnings_once()


def third_party_warnings_once() -> None:
    """Install the filters of :data:`THIRD_PARTY_WARNINGS` in this process (rank from ``$RANK``,
    as torchrun sets it; a process without it is rank 0). Idempotent."""
    rank0 = int(os.environ.get("RANK", "0")) == 0
    by_logger: dict[str, list[ThirdPartyWarning]] = {}
    for entry in THIRD_PARTY_WARNINGS:
        if entry.logger is None:
            warnings.filterwarnings("once" if entry.show and rank0 else "ignore", message=entry.message)
        else:
            by_logger.setdefault(entry.logger, []).append(entry)
    for name, entries in by_logger.items():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _OnceFilter)]:
            logger.removeFilter(old)
        logger.addFilter(_OnceFilter(entries, rank0=rank0))
