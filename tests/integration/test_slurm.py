"""The launch scripts under a real SLURM: ``examples/launch/slurm.sbatch`` submitted unchanged to a
private cluster on this host (``slurm_cluster`` fixture, tests/slurm_cluster.py: munged, slurmctld
and two slurmd), with only what a user of a CPU partition passes: ``--nodes=1 --gpus-per-node=0``,
``GPUS_PER_NODE``, ``PYTHON``, ``RECIPE`` (and ``--output``, ``--time``, ``--signal``).

What they check: a 2-rank job through srun + torchrun ends COMPLETED soon after its last step; a bad
recipe fails once, not requeued, its error in the log; real preemption by a job of a higher tier
(with and without ``preempt_send_user_signal``) mid-run and ``scancel --signal=USR1 --full`` while
a requeued run starts each leave a checkpoint of the step in flight and the requeued job resumes
from it with the losses of an uninterrupted run; so does a real time limit (cut short while the job trains, so that it falls
after start-up however loaded the machine) with the script's warning signal (SIGUSR1 to the batch
shell, which passes it on); 2 nodes x 1 rank train like 1 node x 2 ranks through the script's c10d
rendezvous.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import re
import signal
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from helpers import tiny_recipe
from slurm_cluster import FINAL_STATES
from megatron_ext.checkpoint.reader import latest_checkpoint
from megatron_ext.launch import Resources
from megatron_ext.exit_codes import RESUMABLE_EXIT_CODE


REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "examples" / "launch" / "slurm.sbatch"
# Launch-script settings of the test process's own environment that must not reach the jobs.
LAUNCH_ENV = ("RECIPE", "NNODES", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "TORCHRUN", "REPO_DIR",
              "DRY_RUN", "MAX_REQUEUES", "OMP_NUM_THREADS", "MEGATRON_EXT_EXIT_STATUS_FILE", "PYTHON")

LINE = r"^(?:\d+: )?"
"""The start of a trainer's line in a job's log: srun --label puts its task's number first."""
STOPPED_BY_SIGNAL = LINE + r"stopped after step (\d+)/\d+ \(signal (\w+)(?: on rank \d+ \([\w.-]+\))?\)"
"""A trainer's stop line: its step and the signal. A signal that reached another rank first (one
rank of two got scancel's SIGUSR1 before the other: a race, either order is right) is named with
that rank and its node."""
SHORT_STEPS = 100
"""The short recipe: a few seconds of steps after ~10 s of start-up."""
LONG = {"steps": 300, "data": {"micro_batch_size": 16, "global_batch_size": 128}}
"""The long recipe: 8,192 tokens a step, ~0.15 s on 2 idle cores (the tiny one's steps are mostly
overhead), so that its time-limit job is still training 50 s after it starts, when the warning comes
at the latest, even alone on the machine. Its reference runs at the same time on the other node,
which slows both: the pair takes about as long as the time-limit job alone."""


@dataclass
class Job:
    id: int
    run_dir: Path
    info: dict[str, str]
    """``scontrol show job`` at the end."""

    @property
    def log(self) -> str:
        return Path(self.info["StdOut"]).read_text(errors="replace")

    def losses(self) -> list[tuple[int, float]]:
        """(step, loss) of every train record in ``metrics.jsonl``, in the order written."""
        records = [json.loads(line) for line in (self.run_dir / "log" / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]

    def starts(self) -> list[int]:
        """The step each run of the job started from (the trainer's banner)."""
        return [int(m) for m in re.findall(LINE + r"training \d+ steps from step (\d+)", self.log, re.M)]


def _recipe(tiny_corpus, run_dir: Path, steps: int, training: dict | None = None, data: dict | None = None) -> Path:
    """The tiny recipe, saving only at its end (so a checkpoint mid-run is the one a stop wrote)."""
    recipe = tiny_recipe(tiny_corpus, run_dir,
                         training={"train_iters": steps, "eval_interval": 0, "log_interval": 1, **(training or {})},
                         checkpoint={"save": str(run_dir / "ckpt"), "save_interval": steps}, data=data or {})
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def _submit(cluster, recipe: Path, *flags: str, nodes: int = 1, procs: int = 2) -> int:
    """sbatch the launch script from the repository root, as its header shows."""
    env = {**{k: v for k, v in cluster.env.items() if k not in LAUNCH_ENV},
           "GPUS_PER_NODE": str(procs), "PYTHON": sys.executable, "RECIPE": str(recipe)}
    return cluster.sbatch([f"--nodes={nodes}", "--gpus-per-node=0", f"--output={recipe.parent}/%x-%j.out", *flags,
                           str(SBATCH)], env=env, cwd=REPO, replace_env=True)


def _finish(cluster, job_id: int, run_dir: Path, timeout: float = 600) -> Job:
    info = cluster.wait(job_id, timeout=timeout)
    return Job(job_id, run_dir, info)


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "log" / "metrics.jsonl"
    return path.read_text().count('"kind": "train"') if path.exists() else 0


def _end_time(info: dict[str, str]) -> float:
    return datetime.strptime(info["EndTime"], "%Y-%m-%dT%H:%M:%S").timestamp()


def _assert_resumed_exactly(job: Job, reference: Job, steps: int) -> None:
    """Every step logged once, in order, with the reference's loss; each run after the first started
    from the step the previous one stopped at (the checkpoint of its step in flight)."""
    losses = job.losses()
    assert [s for s, _ in losses] == list(range(1, steps + 1)), "a step was lost or run twice"
    assert dict(losses) == dict(reference.losses())
    stops = [int(m) for m in re.findall(LINE + r"stopped after step (\d+)/", job.log, re.M)]
    assert job.starts() == [0, *stops], job.log


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tiny_corpus, tmp_path_factory, time_limit_driver) -> dict[str, tuple[int, Path]]:
    """The jobs that need no test's attention, submitted together so that they share the two nodes:
    the long recipe uninterrupted (the reference) and under a time limit (driven from its
    submission on by ``time_limit_driver``, beside the other tests), the long recipe again (stopped
    three times by the preemption test, which runs while the others do), then the short recipe
    uninterrupted. Job id and run folder of each."""
    submitted = {}
    for name, steps, data, flags in [("long_reference", LONG["steps"], LONG["data"], ()),
                                     ("time_limit", LONG["steps"], LONG["data"],
                                      (f"--time={TIME_LIMIT_MINUTES}", f"--signal=B:USR1@{WARNING_S}")),
                                     ("preempted", LONG["steps"], LONG["data"], ()),
                                     ("short_reference", SHORT_STEPS, None, ())]:
        run_dir = tmp_path_factory.mktemp(name)
        submitted[name] = (_submit(slurm_cluster, _recipe(tiny_corpus, run_dir, steps, data=data), *flags), run_dir)
        if name == "time_limit":
            time_limit_driver.start(_time_limit_once, slurm_cluster, *submitted[name])
    return submitted


TIME_LIMIT_MINUTES = 30
"""The time-limit job's limit, but for its first run: generous, so that a run started on a loaded
machine (a trainer's start-up on 2 busy cores takes 60-90 s) finishes."""
WARNING_S = 120
"""Its ``--signal=B:USR1@``: SLURM sends the warning once the time left is below this."""


def _time_limit_once(cluster, job_id: int, run_dir: Path) -> None:
    """Once the job trains, its time limit is cut to end 45 to 105 s later: below the warning's
    lead, so SLURM warns at its next look (every 30 s) with time left for a step and a save, at a
    point that does not depend on how long start-up took. Once the stopped job is requeued, the
    generous limit is back for the runs after it."""
    _wait_for_steps(cluster, job_id, run_dir, 2)
    elapsed = Resources(time=cluster.job(job_id)["RunTime"]).time_s  # SLURM's clock, as it reads limits
    cluster.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={math.ceil((elapsed + 45) / 60)}"])
    deadline = time.monotonic() + 600
    while int((info := cluster.job(job_id))["Restarts"]) < 1:
        assert time.monotonic() < deadline and info["JobState"] not in FINAL_STATES, info
        time.sleep(0.25)
    cluster.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={TIME_LIMIT_MINUTES}"])


class _Driver:
    """One function run in a thread beside the tests; its outcome is a test's to check."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="driver")
        self._future: concurrent.futures.Future | None = None

    def start(self, function, *args) -> None:
        self._future = self._pool.submit(function, *args)

    def result(self, timeout: float) -> None:
        assert self._future is not None, "never started"
        self._future.result(timeout=timeout)


@pytest.fixture(scope="module")
def time_limit_driver() -> _Driver:
    """:func:`_time_limit_once`, started by ``jobs`` as soon as the job is submitted."""
    driver = _Driver()
    yield driver
    driver._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def long_reference(slurm_cluster, jobs) -> Job:
    return _finish(slurm_cluster, *jobs["long_reference"])


@pytest.fixture(scope="module")
def short_reference(slurm_cluster, jobs) -> Job:
    return _finish(slurm_cluster, *jobs["short_reference"])


@pytest.mark.slurm
@pytest.mark.slow
def test_bad_recipe_fails_once_and_is_not_requeued(slurm_cluster, tiny_corpus, tmp_path):
    recipe = _recipe(tiny_corpus, tmp_path, 8, training={"no_such_key": 1})
    job = _finish(slurm_cluster, _submit(slurm_cluster, recipe), tmp_path)
    assert job.info["JobState"] == "FAILED" and job.info["Restarts"] == "0", job.info
    # one line per rank (each names itself under torchrun), the key named
    assert re.search(r"pretrain_encoder\.py: error \(rank \d\): .*no_such_key", job.log), job.log[-2000:]
    assert "not requeued" in job.log and "(run 2)" not in job.log


def _wait_for_steps(cluster, job_id: int, run_dir: Path, steps: int) -> int:
    """Wait until the job has logged ``steps`` steps (it may wait for a node first); the steps logged.
    Fails, not hangs, if the job ends first."""
    deadline = time.monotonic() + 600
    checked = time.monotonic()
    while (seen := _steps_logged(run_dir)) < steps:
        if time.monotonic() - checked > 2:
            info = cluster.job(job_id)
            assert time.monotonic() < deadline and info["JobState"] in {"PENDING", "RUNNING", "COMPLETING"}, info
            checked = time.monotonic()
        time.sleep(0.05)
    return seen


def _wait_for_run_start(cluster, job_id: int, run: int) -> None:
    """Wait until the ``run``-th run of the job (1 first) has printed its first line: its batch shell
    has its traps and is about to start srun. The log is read often, SLURM asked every 2 s. Fails,
    not hangs, if the job ends first."""
    deadline = time.monotonic() + 600
    log = Path(cluster.job(job_id)["StdOut"])  # the same file for every run (--open-mode=append)
    banner = f"job {job_id} (run {run}): "
    checked = time.monotonic()
    while not (log.exists() and banner in log.read_text(errors="replace")):
        if time.monotonic() - checked > 2:
            info = cluster.job(job_id)
            assert time.monotonic() < deadline and info["JobState"] not in FINAL_STATES, info
            checked = time.monotonic()
        time.sleep(0.05)


def _wait_until_not_running(cluster, job_id: int) -> None:
    deadline = time.monotonic() + 300
    while cluster.job(job_id)["JobState"] == "RUNNING":
        assert time.monotonic() < deadline, f"job {job_id} still running 300 s after it was stopped"
        time.sleep(0.25)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(1200)  # 255 s alone, 402 s beside the other test worker; 600 s is the default
def test_preemption_and_scancel_full_save_the_step_in_flight_and_the_requeued_job_resumes(
        slurm_cluster, jobs, request):
    """The long recipe on 2 ranks, stopped three times: preempted by a job of the higher tier on its
    node after 20 steps of its run (SLURM sends SIGTERM to the job's steps), preempted again after 20
    steps of the requeued run with ``preempt_send_user_signal`` (the script's ``--signal=B:USR1`` to
    the batch shell, passed on), then ``scancel --signal=USR1 --full`` while the next requeued run
    starts (its batch shell has begun, its trainer not yet; SIGUSR1 to the batch shell's process
    group, which srun is kept out of): the processes of the step ignore it until the trainer has its
    handlers, and the batch shell repeats it until one lands. Each stop saves the step in flight
    well within the grace time and requeues. The job is one of ``jobs``: it shares the nodes with
    them while this test drives it."""
    job_id, run_dir = jobs["preempted"]
    stops = []  # (steps logged when stopped, how, the signal the trainer names first)
    preemptors = []
    try:
        for run, (how, signal_name) in enumerate([("preempted", "SIGTERM"), ("preempted, user signal", "SIGUSR1"),
                                                  ("scancel --signal=USR1 --full", "SIGUSR1")], start=1):
            # Counted from the steps logged when the previous run ended, not when it was signalled: a
            # preemption reaches the job seconds after the preemptor's submission, many steps later.
            logged_before = _steps_logged(run_dir)
            if how.startswith("preempted"):
                seen = _wait_for_steps(slurm_cluster, job_id, run_dir, logged_before + 20)
                slurm_cluster.send_user_signal(how.endswith("user signal"))
                node = slurm_cluster.job(job_id)["NodeList"]
                preemptors.append((slurm_cluster.preempt(job_id), node))
            else:
                _wait_for_run_start(slurm_cluster, job_id, run)
                seen = _steps_logged(run_dir)
                slurm_cluster.run(["scancel", "--signal=USR1", "--full", str(job_id)])
            _wait_until_not_running(slurm_cluster, job_id)
            stops.append((seen, how, signal_name))
    finally:
        slurm_cluster.send_user_signal(False)  # the session's cluster, as other tests expect it
    job = _finish(slurm_cluster, job_id, run_dir)
    assert job.info["JobState"] == "COMPLETED" and job.info["Restarts"] == "3", (job.info, job.log)
    stopped = re.findall(STOPPED_BY_SIGNAL, job.log, re.M)
    assert [name for _, name in stopped] == [name for _, _, name in stops], job.log
    for (seen, how, _), (step, _) in zip(stops, stopped):
        assert seen <= int(step) < LONG["steps"], (how, seen, step)
        assert f"resumable (stopped after step {step}" in job.log
    # the batch shell got scancel's SIGUSR1 itself and passed it on; the grace time did not run out
    assert "SIGUSR1 received" in job.log and "forcing job termination" not in job.log, job.log
    assert "DUE TO PREEMPTION" not in job.log, job.log
    for preemptor, node in preemptors:
        info = slurm_cluster.wait(preemptor, timeout=60)
        assert (info["JobState"], info["Partition"], info["NodeList"]) == \
            ("COMPLETED", slurm_cluster.preemptor_partition, node), info
    # the reference only now: as a parameter, pytest would wait for it before the test starts
    _assert_resumed_exactly(job, request.getfixturevalue("long_reference"), LONG["steps"])


@pytest.mark.slurm
@pytest.mark.slow
def test_two_rank_job_completes_within_a_minute_of_its_last_step(long_reference):
    job = long_reference
    assert job.info["JobState"] == "COMPLETED" and job.info["ExitCode"] == "0:0", (job.info, job.log)
    assert job.info["Restarts"] == "0"
    assert "1 nodes x 2 processes" in job.log and "training finished" in job.log
    assert [s for s, _ in job.losses()] == list(range(1, LONG["steps"] + 1))
    assert latest_checkpoint(job.run_dir / "ckpt").name == f"iter_{LONG['steps']:07d}"
    last_step_at = (job.run_dir / "log" / "metrics.jsonl").stat().st_mtime
    assert _end_time(job.info) - last_step_at < 60


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(1200)  # its own wait allows 900 s (_finish)
def test_time_limit_warning_saves_and_the_requeued_job_resumes(slurm_cluster, jobs, time_limit_driver,
                                                              long_reference):
    time_limit_driver.result(timeout=900)
    job = _finish(slurm_cluster, *jobs["time_limit"], timeout=900)
    assert job.info["JobState"] == "COMPLETED", (job.info, job.log)
    assert int(job.info["Restarts"]) >= 1, f"the job finished before its warning: LONG is too short\n{job.log}"
    assert "SIGUSR1 received" in job.log
    assert "SIGUSR1" in [name for _, name in re.findall(STOPPED_BY_SIGNAL, job.log, re.M)], job.log
    _assert_resumed_exactly(job, long_reference, LONG["steps"])


@pytest.mark.slurm
@pytest.mark.slow
def test_two_nodes_one_rank_each_train_like_one_node_with_two(slurm_cluster, tiny_corpus, tmp_path, short_reference):
    """Two slurmd on this host are two nodes; the script's c10d rendezvous joins one torchrun on each."""
    if len(slurm_cluster.nodes) < 2:
        pytest.skip("the private cluster has one node")
    job = _finish(slurm_cluster, _submit(slurm_cluster, _recipe(tiny_corpus, tmp_path, SHORT_STEPS), nodes=2, procs=1),
                  tmp_path)
    assert job.info["JobState"] == "COMPLETED", (job.info, job.log)
    assert job.info["NumNodes"] == "2" and "2 nodes x 1 processes" in job.log
    # the trainer's banner names each rank's node: the two nodes the script's "tasks:" line lists
    nodes = re.search(r"tasks: 0=(\S+) 1=(\S+)", job.log).groups()
    banner = re.search(r"2 ranks on 2 nodes \(([\w.-]+): rank 0, ([\w.-]+): rank 1\); this log is rank 0's", job.log)
    assert banner and set(banner.groups()) == set(nodes), job.log
    assert job.losses() == short_reference.losses()


def test_the_script_requeues_on_the_trainers_resumable_exit_code():
    """The script hard-codes the trainer's code (it decides before any Python runs)."""
    assert f"RESUMABLE_EXIT_CODE={RESUMABLE_EXIT_CODE}  # megatron_ext.exit_codes.RESUMABLE_EXIT_CODE" in \
        SBATCH.read_text()


# -- two nodes: stops, cancels and a crash ------------------------------------------------------------

def _trainer(cluster, job_id: int, rank: int, timeout: float = 300):
    """The trainer process of global ``rank`` in the job: a child of its node's torchrun agent (the
    data-loader and checkpoint-writer processes it starts share its environment, not its parent)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in psutil.process_iter(["environ", "ppid"]):
            environ = process.info["environ"] or {}
            if environ.get("SLURM_JOB_ID") == str(job_id) and environ.get("RANK") == str(rank):
                with contextlib.suppress(psutil.Error):
                    if "slurm_batch" in " ".join(psutil.Process(process.info["ppid"]).cmdline()):
                        return process, environ["SLURMD_NODENAME"]
        time.sleep(0.5)
    raise AssertionError(f"no trainer of rank {rank} in job {job_id}: {cluster.job(job_id)}")


def _stop_step(job: Job) -> int:
    return int(re.findall(LINE + r"stopped after step (\d+)/", job.log, re.M)[-1])


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_nodes_usr1_to_one_node_then_sigterm_at_the_time_limit_requeue_and_resume(
        slurm_cluster, tiny_corpus, tmp_path, long_reference):
    """2 nodes x 1 rank, the long recipe, no warning before the limit (``--signal=B:URG@1`` in place
    of the script's ``B:USR1``: a signal the batch shell ignores; SLURM sends a warning up to a
    minute early, so a short ``B:USR1`` would still warn). SIGUSR1 to one node's trainer only: both
    nodes stop after the same step and the job requeues. In the second run the time limit is cut
    to fall while it trains (its trainers paused until then): SLURM's SIGCONT and SIGTERM at the
    limit, the step saved within KillWait, and the job requeues (Reason=TimeLimit), once more."""
    job_id = _submit(slurm_cluster, _recipe(tiny_corpus, tmp_path, LONG["steps"], data=LONG["data"]),
                     f"--time={TIME_LIMIT_MINUTES}", "--signal=B:URG@1", nodes=2, procs=1)
    _wait_for_steps(slurm_cluster, job_id, tmp_path, 3)
    trainer, _ = _trainer(slurm_cluster, job_id, rank=1)
    trainer.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 600
    while int((info := slurm_cluster.job(job_id))["Restarts"]) < 1:
        assert time.monotonic() < deadline and info["JobState"] not in FINAL_STATES, info
        time.sleep(0.25)
    # the second run, once it trains: its limit 5 to 65 s ahead, SLURM looks every 30 s
    first_stop = _stop_step(Job(job_id, tmp_path, info))
    _wait_for_steps(slurm_cluster, job_id, tmp_path, first_stop + 1)
    elapsed = Resources(time=slurm_cluster.job(job_id)["RunTime"]).time_s
    slurm_cluster.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={math.ceil((elapsed + 5) / 60)}"])
    # Both trainers paused (SIGSTOP) until SLURM reaches the limit, however fast they train: at a time
    # limit SLURM sends SIGCONT, then SIGTERM, to every process of the job (slurmstepd).
    for rank in (0, 1):
        _trainer(slurm_cluster, job_id, rank=rank)[0].suspend()
    while int((info := slurm_cluster.job(job_id))["Restarts"]) < 2:
        assert time.monotonic() < deadline and info["JobState"] not in FINAL_STATES, \
            f"the job ended before its time limit (LONG too short?): {info}\n{Job(job_id, tmp_path, info).log}"
        time.sleep(0.25)
    slurm_cluster.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={TIME_LIMIT_MINUTES}"])
    job = _finish(slurm_cluster, job_id, tmp_path, timeout=900)
    assert job.info["JobState"] == "COMPLETED" and job.info["Restarts"] == "2", (job.info, job.log)
    stopped = re.findall(LINE + r"stopped after step \d+/\d+ \((signal \w+(?: on rank \d+ \([\w.-]+\))?)\)", job.log, re.M)
    # at the limit SLURM's SIGTERM reaches the trainers and the batch shell, which passes it on as
    # SIGUSR1: the trainer names whichever came first; the script knows it was no warning
    rank_1 = re.search(r"2 ranks on 2 nodes \((?:[\w.-]+): rank 0, ([\w.-]+): rank 1\)", job.log).group(1)
    assert stopped[0] == f"signal SIGUSR1 on rank 1 ({rank_1})" and len(stopped) == 2, job.log
    assert "DUE TO TIME LIMIT" in job.log and "; time limit); requeueing" in job.log, job.log
    assert "SIGTERM received" in job.log and "SIGUSR1 received" not in job.log  # no warning came
    _assert_resumed_exactly(job, long_reference, LONG["steps"])


@pytest.mark.slurm
@pytest.mark.slow
def test_two_nodes_plain_scancel_saves_and_ends_cancelled(slurm_cluster, tiny_corpus, tmp_path):
    """A plain ``scancel`` of a running 2-node job: every process gets SIGTERM, the step in flight is
    saved within KillWait, and the job ends CANCELLED, not requeued."""
    job_id = _submit(slurm_cluster, _recipe(tiny_corpus, tmp_path, LONG["steps"], data=LONG["data"]),
                     nodes=2, procs=1)
    _wait_for_steps(slurm_cluster, job_id, tmp_path, 3)
    slurm_cluster.run(["scancel", str(job_id)])
    job = _finish(slurm_cluster, job_id, tmp_path)
    time.sleep(5)  # a requeue would have shown by now
    job.info = slurm_cluster.job(job_id)
    assert job.info["JobState"] == "CANCELLED" and job.info["Restarts"] == "0", (job.info, job.log)
    step = _stop_step(job)
    assert 3 <= step < LONG["steps"] and latest_checkpoint(tmp_path / "ckpt").name == f"iter_{step:07d}"
    assert "cancelled (scancel)); not requeued" in job.log and "requeueing" not in job.log, job.log


@pytest.mark.slurm
@pytest.mark.slow
def test_scancel_signal_term_without_a_warning_saves_and_cancels(slurm_cluster, tiny_corpus, tmp_path):
    """``scancel --signal=TERM``: the trainers get SIGTERM and no warning came, so the script cancels
    the job once the step in flight is saved."""
    job_id = _submit(slurm_cluster, _recipe(tiny_corpus, tmp_path, LONG["steps"], data=LONG["data"]))
    _wait_for_steps(slurm_cluster, job_id, tmp_path, 3)
    slurm_cluster.run(["scancel", "--signal=TERM", str(job_id)])
    job = _finish(slurm_cluster, job_id, tmp_path)
    assert job.info["JobState"] == "CANCELLED" and job.info["Restarts"] == "0", (job.info, job.log)
    step = _stop_step(job)
    assert latest_checkpoint(tmp_path / "ckpt").name == f"iter_{step:07d}"
    assert "scancel --signal=TERM): cancelled); not requeued" in job.log, job.log


@pytest.mark.slurm
@pytest.mark.slow
def test_two_nodes_one_trainer_killed_the_job_names_its_node_and_why(slurm_cluster, tiny_corpus, tmp_path):
    """SIGKILL to one node's trainer mid-run: the job fails once, not requeued, and its last line and
    status file name that node, the rank and the signal (not the peer that srun ended)."""
    job_id = _submit(slurm_cluster, _recipe(tiny_corpus, tmp_path, LONG["steps"], data=LONG["data"]),
                     nodes=2, procs=1)
    _wait_for_steps(slurm_cluster, job_id, tmp_path, 3)
    trainer, node = _trainer(slurm_cluster, job_id, rank=1)
    trainer.send_signal(signal.SIGKILL)
    job = _finish(slurm_cluster, job_id, tmp_path)
    assert job.info["JobState"] == "FAILED" and job.info["Restarts"] == "0", (job.info, job.log)
    assert job.info["ExitCode"] == f"{128 + signal.SIGKILL}:0", (job.info, job.log[-3000:])
    cause = f"node {node}: rank 1 (local rank 0) killed by SIGKILL"
    last = job.log.rstrip().splitlines()[-1]  # the peer's consequence may follow ("; then node ...")
    assert re.search(rf"training failed \({re.escape(cause)}[;)].*not requeued$", last), job.log[-3000:]
    status = Path(job.info["StdOut"]).parent / f".exit-status-{job_id}"
    assert status.read_text().startswith(f"{128 + signal.SIGKILL} {cause}"), status.read_text()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_nodes_a_node_lost_during_a_save_resumes_from_the_last_complete_checkpoint(
        slurm_cluster, tiny_corpus, tmp_path, short_reference):
    """A save every 2 steps spread over two nodes (each writes its shards into the step's ``.tmp-``
    folder); rank 1's trainer is killed (SIGKILL: the node is lost) while a save is in flight. The job
    fails; the half-written folder is never listed as a checkpoint; every listed checkpoint is
    intact; the same recipe submitted again resumes from the newest complete one and trains the
    remaining steps exactly as the uninterrupted run did."""
    from megatron_ext.checkpoint.reader import Checkpoint

    if len(slurm_cluster.nodes) < 2:
        pytest.skip("the private cluster has one node")
    recipe = _recipe(tiny_corpus, tmp_path, SHORT_STEPS)
    raw = json.loads(recipe.read_text())
    raw["checkpoint"] = {**raw["checkpoint"], "save_interval": 2, "keep_last": 0}
    recipe.write_text(json.dumps(raw))
    job_id = _submit(slurm_cluster, recipe, nodes=2, procs=1)
    _wait_for_steps(slurm_cluster, job_id, tmp_path, 10)
    trainer, _ = _trainer(slurm_cluster, job_id, rank=1)
    deadline = time.monotonic() + 120
    while not any(".tmp-" in p.name for p in (tmp_path / "ckpt").iterdir()):  # a save in flight
        assert time.monotonic() < deadline and cluster_running(slurm_cluster, job_id), "no save seen in flight"
        time.sleep(0.002)
    trainer.send_signal(signal.SIGKILL)
    killed = _finish(slurm_cluster, job_id, tmp_path)
    assert killed.info["JobState"] == "FAILED", (killed.info, killed.log[-3000:])
    listed = Checkpoint.every(tmp_path / "ckpt")
    for checkpoint in listed:
        checkpoint.check_intact()
    newest = listed[-1].step
    assert all(checkpoint.step % 2 == 0 for checkpoint in listed) and newest < SHORT_STEPS
    resumed = _finish(slurm_cluster, _submit(slurm_cluster, recipe, nodes=2, procs=1), tmp_path)
    assert resumed.info["JobState"] == "COMPLETED", (resumed.info, resumed.log[-3000:])
    assert re.search(LINE + rf"training {SHORT_STEPS} steps from step {newest}:", resumed.log, re.M), resumed.log
    reference = dict(short_reference.losses())
    logged = resumed.losses()  # both jobs' steps, in the order written: the resumed job's come last
    first = max(i for i, (step, _) in enumerate(logged) if step == newest + 1)
    after = logged[first:]
    assert [s for s, _ in after] == list(range(newest + 1, SHORT_STEPS + 1))
    assert all(loss == reference[step] for step, loss in after), "a step after the resume differs"


def cluster_running(cluster, job_id: int) -> bool:
    return cluster.job(job_id)["JobState"] in {"PENDING", "RUNNING", "COMPLETING"}
