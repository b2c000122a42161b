"""Evaluation at scale: claims (one winner, expiry of a paused owner, takeover from a killed one),
N ``tools/evaluate.py`` workers sharing one grid (each run once, the one-process summary), a
SIGKILLed worker's run taken over, ``--summary-only`` from a partial grid, and several checkpoints
of a save directory as models ``NAME@STEP`` (parsing, refusals, tokens in the summary)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_ext.config_loading import UserError
from megatron_ext.eval import grid, harness, render
from megatron_ext.claims import Claim, ClaimPolicy, Holder, Owner, claim_files, try_claim
from eval_fixtures import TINY, encoder, suite  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[2]
GRID = ["--tasks", "rt_sentiment", "--lrs", "1e-4", "1e-3", "--seeds", "0", "1", "--max-steps", "3",
        "--batch-size", "8", "--max-eval-examples", "16", "--max-length", "32", "--device", "cpu"]
"""The shared grid: 3 models (a checkpoint at 2 steps, and MiniLM) x 2 LRs x 2 seeds = 12 runs."""
LRS, SEEDS = (1e-4, 1e-3), (0, 1)


@pytest.fixture(scope="module")
def tiny_save(tmp_path_factory, tiny_corpus) -> Path:
    """A Megatron save directory with complete checkpoints at steps 1 and 2 of a tiny MLM encoder
    (global batch 8 x 64 tokens: 512 tokens a step)."""
    from helpers import tiny_recipe
    from megatron_ext.training.recipe import run_config_from_dict
    from megatron_ext.training.loop import pretrain

    root = tmp_path_factory.mktemp("tiny_save")
    recipe = tiny_recipe(tiny_corpus, root, training={"train_iters": 2, "eval_interval": 0},
                         checkpoint={"save": str(root / "ckpt"), "save_interval": 1},
                         schedule={"lr": 1e-3, "lr_decay_style": "constant", "lr_warmup_iters": 0},
                         phases=[{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}])
    recipe["schedule"].pop("lr_wsd_decay_iters")
    pretrain(run_config_from_dict(recipe))
    return root / "ckpt"


def _worker(out: Path, models: list[str], suite_dir: Path, *extra: str) -> subprocess.Popen:
    """``tools/evaluate.py`` in a process of its own (this checkout's package, one thread)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(REPO / "tools" / "evaluate.py"), "--models", *models, *GRID,
                             "--suite-dir", str(suite_dir), "--output-dir", str(out), *extra],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# ----------------------------------------------------------------------------- claims

_HOLDER = """
import sys
from pathlib import Path
from megatron_ext.claims import ClaimPolicy, Owner, try_claim
claim = try_claim(Path(sys.argv[1]), owner=Owner.this_process(), policy=ClaimPolicy(timeout_s=float(sys.argv[2])))
print(type(claim).__name__, flush=True)
sys.stdin.readline()
print("held" if claim.held() else "lost", flush=True)
"""


def _holder(base: Path, timeout_s: float) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", _HOLDER, str(base), str(timeout_s)], cwd=REPO, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
    assert process.stdout.readline().strip() == "Claim"
    return process


def test_exactly_one_worker_wins_a_claim_or_a_takeover(tmp_path):
    """Six threads claim at once, on a free unit and on one whose claim was given back: one wins."""
    me, policy = Owner.this_process(), ClaimPolicy(timeout_s=60)
    base = tmp_path / "unit"
    for round_ in range(8):
        if round_ % 2:
            given_back = try_claim(base, owner=me, policy=policy)
            assert isinstance(given_back, Claim)
            given_back.release()  # expired at once
        barrier = threading.Barrier(6)

        def take(_):
            barrier.wait()
            return try_claim(base, owner=me, policy=policy)

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(take, range(6)))
        (winner,) = [g for g in got if isinstance(g, Claim)]
        assert winner.generation == round_ % 2 and (winner.taken_from is not None) == bool(round_ % 2)
        assert all(isinstance(g, Holder) and g.generation == winner.generation for g in got if g is not winner)
        winner.finish()
        assert claim_files(base) == {}


def test_claim_of_a_paused_owner_expires_and_of_a_killed_one_at_once(tmp_path):
    here = Owner.this_process()
    # A paused (SIGSTOP) owner keeps its pid: only its missed heartbeats (every 0.3 s) end the claim.
    policy = ClaimPolicy(timeout_s=3.0)
    paused = _holder(tmp_path / "paused", timeout_s=policy.timeout_s)
    try:
        held = try_claim(tmp_path / "paused", owner=here, policy=policy)
        assert isinstance(held, Holder) and held.owner.pid == paused.pid and held.age_s < policy.timeout_s
        paused.send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        assert isinstance(try_claim(tmp_path / "paused", owner=here, policy=policy), Holder)
        time.sleep(policy.timeout_s)
        taken = try_claim(tmp_path / "paused", owner=here, policy=policy)
        assert isinstance(taken, Claim) and taken.generation == 1 and taken.taken_from.owner.pid == paused.pid
        paused.send_signal(signal.SIGCONT)
        paused.stdin.write("\n")
        paused.stdin.flush()
        assert paused.stdout.readline().strip() == "lost"  # it would discard its work
        assert taken.held()
        taken.finish()
    finally:
        paused.kill()
        paused.wait()
    # A killed owner on this host is seen dead at once, long before a timeout.
    killed = _holder(tmp_path / "killed", timeout_s=600.0)
    killed.kill()
    killed.wait()
    taken = try_claim(tmp_path / "killed", owner=here, policy=ClaimPolicy(timeout_s=600.0))
    assert isinstance(taken, Claim) and taken.taken_from.owner.pid == killed.pid and taken.taken_from.age_s < 60
    taken.finish()
    with pytest.raises(UserError, match="--claim-timeout must be > 0 seconds"):
        ClaimPolicy(timeout_s=0)


def test_tasks_sharing_a_training_are_one_unit(tmp_path):
    """Retrieval tasks trained on the same pairs are fine-tuned at once: one unit, one claim."""
    tasks = []
    for name in ("nq", "msmarco", "other"):
        (tmp_path / name).mkdir()
        key = "other-pairs" if name == "other" else "ms-marco-pairs"
        (tmp_path / name / "task.json").write_text(json.dumps({"family": "ir", "splits": {"train": {"sha256": key}}}))
        tasks.append(grid.TaskRef(name=name, task_dir=tmp_path / name, family="ir", metric="ndcg@10"))
    model = grid.ModelRef(name="m", hf_dir=tmp_path, source="m", base_model="m", checkpoint_step=None,
                             pretrain_tokens=None)
    from megatron_ext.eval.finetuning import FinetuneConfig

    specs = {("m", task.name, lr, 0): grid.RunSpec(model=model, task=task, config=FinetuneConfig(lr=lr, seed=0),
                                                      path=grid.run_path(tmp_path, "m", task.name, lr, 0))
             for task in tasks for lr in LRS}
    units = grid.grid_units(specs, grid.shared_runs(tasks))
    assert [[spec.task.name for spec in unit.specs] for unit in units] == [["nq", "msmarco"]] * 2 + [["other"]] * 2
    assert units[0].claim_base == tmp_path / "runs" / "m" / "msmarco" / "lr0.0001_seed0"  # first by name


# ----------------------------------------------------------------------------- workers


def _records(out: Path) -> dict[Path, dict]:
    return {path: json.loads(path.read_text()) for path in sorted((out / "runs").rglob("*.json"))}


def test_three_workers_share_a_grid_and_write_the_one_process_summary(tmp_path, suite, encoder, tiny_save):
    models = [f"tiny={tiny_save}@all", f"minilm={encoder}"]
    shared = tmp_path / "shared"
    workers = [_worker(shared, models, suite) for _ in range(3)]
    logs = [worker.communicate(timeout=300)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0, 0], logs

    records = _records(shared)
    assert len(records) == 3 * 2 * 2
    pids = {f"{os.uname().nodename}:{worker.pid}" for worker in workers}
    assert {record["worker"] for record in records.values()} <= pids
    # Each run fine-tuned once: one progress line for it in all the logs together.
    done = [line for log in logs for line in log.splitlines() if re.search(r"\[\d+/12 runs done, ETA", line)]
    described = [re.sub(r".*runs done, ETA [^]]*\] ", "", line) for line in done]
    assert len(described) == 12 and len(set(r.split(":")[0] for r in described)) == 12
    ran = [int(re.search(r"^(\d+) run\(s\) fine-tuned", log, re.M)[1]) for log in logs]
    assert sum(ran) == 12, logs
    assert sum(log.count(": writing EuroBertForMaskedLM") for log in logs) == 2  # tiny@1, tiny@2: once each
    assert not list(shared.rglob("*.claim-*"))  # every claim finished
    assert sum("summary: " in log for log in logs) >= 1  # the last to finish (or two at once)

    alone = harness.evaluate_models(models, ["rt_sentiment"], output_dir=tmp_path / "alone", lrs=LRS, seeds=SEEDS,
                                    overrides=TINY, suite_dir=suite)
    assert (alone.executed, alone.reused, alone.by_others, alone.missing) == (12, 0, 0, ())
    summary = json.loads((shared / "summary.json").read_text())
    assert summary == json.loads((tmp_path / "alone" / "summary.json").read_text())
    rows = {row["model"]: row for row in summary["results"]}
    assert {name: (row["base_model"], row["checkpoint_step"], row["pretrain_tokens"]) for name, row in rows.items()} \
        == {"tiny@1": ("tiny", 1, 512), "tiny@2": ("tiny", 2, 1024), "minilm": ("minilm", None, None)}
    markdown = (shared / "summary.md").read_text()
    assert "## Score vs pretraining tokens" in markdown and "### tiny" in markdown
    assert f"| 2 | 1.02k | {render.pm(rows['tiny@2']['test_mean'], rows['tiny@2']['test_ci95'])} |" in markdown
    assert (shared / "plots" / "tokens" / "rt_sentiment.png").read_bytes().startswith(b"\x89PNG")
    assert (shared / "summary.csv").read_text().splitlines()[0].startswith("model,base_model,checkpoint_step,")

    # On demand, from a partial grid: the runs present, the missing ones listed.
    partial = tmp_path / "partial"
    shutil.copytree(shared, partial)
    (partial / "summary.json").unlink()
    grid.run_path(partial, "minilm", "rt_sentiment", 1e-3, 1).unlink()
    evaluation = harness.evaluate_models(models, ["rt_sentiment"], output_dir=partial, lrs=LRS, seeds=SEEDS,
                                         overrides=TINY, suite_dir=suite, summary_only=True)
    assert evaluation.executed == 0 and [spec.model.name for spec in evaluation.missing] == ["minilm"]
    summary = json.loads((partial / "summary.json").read_text())
    assert summary["missing_runs"] == ["runs/minilm/rt_sentiment/lr0.001_seed1.json"]
    assert {row["model"]: row["runs"] for row in summary["results"]} == {"tiny@1": 4, "tiny@2": 4, "minilm": 3}
    assert "**Incomplete:** 1 of 12 runs have no record yet" in (partial / "summary.md").read_text()


def _killed_mid_run(worker: subprocess.Popen, claim: Path, how: signal.Signals) -> str:
    """Send ``how`` to ``worker`` half a second after it claimed ``claim`` (loading the model or
    fine-tuning: 200 steps); its log."""
    deadline = time.monotonic() + 120
    while not claim.exists():
        assert worker.poll() is None and time.monotonic() < deadline, worker.communicate()[0]
        time.sleep(0.02)
    time.sleep(0.5)
    worker.send_signal(how)
    return worker.communicate(timeout=60)[0]


def test_stopped_or_killed_workers_run_is_taken_over(tmp_path, suite, encoder):
    """A worker stopped by SIGTERM (SLURM's time limit, scancel) gives its run back at once; one
    SIGKILLed mid-run leaves its claim, which the next worker takes over (a dead process on this host)."""
    out = tmp_path / "eval"
    models = [f"minilm={encoder}"]
    one_run = ("--lrs", "1e-4", "--seeds", "0", "--max-steps", "200")
    record = grid.run_path(out, "minilm", "rt_sentiment", 1e-4, 0)

    stopped = _worker(out, models, suite, *one_run)
    log = _killed_mid_run(stopped, record.with_suffix(".claim-0"), signal.SIGTERM)
    assert stopped.returncode == 128 + signal.SIGTERM, log
    assert "SIGTERM received: the run in flight is given back to the other workers" in log
    assert record.with_suffix(".claim-0").stat().st_mtime == 0 and not record.exists()

    killed = _worker(out, models, suite, *one_run)
    log = _killed_mid_run(killed, record.with_suffix(".claim-1"), signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL and not record.exists()
    assert f"minilm rt_sentiment lr=0.0001 seed=0: taking over the expired claim of {os.uname().nodename}:" \
           f"{stopped.pid}, heartbeat" in log

    evaluation = harness.evaluate_models(models, ["rt_sentiment"], output_dir=out, lrs=(1e-4,), seeds=(0,),
                                         overrides={**TINY, "max_steps": 200}, suite_dir=suite,
                                         claims=ClaimPolicy(timeout_s=600.0))  # no waiting for a timeout
    assert evaluation.executed == 1 and evaluation.summary_written
    data = json.loads(record.read_text())
    assert data["worker"] == Owner.this_process().label and data["steps"] == 200
    assert not list(out.rglob("*.claim-*"))


@pytest.mark.slurm
def test_job_array_of_workers_shares_the_grid(slurm_cluster, tmp_path, suite, encoder):
    """examples/launch/evaluate.sbatch as its header shows, on a CPU partition: three array tasks
    on two one-core nodes fine-tune the four runs once between them and one writes the summary."""
    out = tmp_path / "eval"
    job = slurm_cluster.sbatch(
        ["--array=0-2", "--gpus=0", "--cpus-per-task=1", f"--output={tmp_path}/%x-%A_%a.out",
         str(REPO / "examples" / "launch" / "evaluate.sbatch"), "--models", f"minilm={encoder}", *GRID,
         "--suite-dir", str(suite), "--output-dir", str(out)],
        env={"PYTHON": sys.executable, "PYTHONPATH": str(REPO)}, cwd=REPO)
    infos = [slurm_cluster.wait(f"{job}_{task}", timeout=300) for task in range(3)]
    logs = [Path(info["StdOut"]).read_text() for info in infos]
    assert [info["JobState"] for info in infos] == ["COMPLETED"] * 3, logs
    assert all(f"array task {task} of job {job} on " in log for task, log in enumerate(logs))
    records = _records(out)
    assert len(records) == 4
    assert sum(int(re.search(r"^(\d+) run\(s\) fine-tuned", log, re.M)[1]) for log in logs) == 4, logs
    (row,) = json.loads((out / "summary.json").read_text())["results"]
    assert row["runs"] == 4 and not list(out.rglob("*.claim-*"))


# ----------------------------------------------------------------------------- checkpoints per model


def test_checkpoints_of_a_save_directory_as_models(tmp_path, tiny_save, encoder):
    def resolve(*models: str) -> list[grid.ModelRef]:
        return harness.resolve_models(list(models), tmp_path, export=False)

    every = resolve(f"mlm={tiny_save}@all")
    assert [(m.name, m.base_model, m.checkpoint_step, m.pretrain_tokens) for m in every] == [
        ("mlm@1", "mlm", 1, 512), ("mlm@2", "mlm", 2, 1024)]
    assert every[0].source.endswith("iter_0000001") and every[0].hf_dir == tmp_path / "exported" / "mlm@1"
    assert [m.name for m in resolve(f"mlm={tiny_save}@2,1")] == ["mlm@1", "mlm@2"]
    assert [m.name for m in resolve(f"mlm={tiny_save}@2", f"hf={encoder}")] == ["mlm@2", "hf"]
    (latest,) = resolve(str(tiny_save))  # a save directory alone: its newest checkpoint, named as today
    assert (latest.name, latest.checkpoint_step, latest.pretrain_tokens) == ("ckpt", 2, 1024)

    with pytest.raises(UserError, match=r"has no complete checkpoint at step\(s\) 3, 5; it has step\(s\) 1, 2"):
        resolve(f"mlm={tiny_save}@1,3,5")
    with pytest.raises(UserError, match=r"step\(s\) 2 given twice"):
        resolve(f"mlm={tiny_save}@2,2")
    with pytest.raises(UserError, match=r"@all picks checkpoints of a save directory, and .* holds no complete"):
        resolve(f"hf={encoder}@all")
    with pytest.raises(UserError, match=r"@1 picks checkpoints of a save directory"):
        resolve(f"one={tiny_save / 'iter_0000001'}@1")
    with pytest.raises(UserError, match=r"ckpt@latest is not a directory"):
        resolve(f"mlm={tiny_save}@latest")
    with pytest.raises(UserError, match="two models are named 'mlm'"):
        resolve(f"mlm={tiny_save}@1", f"mlm={tiny_save}@2")
