"""Stopping early without losing work (``training.stop``): SIGTERM/SIGUSR1 finish the step in flight,
save it and exit 75, on a lone process and on every rank under torchrun; a second signal during
that save changes nothing; ``exit_duration_in_mins`` and ``exit_interval`` stop the same way; the
resumed run's per-step losses equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.checkpoint.reader import latest_checkpoint
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.loop import pretrain
from megatron_ext.exit_codes import EXIT_STATUS_ENV, RESUMABLE_EXIT_CODE
from helpers import tiny_recipe as _recipe

REPO = Path(__file__).resolve().parents[2]
STEPS = 40


def _stop_recipe(corpus, run_dir: Path, **training) -> dict:
    # No periodic save before the end: whatever is saved early, the stop saved.
    return _recipe(corpus, run_dir, training={"train_iters": STEPS, "eval_interval": 0, **training},
                   checkpoint={"save": str(run_dir / "ckpt"), "save_interval": STEPS})


def _losses(run_dir: Path) -> dict[int, float]:
    """Per-step training losses of every process that wrote ``run_dir``'s metrics (a resumed run
    appends to the same file)."""
    rows = [json.loads(line) for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if row["kind"] == "train"}


def _start(command: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def _signal_at_step(run: subprocess.Popen, target_pid: int, at_step: int, signals: list[int]) -> str:
    """Read the run's output; once it logs step ``at_step``, send ``signals`` (0.2 s apart) to
    ``target_pid``. Returns the whole output."""
    lines = []
    for line in run.stdout:
        lines.append(line)
        if re.match(rf"step +{at_step}/{STEPS} ", line):
            for sig in signals:
                os.kill(target_pid, sig)
                time.sleep(0.2)
            break
    lines.extend(run.stdout)
    run.wait(timeout=120)
    return "".join(lines)


@pytest.fixture(scope="module")
def straight(tiny_corpus, tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("straight")
    result = pretrain(run_config_from_dict(_stop_recipe(tiny_corpus, run_dir)))
    assert result.stopped is None and result.final_step == STEPS
    return result.losses


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGUSR1, signal.SIGTERM], [signal.SIGINT, signal.SIGINT]],
                         ids=["TERM", "USR1+TERM", "INT+INT"])
def test_a_signal_saves_the_step_in_flight_and_the_rerun_resumes_exactly(tmp_path, tiny_corpus, straight, signals):
    """The step in flight when the signal lands is saved (no step lost), the exit code says
    "resumable", the status file says why; a second signal during the save changes nothing."""
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(_stop_recipe(tiny_corpus, tmp_path)))
    status = tmp_path / "exit_status"
    run = _start([sys.executable, str(REPO / "pretrain_encoder.py"), "--config", str(recipe)],
                 env={EXIT_STATUS_ENV: str(status)})
    output = _signal_at_step(run, run.pid, 5, signals)
    assert run.returncode == RESUMABLE_EXIT_CODE, output
    stopped = re.search(r"stopped after step (\d+)/\d+ \(signal (SIG\w+)\)", output)
    assert stopped, output
    step = int(stopped[1])
    logged = max(int(m) for m in re.findall(rf"^step +(\d+)/{STEPS}", output, re.M))
    assert step == logged >= 5  # the last step done is the one saved
    assert stopped[2] == signal.Signals(signals[0]).name
    assert latest_checkpoint(tmp_path / "ckpt").name == f"iter_{step:07d}"
    assert status.read_text().startswith(f"{RESUMABLE_EXIT_CODE} stopped after step {step}")
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    if signals[0] == signal.SIGINT:  # Ctrl-C (twice within a second: one press) says what happens, once
        assert output.count("Ctrl-C: finishing the step in flight, then saving") == 1, output

    resumed = pretrain(run_config_from_dict(_stop_recipe(tiny_corpus, tmp_path)))
    assert resumed.start_step == step and resumed.final_step == STEPS and resumed.stopped is None
    losses = _losses(tmp_path)
    for s in range(1, STEPS + 1):
        assert losses[s] == pytest.approx(straight[s], rel=1e-5), f"step {s}"


def test_every_torchrun_worker_saves_on_a_signal_to_the_agent(tmp_path, tiny_corpus, straight):
    """SIGTERM to torchrun's agent (what a scheduler signals): the agent forwards it to its workers,
    which agree on one step, save it on both data-parallel ranks and exit 75 (torchrun itself
    reports 1 for any worker's non-zero exit: the status file carries the trainer's code)."""
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(_stop_recipe(tiny_corpus, tmp_path)))
    status = tmp_path / "exit_status"
    run = _start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  str(REPO / "pretrain_encoder.py"), "--config", str(recipe)],
                 env={EXIT_STATUS_ENV: str(status), "OMP_NUM_THREADS": "1"})
    output = _signal_at_step(run, run.pid, 5, [signal.SIGTERM])
    assert run.returncode != 0
    assert status.read_text().startswith(f"{RESUMABLE_EXIT_CODE} stopped after step"), output
    step = int(re.search(r"stopped after step (\d+)", status.read_text())[1])
    assert step >= 5 and latest_checkpoint(tmp_path / "ckpt").name == f"iter_{step:07d}"
    saved = Checkpoint.open(tmp_path / "ckpt").optimizer_format()
    assert saved["data_parallel_size"] == 2  # both ranks wrote their part of the one checkpoint
    resumed = pretrain(run_config_from_dict(_stop_recipe(tiny_corpus, tmp_path)))  # at DP=1
    assert resumed.start_step == step and resumed.final_step == STEPS


def test_time_budget_and_exit_interval_stop_after_a_saved_step(tmp_path, tiny_corpus, straight):
    # In-process the budget counts from this (long-running) process's start: spent at once.
    budget = pretrain(run_config_from_dict(_stop_recipe(tiny_corpus, tmp_path / "budget", exit_duration_in_mins=1e-6)))
    assert budget.final_step == 1 and "exit_duration_in_mins" in budget.stopped
    assert latest_checkpoint(tmp_path / "budget/ckpt").name == "iter_0000001"

    interval = _stop_recipe(tiny_corpus, tmp_path / "interval", exit_interval=15)
    ends = []
    for _ in range(3):  # 0 -> 15 -> 30 -> 40: stopped, stopped, done
        result = pretrain(run_config_from_dict(interval))
        ends.append((result.final_step, result.stopped))
    assert ends == [(15, "training.exit_interval=15"), (30, "training.exit_interval=15"), (40, None)]
    losses = _losses(tmp_path / "interval")
    for s in range(1, STEPS + 1):
        assert losses[s] == pytest.approx(straight[s], rel=1e-5), f"step {s}"


def test_without_the_handler_a_signal_ends_the_run_at_once(tmp_path, tiny_corpus):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(_stop_recipe(tiny_corpus, tmp_path, exit_signal_handler=False)))
    run = _start([sys.executable, str(REPO / "pretrain_encoder.py"), "--config", str(recipe)])
    _signal_at_step(run, run.pid, 3, [signal.SIGTERM])
    assert run.returncode == -signal.SIGTERM
    assert latest_checkpoint(tmp_path / "ckpt") is None
