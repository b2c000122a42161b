"""No process of a trainer outlives it: asynchronous checkpoint writers and their results-queue
manager end when ``pretrain()`` returns or raises, die with a trainer killed by SIGKILL, and what
escapes both (Megatron's persistent GPU writer) is ended by the next run (``processes.end_orphans``).
The first H100 run hung at exit in the persistent writer's clean-up; ``test_gpu_run_with_async_saves_exits``
keeps that fixed on a GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_ext import processes
from megatron_ext.checkpoint.reader import latest_checkpoint
from megatron_ext.checkpoint.writer import CheckpointSaver
from megatron_ext.checkpoint.config import nvrx_problem
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.loop import pretrain
from megatron_ext.training.recovery import NonFiniteLossError
from helpers import tiny_recipe as _recipe

REPO = Path(__file__).resolve().parents[2]


def _async_recipe(corpus, run_dir: Path, *, steps: int, **training) -> dict:
    return _recipe(corpus, run_dir, training={"train_iters": steps, "eval_interval": 0, **training},
                   checkpoint={"save": str(run_dir / "ckpt"), "save_interval": 1, "async_save": True, "keep_last": 2})


def _live_children() -> set[int]:
    """This process's live descendants, but Python's own multiprocessing resource tracker: one per
    interpreter, started by the first spawned process, it exits when its pipe from this process
    closes (at exit, or when this process is killed)."""
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE and "multiprocessing.resource_tracker" not in " ".join(p.cmdline())}


def test_saves_leave_no_process_when_the_run_returns_or_raises(tmp_path, tiny_corpus):
    before = _live_children()
    result = pretrain(run_config_from_dict(_async_recipe(tiny_corpus, tmp_path / "ok", steps=4)))
    assert result.final_step == 4
    assert latest_checkpoint(tmp_path / "ok/ckpt").name == "iter_0000004"  # published before returning
    assert _live_children() - before == set()
    synchronous = _async_recipe(tiny_corpus, tmp_path / "sync", steps=4)
    synchronous["checkpoint"]["async_save"] = False  # Megatron's results queue serves these too
    pretrain(run_config_from_dict(synchronous))
    assert _live_children() - before == set()
    assert processes.TRAINER_ENV not in os.environ  # the session is over

    failing = _async_recipe(tiny_corpus, tmp_path / "nan", steps=20, max_nonfinite_steps=2)
    failing["schedule"] = {"lr": 1e30, "lr_decay_style": "constant"}  # non-finite from step 2 on
    with pytest.raises(NonFiniteLossError):
        pretrain(run_config_from_dict(failing))
    assert _live_children() - before == set()


def test_a_trainer_killed_during_async_saves_leaves_no_process(tmp_path, tiny_corpus):
    """SIGKILL while background writers run: the forked writers and the results-queue manager die
    with the trainer (PR_SET_PDEATHSIG), at once rather than at the next run."""
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(_async_recipe(tiny_corpus, tmp_path, steps=400)))
    trainer = subprocess.Popen([sys.executable, str(REPO / "pretrain_encoder.py"), "--config", str(recipe)],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    descendants: set[int] = set()
    deadline = time.time() + 240
    # Wait for a save to be written in the background: the manager and a forked writer are alive.
    while len(descendants) < 2 and time.time() < deadline and trainer.poll() is None:
        try:
            descendants |= {p.pid for p in psutil.Process(trainer.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    assert trainer.poll() is None and len(descendants) >= 2, "the trainer never ran a background save"
    trainer.kill()
    trainer.wait()
    survivors = {pid for pid in descendants if psutil.pid_exists(pid)}
    deadline = time.time() + 10
    while survivors and time.time() < deadline:
        time.sleep(0.1)
        survivors = {pid for pid in survivors if psutil.pid_exists(pid)
                     and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}
    assert not survivors, [" ".join(psutil.Process(pid).cmdline()) for pid in survivors]


def test_the_results_queue_outlives_the_signals_a_scheduler_sends_to_every_process(single_rank):
    """SLURM signals every process of a job step; the trainer saves on SIGTERM/SIGUSR1, through a
    results-queue manager that must still be there: it ignores them (and Ctrl-C's SIGINT) and
    ends when the saver closes. (A synchronous saver reports through a plain queue: no process.)"""
    before = _live_children()
    with CheckpointSaver(async_save=False):
        assert _live_children() == before
    with CheckpointSaver(async_save=True):
        manager, = [psutil.Process(pid) for pid in _live_children() - before]
        for sig in processes.IGNORED_BY_HELPERS:
            manager.send_signal(sig)
        time.sleep(1.0)
        assert manager.is_running() and manager.status() != psutil.STATUS_ZOMBIE
    assert not manager.is_running() or manager.status() == psutil.STATUS_ZOMBIE
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # this process's own handling is back


def _environ(pid: int) -> dict:
    try:
        return psutil.Process(pid).environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def _sleeper(tag: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            env={**os.environ, processes.TRAINER_ENV: tag})


def test_the_next_run_ends_what_a_dead_trainer_left(caplog):
    """A process tagged with a trainer that no longer runs is ended, with a warning naming it; one
    whose trainer still runs is left alone. A trainer starting in the other test worker ends such a
    process too (every trainer's start does, for the whole machine): an orphan ended before this
    test's own call is made again, 3 times at most."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_tag = f"{gone.pid}:{psutil.Process(gone.pid).create_time():.2f}"
    gone.wait()
    with processes.trainer_session():
        live_tag = os.environ[processes.TRAINER_ENV]
    for attempt in range(3):
        orphan, kept = _sleeper(dead_tag), _sleeper(live_tag)  # kept: "started by" this (live) process
        try:
            deadline = time.time() + 60  # until both have exec'd python: their environment is readable
            while time.time() < deadline and not all(
                    processes.TRAINER_ENV in _environ(p.pid) for p in (orphan, kept)):
                time.sleep(0.1)
            caplog.clear()
            with caplog.at_level("WARNING", logger="megatron_ext.processes"):
                ended = processes.end_orphans()
            if orphan.pid not in ended and orphan.poll() is not None and attempt < 2:
                continue  # ended by another trainer's start before this call
            assert orphan.pid in ended and kept.pid not in ended
            assert not psutil.pid_exists(orphan.pid)  # killed (and reaped by end_orphans' wait)
            assert kept.poll() is None
            assert f"ended process {orphan.pid}" in caplog.text and f"trainer {gone.pid}" in caplog.text
            break
        finally:
            for process in (orphan, kept):
                process.kill()
                process.wait()


@pytest.mark.gpu
@pytest.mark.parametrize("async_strategy", [
    "mcore", pytest.param("nvrx", marks=pytest.mark.skipif(nvrx_problem() is not None, reason=str(nvrx_problem())))])
def test_gpu_run_with_async_saves_exits(tmp_path, tiny_corpus, async_strategy):
    """On a GPU (the writer's persistent worker: Megatron's, or NVRx's with ``async_strategy: nvrx``),
    a run with ``async_save: true`` exits on its own within 30 s of its last step, with its
    checkpoint published."""
    raw = _async_recipe(tiny_corpus, tmp_path, steps=40)
    raw["checkpoint"].update(save_interval=20, async_strategy=async_strategy)
    raw["training"]["bf16"] = True
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(raw))
    trainer = subprocess.Popen([sys.executable, str(REPO / "pretrain_encoder.py"), "--config", str(recipe)],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last_step = None
    for line in trainer.stdout:
        if line.startswith("step 40/40"):
            last_step = time.time()
        if line.startswith("done:"):
            break
    assert last_step is not None, "the run did not reach its last step"
    try:
        trainer.wait(timeout=max(1.0, 30 - (time.time() - last_step)))
    except subprocess.TimeoutExpired:
        trainer.kill()
        pytest.fail("the process did not exit within 30 s of its last step")
    assert trainer.returncode == 0
    assert latest_checkpoint(tmp_path / "ckpt").name == "iter_0000040"
