"""What a long run does about its own bad steps and about time (``training.recovery``), on CPU with
real text: a learning rate too large for the tiny model makes real loss spikes and non-finite steps.
A spike is said and recorded; with ``spike_rollbacks`` the run reloads the newest checkpoint before
it and goes on after the spiking batches, a bounded number of times, resuming exactly across a
rollback; the non-finite stop rolls back the same way until none is left; a wall-clock save cadence
saves steps the step cadence would not."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch

from helpers import tiny_recipe
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.config_loading import ConfigError, UserError
from megatron_ext.training.loop import pretrain
from megatron_ext.training.recovery import NonFiniteLossError
from megatron_ext.training.recipe import run_config_from_dict

MLM = [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}]


def _recipe(corpus, run_dir, *, lr: float, **training) -> dict:
    """16 steps, warmup to ``lr`` over 8 (the tiny model diverges on the way up), a save every 2
    steps, every checkpoint kept."""
    return tiny_recipe(corpus, run_dir, phases=MLM,
                       schedule={"lr": lr, "lr_decay_style": "wsd", "lr_warmup_iters": 8, "lr_wsd_decay_iters": 2},
                       training={"train_iters": 16, "eval_interval": 0, "log_interval": 1, **training},
                       checkpoint={"save": str(run_dir / "ckpt"), "save_interval": 2, "keep_last": 0})


SPIKES = {"loss_spike_factor": 1.3, "loss_spike_window": 3, "spike_rollbacks": 2}


def _records(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "log/metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    from megatron_ext.hf import load_megatron_checkpoint, single_process_model_parallel

    with single_process_model_parallel():
        return {k: v.cpu() for k, v in load_megatron_checkpoint(checkpoint).state_dict().items()
                if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def spiky(tmp_path_factory, tiny_corpus):
    run_dir = tmp_path_factory.mktemp("spiky")
    return run_dir, pretrain(run_config_from_dict(_recipe(tiny_corpus, run_dir, lr=2.0, **SPIKES)))


def test_a_spike_rolls_back_to_the_checkpoint_before_it_a_bounded_number_of_times(spiky, capsys):
    run_dir, result = spiky
    assert result.final_step == 16
    spikes = [r["step"] for r in _records(run_dir, "spike")]
    rollbacks = _records(run_dir, "rollback")
    assert len(rollbacks) == 2 and len(spikes) > 2  # the later spikes only said: none left
    first, second = rollbacks
    assert first["step"] == spikes[0] and first["to_step"] < first["step"]
    assert first["skipped_steps"] == [first["to_step"] + 1, first["step"]] and first["rollback"] == 1
    assert second["rollback"] == 2 and second["of"] == 2
    # The state saved at the rollback's step is the older checkpoint's weights, not the spiking ones.
    rolled = _weights(Checkpoint.at_step(run_dir / "ckpt", first["step"]))
    target = _weights(Checkpoint.at_step(run_dir / "ckpt", first["to_step"]))
    assert rolled.keys() == target.keys() and all(torch.equal(rolled[k], target[k]) for k in rolled)
    # After the rollback the step's loss is back near the losses before the spike.
    assert result.losses[first["step"] + 1] < 2 * result.losses[first["to_step"]]


def test_a_run_stopped_after_a_rollback_resumes_exactly(spiky, tiny_corpus, tmp_path):
    """Stopped after the first rollback, the run resumes with its rollbacks counted (one left) and
    trains what the uninterrupted run trained."""
    run_dir, uninterrupted = spiky
    first = _records(run_dir, "rollback")[0]["step"]
    config = run_config_from_dict(_recipe(tiny_corpus, tmp_path, lr=2.0, **SPIKES))
    assert pretrain(config, exit_after_step=first + 1).final_step == first + 1
    resumed = pretrain(config)
    assert resumed.start_step == first + 1
    for step in range(first + 2, 17):
        assert resumed.losses[step] == uninterrupted.losses[step], f"step {step}"
    # Two in all (its limit): the count came back with the checkpoint, or a third would have come.
    assert len(_records(tmp_path, "rollback")) == 2


def test_the_non_finite_stop_rolls_back_until_none_is_left(tiny_corpus, tmp_path):
    recipe = _recipe(tiny_corpus, tmp_path, lr=1000.0, spike_rollbacks=1, max_nonfinite_steps=2)
    with pytest.raises(NonFiniteLossError, match=r"non-finite for 2 consecutive steps"):
        pretrain(run_config_from_dict(recipe))
    (rollback,) = _records(tmp_path, "rollback")
    assert rollback["reason"] == "2 non-finite steps in a row"
    assert rollback["to_step"] < rollback["step"] - 1  # a checkpoint before the first non-finite step


def test_a_save_after_a_rollback_records_the_weights_it_holds(tiny_corpus, tmp_path):
    """A rollback across a phase change: the checkpoint saved at the rollback's step holds the older
    step's weights, so it records that step (``Checkpoint.weights_step``) and what those weights
    trained with (the RoPE base in ``model_config.json``, the objective exports record), not the new
    phase's."""
    recipe = _recipe(tiny_corpus, tmp_path, lr=1000.0, spike_rollbacks=1, max_nonfinite_steps=2)
    recipe["phases"] = [{"objective": "mlm", "mask_ratio": 0.4, "share": 5 / 16},
                        {"objective": "mlm", "mask_ratio": 0.15, "share": 11 / 16, "rotary_base": 160000}]
    with pytest.raises(NonFiniteLossError):
        pretrain(run_config_from_dict(recipe))
    (rollback,) = _records(tmp_path, "rollback")
    assert rollback["to_step"] <= 5 < rollback["step"], rollback  # back across the change at step 5
    saved = Checkpoint.at_step(tmp_path / "ckpt", rollback["step"])
    assert saved.weights_step == rollback["to_step"]
    target = Checkpoint.at_step(tmp_path / "ckpt", rollback["to_step"])
    assert target.weights_step == target.step
    assert saved.model_config().rotary_base == target.model_config().rotary_base != 160000
    assert saved.trained_objective() == target.trained_objective()
    assert saved.trained_objective()["name"] == "mlm-40"
    later = [c for c in Checkpoint.every(tmp_path / "ckpt") if c.step > rollback["step"]]
    assert later and all(c.model_config().rotary_base == 160000 for c in later)  # trained on in phase 2


def test_a_wall_clock_cadence_saves_between_step_saves(tiny_corpus, tmp_path, capsys):
    """``checkpoint.save_interval_minutes`` far below a step's time: every step is saved though the
    step cadence (1,000) saves only the last; the dry run says what a failure loses at that cadence."""
    recipe = _recipe(tiny_corpus, tmp_path, lr=1e-3)
    recipe["training"]["train_iters"] = 4
    recipe["schedule"] = {**recipe["schedule"], "lr_warmup_iters": 1, "lr_wsd_decay_iters": 1}
    recipe["checkpoint"] = {**recipe["checkpoint"], "save_interval": 1000, "save_interval_minutes": 1e-4}
    pretrain(run_config_from_dict(recipe))
    assert [c.step for c in Checkpoint.every(tmp_path / "ckpt")] == [1, 2, 3, 4]
    import yaml

    from megatron_ext.cli import pretrain_encoder

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**recipe, "checkpoint": {**recipe["checkpoint"], "save_interval_minutes": 30}}))
    assert pretrain_encoder.main(["--config", str(path), "--dry-run"]) == 0
    assert "save cadence      every 1000 steps or 30 min: a failure loses at most" in capsys.readouterr().out


def test_recovery_settings_are_checked(tiny_corpus, tmp_path):
    with pytest.raises(UserError, match=r"training.loss_spike_factor must be > 1"):
        run_config_from_dict(_recipe(tiny_corpus, tmp_path, lr=1e-3, loss_spike_factor=0.5))
    no_save = _recipe(tiny_corpus, tmp_path, lr=1e-3, spike_rollbacks=1)
    no_save["checkpoint"] = {"save": None}
    with pytest.raises(ConfigError, match=r"spike_rollbacks=1 rolls back to a checkpoint of checkpoint.save"):
        run_config_from_dict(no_save)
    with pytest.raises(ConfigError, match=r"hang_timeout_minutes=10 is not shorter than parallel.distributed_timeout"):
        run_config_from_dict(_recipe(tiny_corpus, tmp_path, lr=1e-3, hang_timeout_minutes=10))
    with pytest.raises(UserError, match=r"checkpoint.save_interval_minutes must be > 0"):
        bad = _recipe(tiny_corpus, tmp_path, lr=1e-3)
        bad["checkpoint"]["save_interval_minutes"] = 0
        run_config_from_dict(bad)


def test_a_hung_rank_ends_the_job_in_bounded_time_named_and_the_rerun_resumes(tiny_corpus, tmp_path):
    """Two ranks under torchrun, a save every 10 steps; rank 1 is stopped (SIGSTOP: a node that stops
    answering) once its heartbeat says step 12, well before the run's 300 steps end on any machine
    (its heartbeat is written every 1.5 s: a 30-step run could end before a stop that waited for it).
    Within the hang timeout (6 s, the distributed timeout 10 min) the job ends with the resumable code
    75 and one line naming rank 1, its node and the step it last reported; the same command then
    resumes from the newest complete checkpoint and ends."""
    import os
    import re
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from megatron_ext.exit_codes import EXIT_STATUS_ENV, RESUMABLE_EXIT_CODE

    repo = Path(__file__).resolve().parents[2]
    recipe = tiny_recipe(tiny_corpus, tmp_path, phases=MLM,
                         training={"train_iters": 300, "eval_interval": 0, "log_interval": 10,
                                   "hang_timeout_minutes": 0.1},
                         checkpoint={"save": str(tmp_path / "ckpt"), "save_interval": 10})
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    status = tmp_path / "exit_status"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(repo / "pretrain_encoder.py"), "--config", str(path)]
    env = {**os.environ, EXIT_STATUS_ENV: str(status), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True)
    beat = tmp_path / "ckpt/heartbeats/rank-1.json"
    deadline = time.monotonic() + 300
    record = {"step": 0}
    try:
        while True:  # rank 1's own record of its progress: stop it once it has finished step 12
            assert run.poll() is None and time.monotonic() < deadline, run.stdout.read() if run.poll() is not None else ""
            try:
                record = json.loads(beat.read_text())
            except (OSError, ValueError):
                record = {"step": 0}
            if record["step"] >= 12:
                break
            time.sleep(0.05)
        os.kill(record["pid"], signal.SIGSTOP)
        stopped_at = time.monotonic()
        output, _ = run.communicate(timeout=180)
    finally:  # a failed check leaves no process behind (a stopped rank would hold its memory)
        if run.poll() is None:
            for end in (lambda: os.kill(record["pid"], signal.SIGKILL), lambda: os.killpg(run.pid, signal.SIGKILL)):
                with contextlib.suppress(KeyError, OSError):
                    end()
            run.wait()
    ended = time.monotonic() - stopped_at
    print(f"the job ended {ended:.0f} s after rank 1 stopped")
    assert ended < 6 + 20, output  # the timeout, plus torchrun ending its workers
    line = status.read_text()
    assert line.startswith(f"{RESUMABLE_EXIT_CODE} hang: rank 1 on {socket.gethostname()} last reported step "), \
        (line, output)
    hung_at = int(re.search(r"last reported step (\d+)", line)[1])
    ahead = int(re.search(r"the other ranks are at step (\d+)", line)[1])
    assert 12 <= hung_at <= ahead + 1 < 300 and "training.hang_timeout_minutes=0.1" in line, line
    assert output.count("hang: rank 1 on") == 1, output  # said once, by rank 0
    newest = Checkpoint.latest(tmp_path / "ckpt").step
    assert 10 <= newest <= ahead and newest % 10 == 0, (newest, line)
    resumed = pretrain(run_config_from_dict(recipe))  # the restart a launcher makes (here at DP=1)
    assert resumed.start_step == newest and resumed.final_step == 300


def test_a_waiting_rank_keeps_its_heartbeat_fresh_so_the_stuck_rank_is_the_one_named(tmp_path):
    """Ranks 0 and 2 finished step 12 and wait in the next collective; rank 1 wrote its step-12
    heartbeat after rank 2 did, then stopped. Rank 0's timeout runs out first. A waiting rank's watch
    thread writes its heartbeat again while it waits, so rank 0 finds rank 1's file the old one and
    names rank 1 (with only the beats after steps, rank 2's older file named the live rank 2)."""
    import threading

    from megatron_ext.training.watchdog import HangWatchdog

    seen, done = {0: [], 2: []}, {0: threading.Event(), 2: threading.Event()}

    def recorder(rank):
        def on_hang(line, says):
            seen[rank].append((line, says))
            done[rank].set()
        return on_hang

    beats = tmp_path / "hb"
    first = HangWatchdog(timeout_s=1.2, directory=beats, rank=0, node="node0", on_hang=recorder(0))
    first.start(12)
    time.sleep(0.15)  # half a watch interval (0.3 s): rank 2's timeout runs out after rank 0's
    second = HangWatchdog(timeout_s=1.2, directory=beats, rank=2, node="node2", on_hang=recorder(2))
    second.start(12)
    time.sleep(0.02)
    (beats / "rank-1.json").write_text(json.dumps(
        {"rank": 1, "node": "node1", "pid": 1, "step": 12, "time": time.time()}))
    assert done[0].wait(10) and done[2].wait(10)
    (line, says), = seen[0]
    assert says and line.startswith("hang: rank 1 on node1 last reported step 12 ("), line
    (line, says), = seen[2]
    assert not says and line.startswith("hang: rank 1 on node1 "), line


def test_the_watchdog_names_the_rank_behind_and_only_the_lowest_other_rank_says_it(tmp_path):
    """Three ranks' heartbeats (this process is rank 2, rank 0 at step 9, rank 1 stuck at step 7):
    after the timeout rank 2 names rank 1 but leaves the line to rank 0; alone, a rank names itself."""
    import threading

    from megatron_ext.training.watchdog import HangWatchdog

    seen, done = [], threading.Event()

    def on_hang(line, says):
        seen.append((line, says))
        done.set()

    for rank, step in ((0, 9), (1, 7)):
        (tmp_path / "hb").mkdir(exist_ok=True)
        (tmp_path / "hb" / f"rank-{rank}.json").write_text(json.dumps(
            {"rank": rank, "node": f"node{rank}", "pid": 1, "step": step, "time": 0.0}))
    watchdog = HangWatchdog(timeout_s=0.4, directory=tmp_path / "hb", rank=2, node="node2", on_hang=on_hang)
    watchdog.start(9)
    assert done.wait(10)
    (line, says), = seen
    assert line.startswith("hang: rank 1 on node1 last reported step 7 (") and not says
    assert "the other ranks are at step 9" in line and "rank 2 waited" in line
    alone = []
    solo = HangWatchdog(timeout_s=0.4, directory=tmp_path / "solo", rank=0, node="n",
                        on_hang=lambda line, says: alone.append((line, says)))
    solo.start(3)
    time.sleep(1.5)
    assert len(alone) == 1 and alone[0][1] and alone[0][0].startswith("hang: rank 0 on n last reported step 3")
    solo.stop()
