"""The edges of a long job: one trainer per save directory (the ranks of one run share
its lock, every rank of a second run is refused), damaged checkpoints named with the flag that
resumes past them, a full disk stopping the run with exit code 74 (synchronous and asynchronous
saves). Preemption by SLURM: tests/integration/test_slurm.py."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import tiny_recipe as _recipe
from megatron_ext.checkpoint import reader, storage
from megatron_ext.checkpoint.lock import LOCK_NAME, SaveDirectoryInUse, SaveDirectoryLock, SaveDirectoryLockLost
from megatron_ext.cli.entry import report_user_error
from megatron_ext.config_loading import UserError
from megatron_ext.exit_codes import STORAGE_EXIT_CODE
from megatron_ext.claims import Owner, claim_files

REPO = Path(__file__).resolve().parents[2]


def _claim_record(path: Path, **owner) -> None:
    """Write a claim file as another trainer would have."""
    fields = {"host": socket.gethostname(), "pid": os.getpid(), "started": 0.0, "pid_namespace": None, **owner}
    path.write_text(json.dumps({"owner": fields, "claimed_at": time.time()}))


def test_save_directory_lock_refuses_a_live_trainer_and_takes_over_a_dead_or_requeued_one(tmp_path, monkeypatch):
    save = tmp_path / "ckpt"
    with SaveDirectoryLock.acquire(save):
        with pytest.raises(SaveDirectoryInUse, match=rf"in use by another trainer: host {socket.gethostname()}, "
                                                      rf"pid {os.getpid()}, since 20\d\d-.* UTC"):
            SaveDirectoryLock.acquire(save)
    assert not save.exists()  # released: nothing left of a run that saved nothing
    save.mkdir()

    # A trainer of this host whose process is gone: taken over at once.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me = Owner.this_process()
    _claim_record(save / f"{LOCK_NAME}.claim-0", pid=gone.pid, started=me.started, pid_namespace=me.pid_namespace)
    with SaveDirectoryLock.acquire(save) as lock:
        assert lock._claim.generation == 1
    # Another host's trainer: refused while its heartbeat is fresh, taken over once it is 5 minutes old.
    _claim_record(save / f"{LOCK_NAME}.claim-0", host="elsewhere", pid=1)
    with pytest.raises(SaveDirectoryInUse, match="host elsewhere, pid 1"):
        SaveDirectoryLock.acquire(save)
    os.utime(save / f"{LOCK_NAME}.claim-0", (time.time() - 400, time.time() - 400))
    SaveDirectoryLock.acquire(save).release()
    # A SLURM requeue of the owner's job takes over at once; another job of the same restart does not.
    _claim_record(save / f"{LOCK_NAME}.claim-0", host="elsewhere", pid=1, slurm_job="4242")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(SaveDirectoryInUse, match=r"SLURM job 4242"):
        SaveDirectoryLock.acquire(save)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    SaveDirectoryLock.acquire(save).release()

    # Paused past the timeout and taken over meanwhile: the run stops before its next save, and
    # leaves the other trainer's lock in place.
    lock = SaveDirectoryLock.acquire(save)
    taker = lock._claim.generation + 1
    _claim_record(save / f"{LOCK_NAME}.claim-{taker}", host="elsewhere", pid=1)
    with pytest.raises(SaveDirectoryLockLost, match=r"another trainer took over the lock .* before saving step 6"):
        lock.check_held(before="saving step 6")
    lock.release()
    assert max(claim_files(save / LOCK_NAME)) == taker and (save / f"{LOCK_NAME}.claim-{taker}").exists()


def test_load_step_is_checked_with_the_other_checkpoint_keys():
    from megatron_ext.checkpoint.config import CheckpointConfig

    assert CheckpointConfig(save="s", load_step=4).load_step == 4
    for keys, message in (({"save": "s", "load_step": 0}, "load_step must be a saved step >= 1"),
                          ({"load_step": 4}, "needs checkpoint.save or checkpoint.load"),
                          ({"load": "l", "finetune": True, "load_step": 4}, "drop checkpoint.finetune")):
        with pytest.raises(UserError, match=message):
            CheckpointConfig(**keys)


def test_second_trainer_is_refused_in_one_line_before_building_its_model(tmp_path, tiny_corpus):
    recipe = _recipe(tiny_corpus, tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with SaveDirectoryLock.acquire(recipe["checkpoint"]["save"]):  # this test process is the first trainer
        run = subprocess.run([sys.executable, "pretrain_encoder.py", "--config", str(path)], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if ": error" in line]
    assert len(errors) == 1 and f"pid {os.getpid()}" in errors[0] and "another --save" in errors[0], run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "log").exists() and not list((tmp_path / "ckpt").glob("iter_*"))


def test_damaged_newest_checkpoint_metadata_or_shard_names_the_file_and_resumes_from_load_step(tmp_path, tiny_corpus):
    from megatron_ext.training.recipe import run_config_from_dict
    from megatron_ext.training.loop import pretrain

    recipe = _recipe(tiny_corpus, tmp_path, training={"train_iters": 4, "eval_interval": 0},
                     checkpoint={"save_interval": 2})
    first = pretrain(run_config_from_dict(recipe))
    newest = Path(first.checkpoint)
    marker = json.loads((newest / "checkpoint_complete.json").read_text())
    assert marker[reader.MANIFEST_KEY][".metadata"] == (newest / ".metadata").stat().st_size
    # Damaged metadata (cut short, as by a full disk or a copy that stopped) rather than a lost shard.
    metadata = (newest / ".metadata").read_bytes()
    (newest / ".metadata").write_bytes(metadata[: len(metadata) // 2])
    with pytest.raises(UserError, match=rf"^checkpoint {re.escape(str(newest))} is damaged: \.metadata has "
                                        rf"{len(metadata) // 2} bytes, {len(metadata)} recorded; complete checkpoints "
                                        r"left in .*: iter_0000002; resume from one with --load-step 2 "):
        pretrain(run_config_from_dict(recipe))
    (newest / ".metadata").write_bytes(metadata)

    (shard,) = newest.glob("*.distcp")
    size = shard.stat().st_size
    shard.unlink()

    with pytest.raises(UserError) as refused:
        pretrain(run_config_from_dict(recipe))
    message = str(refused.value)
    assert "\n" not in message and "Traceback" not in message
    assert message == (f"checkpoint {newest} is damaged: {shard.name} is missing ({size} bytes recorded); complete "
                       f"checkpoints left in {newest.parent}: iter_0000002; resume from one with --load-step 2 "
                       "(checkpoint.load_step: 2; a tool takes its directory)")
    resumed = pretrain(run_config_from_dict({**recipe, "checkpoint": {**recipe["checkpoint"], "load_step": 2}}))
    assert resumed.start_step == 2 and resumed.final_step == 4
    assert resumed.losses[4] == first.losses[4]  # the same steps again, exactly
    assert reader.Checkpoint(newest).damage() is None


@pytest.fixture
def small_filesystem(tmp_path):
    """A mount point of a 2 MiB tmpfs (skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_space_check_refuses_a_save_directory_that_cannot_hold_one_checkpoint(small_filesystem):
    check = storage.SpaceCheck(save_dir=small_filesystem / "ckpt", checkpoint_bytes=4 << 20, measured=False,
                               kept=2, existing_bytes=0)
    message, fatal = check.problem()
    assert fatal and "has 2.0 MiB free and one checkpoint needs about 4.0 MiB" in message
    message, fatal = storage.SpaceCheck(save_dir=small_filesystem, checkpoint_bytes=800 << 10, measured=True,
                                        kept=2, existing_bytes=0).problem()
    assert not fatal and "keep_last=2" in message


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_during_a_save_stops_with_exit_74_keeping_the_previous_checkpoint(tmp_path, tiny_corpus,
                                                                                    small_filesystem, async_save):
    """Synchronous, or asynchronous where the writer process fails after training went on."""
    from megatron_ext.training.recipe import run_config_from_dict
    from megatron_ext.training.loop import pretrain
    from megatron_ext.training.preflight import checkpoint_bytes_estimate

    # A 2 MiB disk: the model shrunk so that one checkpoint fits and the second (beside it) does not.
    recipe = _recipe(tiny_corpus, tmp_path, training={"train_iters": 4, "eval_interval": 0},
                     model={"vocab_size": 1024, "hidden_size": 48, "ffn_hidden_size": 96, "num_layers": 1},
                     checkpoint={"save": str(small_filesystem / "ckpt"), "save_interval": 2,
                                 "async_save": async_save})
    config = run_config_from_dict(recipe)
    assert (2 << 20) / 2 < checkpoint_bytes_estimate(config) < (2 << 20) * 0.8
    with pytest.raises(storage.CheckpointStorageError) as stopped:
        pretrain(config)
    message = str(stopped.value)
    assert message.startswith(f"saving step 4 into {small_filesystem / 'ckpt'} failed: No space left on device "
                              "(it needs about ") and "\n" not in message, message
    assert "iter_0000002 stays the newest complete checkpoint" in message
    assert report_user_error("pretrain_encoder.py", stopped.value) == STORAGE_EXIT_CODE == 74
    left = sorted(path.name for path in (small_filesystem / "ckpt").iterdir())
    assert left == ["iter_0000002", "latest_checkpointed_iteration.txt"], left  # no .tmp-, no lock


# One rank of a run on torch.distributed (gloo; argv: save directory, release file, rendezvous file,
# rank): takes the save directory's lock with the other rank, says which outcome it got on stdout,
# and (holding it) waits until the release file exists.
_LOCK_RANK = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
from megatron_ext.checkpoint.lock import SaveDirectoryInUse, SaveDirectoryLock

dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=int(sys.argv[4]), world_size=2)
try:
    lock = SaveDirectoryLock.acquire(sys.argv[1])
except SaveDirectoryInUse as refused:
    print(f"refused: {refused}", flush=True)
    dist.destroy_process_group()  # as the trainer does on its way out (a live gloo group at exit may abort)
    sys.exit(2)
print(f"held by rank {dist.get_rank()}, pid {os.getpid()}", flush=True)
while not Path(sys.argv[2]).exists():
    time.sleep(0.05)
dist.barrier()
lock.release()
"""


def _start_run(save: Path, release: Path, rendezvous: Path) -> list[subprocess.Popen]:
    """The two ranks of one run (one process each)."""
    return [subprocess.Popen([sys.executable, "-c", _LOCK_RANK, str(save), str(release), str(rendezvous), str(rank)],
                             cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for rank in range(2)]


def test_the_ranks_of_one_run_share_the_lock_and_every_rank_of_a_second_run_is_refused(tmp_path):
    save, release = tmp_path / "ckpt", tmp_path / "release"
    first = _start_run(save, release, tmp_path / "first.rendezvous")
    try:
        lines = [rank.stdout.readline() for rank in first]  # both ranks past acquire: the lock is held
        assert [line.split(", pid")[0] for line in lines] == ["held by rank 0", "held by rank 1"], \
            [rank.stderr.read()[-2000:] for rank in first]
        owner_pid = int(lines[0].split("pid ")[1])
        assert sorted(path.name for path in save.iterdir()) == [f"{LOCK_NAME}.claim-0"]  # one lock, rank 0's

        second = _start_run(save, tmp_path / "never", tmp_path / "second.rendezvous")
        outcomes = [rank.communicate(timeout=120) for rank in second]
        assert [rank.returncode for rank in second] == [2, 2], outcomes
        for out, _ in outcomes:  # every rank stops on the same one line, naming the first run's rank 0
            assert out.startswith("refused: checkpoint.save=") and out.count("\n") == 1, out
            assert re.search(rf"pid {owner_pid}\b", out), out

        release.touch()
        assert [rank.wait(timeout=120) for rank in first] == [0, 0], [rank.stderr.read()[-2000:] for rank in first]
    finally:
        for rank in first:
            rank.kill()
            rank.wait()
    assert not save.exists()  # released by rank 0: nothing left
