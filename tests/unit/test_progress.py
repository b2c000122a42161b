"""megatron_ext.progress: a tqdm bar on a terminal, plain lines at marks and intervals elsewhere."""

from __future__ import annotations

import io
import os
import re
import select

import pytest
from tqdm import tqdm

from megatron_ext.progress import ProgressLines, duration, progress


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(stream: io.StringIO) -> list[str]:
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text, text  # nothing redrawn
    return text.splitlines()


def test_a_line_at_each_tenth_and_a_final_line_with_total_rate_and_time():
    clock, stream = Clock(), io.StringIO()
    with progress(total=1000, desc="preprocess", unit="doc", file=stream, clock=clock) as bar:
        assert isinstance(bar, ProgressLines)
        for _ in range(40):  # 25 documents a second
            clock.now += 1.0
            bar.update(25)
            if bar.n == 90:
                assert _lines(stream) == []  # 9%: nothing yet
    lines = _lines(stream)
    percents = [int(re.match(r"preprocess: (\d+)% ", line)[1]) for line in lines[:-1]]
    assert percents == [10, 20, 30, 40, 50, 60, 70, 80, 90]
    assert lines[0] == "preprocess: 10% (100 of 1000 doc), 00:04 elapsed, 00:36 left, 25.00doc/s"
    assert lines[-1] == "preprocess: 1000 doc in 00:40, 25.00doc/s"  # the total is close's line, once


def test_a_big_update_past_several_marks_is_one_line():
    clock, stream = Clock(), io.StringIO()
    bar = progress(total=100, desc="x", file=stream, clock=clock)
    bar.update(35)  # past 10, 20 and 30
    bar.update(4)  # 39: no new mark
    bar.update(1)  # 40
    assert [line.split(" (")[0] for line in _lines(stream)] == ["x: 35%", "x: 40%"]
    bar.update(70)  # 110: past the total (an estimate, e.g. bytes for characters): no line at a mark
    clock.now += 300.0
    bar.update(1)  # the interval: the amount, no share of the total
    assert _lines(stream)[2:] == ["x: 111 it, 05:00 elapsed, 2.70s/it"]  # tqdm inverts a slow rate


def test_a_line_after_the_interval_without_one_whichever_comes_first():
    clock, stream = Clock(), io.StringIO()
    bar = progress(total=10_000, desc="slow", unit="B", unit_scale=True, file=stream, clock=clock,
                   every_seconds=60)
    for _ in range(5):
        clock.now += 30.0
        bar.update(100)  # 1% per 30 s: the interval comes first
    clock.now += 30.0
    bar.update(500)  # 10%: the mark; the interval restarts at this line
    clock.now += 59.0
    bar.update(10)
    bar.close()
    bar.close()  # idempotent
    lines = _lines(stream)
    assert lines == [
        "slow: 2% (200B of 10.0kB), 01:00 elapsed, 49:00 left, 3.33B/s",
        "slow: 4% (400B of 10.0kB), 02:00 elapsed, 48:00 left, 3.33B/s",
        "slow: 10% (1.00kB of 10.0kB), 03:00 elapsed, 27:00 left, 5.56B/s",
        "slow: 1.01kB in 03:59, 4.23B/s",
    ]


def test_unknown_total_lines_by_time_only_and_iteration_closes():
    clock, stream = Clock(), io.StringIO()

    def documents():
        for i in range(1000):
            clock.now += 0.5
            yield i

    seen = list(progress(documents(), desc="reading documents", unit="doc", file=stream, clock=clock,
                         every_seconds=120))
    assert seen == list(range(1000))
    lines = _lines(stream)
    assert lines[:2] == ["reading documents: 240 doc, 02:00 elapsed, 2.00doc/s",
                         "reading documents: 480 doc, 04:00 elapsed, 2.00doc/s"]
    assert len(lines) == 5 and lines[-1] == "reading documents: 1000 doc in 08:20, 2.00doc/s"


def test_finetune_style_is_silent_when_short_and_only_timed_when_long():
    """The fine-tuning setting: no marks, no final line; a line only once the interval passed."""
    clock, stream = Clock(), io.StringIO()
    for _ in progress(range(200), desc="sc lr=1e-05 seed=0", unit="step", file=stream, clock=clock,
                      every_percent=None, every_seconds=300, final_line=False):
        clock.now += 1.0  # 200 s: shorter than the interval
    assert stream.getvalue() == ""
    for _ in progress(range(1000), desc="sc lr=1e-05 seed=1", unit="step", file=stream, clock=clock,
                      every_percent=None, every_seconds=300, final_line=False):
        clock.now += 1.0
    assert _lines(stream) == [
        "sc lr=1e-05 seed=1: 30% (300 of 1000 step), 05:00 elapsed, 11:40 left, 1.00step/s",
        "sc lr=1e-05 seed=1: 60% (600 of 1000 step), 10:00 elapsed, 06:40 left, 1.00step/s",
        "sc lr=1e-05 seed=1: 90% (900 of 1000 step), 15:00 elapsed, 01:40 left, 1.00step/s",
    ]


def test_a_terminal_gets_a_tqdm_bar_and_disabled_gets_nothing():
    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as terminal:
            bar = progress(total=10, desc="preprocess", file=terminal)
            assert isinstance(bar, tqdm) and not bar.disable
            bar.update(10)
            bar.close()
            drawn = ""
            while select.select([leader], [], [], 0.2)[0]:  # every write of the bar, however split
                drawn += os.read(leader, 4096).decode()
    finally:
        os.close(leader)
        os.close(follower)
    assert "\r" in drawn and "preprocess: 100%" in drawn  # the bar, redrawn in place
    stream = io.StringIO()
    with progress(range(3), desc="quiet", file=stream, enabled=False) as bar:
        assert list(bar) == [0, 1, 2]
    assert stream.getvalue() == ""


@pytest.mark.parametrize("kwargs, message", [
    ({"every_percent": 0}, "every_percent"), ({"every_percent": 100}, "every_percent"),
    ({"every_seconds": 0}, "every_seconds"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        progress(total=10, desc="x", file=io.StringIO(), **kwargs)


def test_a_short_finetune_into_a_log_file_prints_nothing(capsys):
    """The evaluation grid logs one line per finished run; a fine-tune shorter than the interval
    adds nothing to it (no marks, no final line) though stderr is not a terminal."""
    import torch

    from megatron_ext.eval.finetuning import FinetuneConfig, finetune

    model = torch.nn.Linear(4, 1)
    losses = finetune(model, iter(torch.ones(10, 4)), config=FinetuneConfig(lr=1e-3, seed=0, device="cpu"),
                      total_steps=5, loss_fn=lambda m, batch: m(batch).sum(), desc="sc lr=0.001 seed=0")
    assert len(losses) == 5
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("seconds, text", [(0, "0m00s"), (242.7, "4m02s"), (3599.9, "59m59s"), (3900, "1h05m"),
                                           (36 * 3600 + 61, "36h01m")])
def test_duration_is_minutes_and_seconds_under_an_hour_then_hours_and_minutes(seconds, text):
    assert duration(seconds) == text
