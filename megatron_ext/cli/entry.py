"""What every entry point shares (``pretrain_encoder.py``, each tool under ``tools/`` and its
``megatron-ext-*`` command): how a bad input ends.

An error the user can cause is a :class:`~megatron_ext.config_loading.UserError` naming the file,
key or flag and what was expected, wherever it is raised; an entry point prints it as ONE line,
``<tool>: error: <message>`` (`` (rank N)`` after ``error`` under torchrun, where every rank
reports its own), and exits with :data:`USER_ERROR_EXIT_CODE`. Command-line mistakes that argparse
finds are user errors too (:class:`ArgumentParser`). Any other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable

from megatron_ext.config_loading import UserError

USER_ERROR_EXIT_CODE = 2
"""Exit status of a run stopped by bad input (argparse's own code for a bad command line)."""


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
    """Print ``error`` as :func:`error_line` to stderr; returns :data:`USER_ERROR_EXIT_CODE`."""
    print(error_line(tool, error), file=sys.stderr, flush=True)
    return USER_ERROR_EXIT_CODE


def entry_point(tool: str) -> Callable[[Callable[[list[str] | None], int]], Callable[[list[str] | None], int]]:
    """Decorate a tool's ``main(argv)``: a :class:`UserError` becomes :func:`report_user_error`'s
    line and exit code; anything else propagates (a traceback). ``tool``: the name the line starts
    with, the script's under ``tools/`` (e.g. ``train_tokenizer.py``)."""

    def decorate(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                return main(argv)
            except UserError as error:
                return report_user_error(tool, error)

        return run

    return decorate


class UsageError(UserError):
    """A command line argparse rejects (unknown flag, missing or malformed value); argparse names
    the flag."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are :class:`UsageError` (so one line, exit code 2,
    like every other bad input) instead of the usage text and ``SystemExit``; ``--help`` is unchanged."""

    def error(self, message: str):  # noqa: D102 (argparse's hook)
        raise UsageError(f"{message} (see --help)")

