"""Progress of a long loop: a tqdm bar on a terminal, plain lines anywhere else.

A bar redrawn with carriage returns is unreadable in a log file, and tqdm's ``disable=None``
(a bar on a terminal, nothing otherwise) left a job whose stderr is a file (SLURM, ``> log 2>&1``)
silent for hours. :func:`progress` keeps the bar for a terminal and otherwise returns
:class:`ProgressLines`: one line every ``every_percent`` of the total or every ``every_seconds``
without a line, whichever comes first, and a last line on close with the amount, time and rate.
The lines are formatted by tqdm's own :meth:`tqdm.format_meter`, so a bar and a line read alike.

The callers use the small part of tqdm's interface that both objects have: ``update(n)``,
``close()``, iteration over the wrapped iterable and use as a context manager.

:func:`duration` writes a time the way every progress and step line of the package does.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from tqdm import tqdm

def duration(seconds: float) -> str:
    """``1h05m`` or ``4m02s``: an elapsed time or an ETA in a progress or log line (whole seconds)."""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


LINE_PERCENT = 10.0
"""Without a terminal: a line each time this share of the total is passed."""
LINE_SECONDS = 300.0
"""Without a terminal: a line when this long passed without one (the only lines when the total is
unknown). Five minutes: a job of hours shows it is alive about a dozen times an hour, not sixty."""


def progress(iterable: Iterable | None = None, *, desc: str, total: float | None = None, unit: str = "it",
             unit_scale: bool = False, enabled: bool = True, file: IO[str] | None = None,
             every_percent: float | None = LINE_PERCENT, every_seconds: float = LINE_SECONDS,
             final_line: bool = True, leave: bool = True, mininterval: float = 0.1,
             clock: Callable[[], float] = time.monotonic) -> tqdm | ProgressLines:
    """A tqdm bar when ``file`` (default: stderr) is a terminal, else :class:`ProgressLines`;
    nothing at all (a disabled tqdm) when not ``enabled``.

    ``desc``, ``total``, ``unit``, ``unit_scale``, ``leave`` and ``mininterval`` mean what they
    mean to tqdm (``leave`` and ``mininterval`` concern the bar only); ``every_percent``,
    ``every_seconds``, ``final_line`` and ``clock`` concern the lines only (see
    :class:`ProgressLines`).
    """
    stream = sys.stderr if file is None else file
    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if _is_terminal(stream):
        return tqdm(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale, file=stream,
                    leave=leave, mininterval=mininterval)
    return ProgressLines(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale, file=stream,
                         every_percent=every_percent, every_seconds=every_seconds, final_line=final_line,
                         clock=clock)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ProgressLines:
    """Progress as whole lines, for a stream that is not a terminal.

    A line each time the count passes another ``every_percent`` of ``total`` (none when either is
    None) and each time ``every_seconds`` passed since the last line, whichever comes first; on
    :meth:`close` (with ``final_line``) one last line with the amount, the elapsed time and the
    rate. No carriage returns, nothing redrawn. ``clock`` (seconds) is a parameter so a test can
    drive the time.
    """

    def __init__(self, iterable: Iterable | None = None, *, desc: str, total: float | None, unit: str,
                 unit_scale: bool, file: IO[str], every_percent: float | None, every_seconds: float,
                 final_line: bool, clock: Callable[[], float]) -> None:
        if every_percent is not None and not 0 < every_percent < 100:
            raise ValueError(f"every_percent: expected a share in (0, 100), got {every_percent}")
        if every_seconds <= 0:
            raise ValueError(f"every_seconds: expected > 0, got {every_seconds}")
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # as tqdm does
        self.iterable = iterable
        self.desc, self.total, self.unit, self.unit_scale = desc, total or None, unit, unit_scale
        self.file, self.every_percent, self.every_seconds = file, every_percent, every_seconds
        self.final_line, self.clock = final_line, clock
        self.n: float = 0
        self.start = self.last_line = clock()
        self.next_mark = every_percent  # in percent of the total
        self.closed = False

    def update(self, n: float = 1) -> None:
        """Count ``n`` more units; print a line if a mark or the interval was passed."""
        self.n += n
        now = self.clock()
        due = now - self.last_line >= self.every_seconds
        marks = self.total is not None and self.next_mark is not None
        if marks and self.n * 100 >= self.next_mark * self.total:
            # Past several marks at once (a big update) is one line; the next mark is the one after n.
            self.next_mark = (self.n * 100 // (self.every_percent * self.total) + 1) * self.every_percent
            due = due or self.n < self.total  # the mark of the total is close's line
        if due:
            self._write(self._line(now, final=False))
            self.last_line = now

    def close(self) -> None:
        """The last line (with ``final_line``): the amount, the time it took and the rate. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.final_line:
            self._write(self._line(self.clock(), final=True))

    def _line(self, now: float, *, final: bool) -> str:
        space = "" if self.unit_scale else " "  # 1.23MB, 450 step
        if final:
            layout = "{desc}: {n_fmt}" + space + "{unit} in {elapsed}, {rate_fmt}"
        elif self.total is None or self.n >= self.total:  # past an estimated total: no share of it
            layout = "{desc}: {n_fmt}" + space + "{unit}, {elapsed} elapsed, {rate_fmt}"
        else:
            layout = ("{desc}: {percentage:.0f}% ({n_fmt}" + ("{unit}" if self.unit_scale else "")
                      + " of {total_fmt}" + space + "{unit}), {elapsed} elapsed, {remaining} left, "
                      "{rate_fmt}")
        text = tqdm.format_meter(self.n, self.total, now - self.start, prefix=self.desc, unit=self.unit,
                                 unit_scale=self.unit_scale, bar_format=layout)
        # tqdm pads rates to a width (" 3.02s/step" for a slow one); a log line needs no padding.
        return " ".join(text.split())

    def _write(self, line: str) -> None:
        self.file.write(line + "\n")
        self.file.flush()

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("ProgressLines: nothing to iterate (made without an iterable)")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:  # as tqdm: the end of the iteration closes
            self.close()

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
