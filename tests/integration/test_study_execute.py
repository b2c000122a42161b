"""``tools/run_study.py``: a study's segments trained by the local executor and by the SLURM one,
with real trainers on real data (the tiny news corpus), tiny models and a few steps.

Local: a study of two sizes, each a from-scratch run and a continued pretraining (CPT) from it;
one size's data is missing at first. Its run fails at start-up and blocks its CPT only, the other
size trains; a rerun with the data in place is stopped by SIGINT (the trainer saves the step in
flight, exit 75), and the next rerun skips what is complete, resumes the stopped run from its
checkpoint and finishes the study. SLURM (private cluster, ``slurm_cluster``): two seeds, each a
run and its CPT; the CPT job starts after its parent's job ends; ``scancel`` of one run's job
cancels its CPT's job only, and a rerun resubmits both and finishes the study.

Branch segments (``checkpoint.branch_from``) are the planner's and trainer's (their recipe keys
come with the branch setting); the branch test runs once ``CheckpointConfig`` has the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from helpers import tiny_recipe
from megatron_ext.checkpoint.config import CheckpointConfig
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.cli import run_study as cli
from megatron_ext.study.state import StudyDir
from megatron_ext.training.recipe import read_recipe
from megatron_ext.exit_codes import RESUMABLE_EXIT_CODE

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "run_study.py"
TRUNK_STEPS = 40
CPT_STEPS = 8
BRANCHING = "branch_from" in {f.name for f in dataclasses.fields(CheckpointConfig)}


def _base(corpus: dict[str, str], root: Path, **sections) -> dict:
    """The tiny recipe as a study's base: no phases, no step count, no output paths (the study's)."""
    recipe = tiny_recipe(corpus, root, training={"eval_interval": 0, "log_interval": 1},
                         checkpoint={"save_interval": 1000}, **sections)
    del recipe["phases"], recipe["training"]["train_iters"], recipe["checkpoint"]["save"]
    del recipe["logging"]["log_dir"]
    return recipe


def _study(root: Path, name: str, bases: dict[str, dict], size_fields: dict | None = None, **fields) -> Path:
    """A study file under ``root`` with one size per base recipe (written beside it)."""
    sizes = []
    for size, base in bases.items():
        (root / f"{size}.yaml").write_text(yaml.safe_dump(base))
        sizes.append({"name": size, "base": f"{size}.yaml", **(size_fields or {})})
    study = {"name": name, "sizes": sizes, "budgets": [TRUNK_STEPS], "objectives": [{"objective": "clm"}],
             "cpt": {"sources": ["clm"], "continuations": [{"steps": CPT_STEPS}]},
             "output": {"save": str(root / "out" / "{run}" / "ckpt"), "log_dir": str(root / "out" / "{run}" / "log")},
             **fields}
    path = root / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def _step(save: Path) -> int | None:
    checkpoint = Checkpoint.latest(save)
    return None if checkpoint is None else checkpoint.step


def _attempts(log: Path) -> int:
    """Trainer starts in a local log (the executor writes a header line before each)."""
    return log.read_text().count("=== ") if log.exists() else 0


def _row(out: str, run: str) -> str:
    """The status-table row of ``run`` in the last table printed (a dry run's cost table, printed after
    it, lists the runs too)."""
    out = re.split(r"^cost ", out, flags=re.M)[0]
    rows = re.findall(rf"^  (?:[├└]── )?{re.escape(run)} .*$", out, re.M)
    assert rows, out
    return rows[-1]


@pytest.mark.slow  # six trainer starts (one under torchrun), each ~10 s of imports and set-up
def test_local_failure_blocks_descendants_only_and_reruns_finish(tmp_path, tiny_corpus, capsys):
    late = tmp_path / "late"  # the second size's data: missing at first
    bases = {"late": _base(tiny_corpus, tmp_path, data={"data_path": [str(late / "news_text_document")],
                                                         "micro_batch_size": 16, "global_batch_size": 32}),
             "tiny": _base(tiny_corpus, tmp_path)}
    study = _study(tmp_path, "grid", bases)
    study_dir = tmp_path / "study_dir"
    save = {run: tmp_path / "out" / run / "ckpt" for run in
            ("late_clm_40", "late_clm_40_cpt_mlm_40_8", "tiny_clm_40", "tiny_clm_40_cpt_mlm_40_8")}
    logs = {run: study_dir / "logs" / f"{run}.log" for run in save}

    # 1. The late size fails at start-up; its CPT is blocked; the other size's runs train.
    code = cli.main([str(study), "--launcher", "local", "--study-dir", str(study_dir)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(r"^\[1/4\] late_clm_40: FAILED \(exit 2: error: data\.data_path: .*late/news_text_document\.idx "
                     r"does not exist, and .*late holds no dataset", out, re.M), out
    assert "pretrain_encoder.py: error: data.data_path" in out  # the log's tail
    assert "[2/4] late_clm_40_cpt_mlm_40_8: blocked (late_clm_40 failed)" in out
    assert re.search(r"^\[4/4\] tiny_clm_40_cpt_mlm_40_8: complete in .* \| study: 2/2 segments, 48/48 steps", out,
                     re.M), out
    assert "failed: exit 2" in _row(out, "late_clm_40")
    assert "blocked: late_clm_40 failed" in _row(out, "late_clm_40_cpt_mlm_40_8")
    assert _row(out, "tiny_clm_40").endswith("complete") and _row(out, "tiny_clm_40_cpt_mlm_40_8").endswith("complete")
    assert _step(save["tiny_clm_40"]) == TRUNK_STEPS and _step(save["tiny_clm_40_cpt_mlm_40_8"]) == CPT_STEPS
    assert _step(save["late_clm_40"]) is None and not logs["late_clm_40_cpt_mlm_40_8"].exists()
    # The CPT started from its source's final weights (the recipe the planner wrote: load + finetune).
    cpt_config = Checkpoint.latest(save["tiny_clm_40_cpt_mlm_40_8"]).run_config()["checkpoint"]
    assert (cpt_config["load"], cpt_config["finetune"]) == (str(save["tiny_clm_40"]), True)
    plan = json.loads((study_dir / "plan.json").read_text())
    for run in plan["runs"]:
        assert read_recipe(study_dir / "recipes" / f"{run['name']}.yaml") == run["recipe"]

    # 2. With the data in place: SIGINT while the late run trains (2 ranks under torchrun, whose own
    # exit code would be 1: the trainer's 75 comes from its exit-status file); it saves its step in flight.
    late.mkdir()
    for suffix in (".bin", ".idx"):
        (late / f"news_text_document{suffix}").symlink_to(tiny_corpus["data"] + suffix)
    metrics = tmp_path / "out" / "late_clm_40" / "log" / "metrics.jsonl"
    executor = subprocess.Popen([sys.executable, str(TOOL), str(study), "--launcher", "local", "--study-dir",
                                 str(study_dir), "--nproc-per-node", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 240
    while not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
        assert executor.poll() is None and time.monotonic() < deadline, executor.communicate()[0]
        time.sleep(0.02)
    executor.send_signal(signal.SIGINT)
    out = executor.communicate(timeout=240)[0]
    assert executor.returncode == RESUMABLE_EXIT_CODE, out
    stopped = _step(save["late_clm_40"])
    assert stopped is not None and 0 < stopped < TRUNK_STEPS, out
    assert "SIGINT received: late_clm_40 saves its step in flight and stops" in out
    assert _row(out, "late_clm_40").endswith(
        f"to do: stopped (exit 75: stopped after step {stopped}: signal SIGTERM); resumes at step {stopped}")
    assert "stopped on SIGINT: run the same command to continue" in out
    assert re.search(r"^=== .*: bash \S+/single_node\.sh --config \S+/late_clm_40\.yaml$",
                     logs["late_clm_40"].read_text(), re.M)
    assert _attempts(logs["late_clm_40_cpt_mlm_40_8"]) == 0

    # 3. A dry run says what is left and writes nothing; --only takes a run with the runs it starts from.
    code = cli.main([str(study), "--launcher", "local", "--study-dir", str(study_dir), "--dry-run",
                     "--only", "late_clm_40_cpt_mlm_40_8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert _row(out, "late_clm_40").endswith(f"to do: resumes at step {stopped}")
    assert _row(out, "tiny_clm_40").endswith("(not selected)")
    assert re.findall(r"^  \S+ -m megatron_ext\.cli\.pretrain_encoder --config (\S+)$", out, re.M) == [
        str(study_dir / "recipes" / "late_clm_40.yaml"), str(study_dir / "recipes" / "late_clm_40_cpt_mlm_40_8.yaml")]
    assert cli.main([str(study), "--launcher", "local", "--study-dir", str(study_dir), "--only", "nope"]) == 2
    assert "--only: no run named nope in study grid; its runs: late_clm_40, " in capsys.readouterr().err
    with StudyDir(root=study_dir).lock():  # another executor on this study: refused, nothing started
        assert cli.main([str(study), "--launcher", "local", "--study-dir", str(study_dir)]) == 2
    assert f"run_study.py: error: {study_dir}: another run_study.py (pid {os.getpid()}) is executing this study" \
        in capsys.readouterr().err

    # 4. The rerun skips what is complete, resumes the stopped run and trains its CPT, saying where
    # the running one is every second.
    code = cli.main([str(study), "--launcher", "local", "--study-dir", str(study_dir), "--progress-interval", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"[1/2] late_clm_40: training steps {stopped} to {TRUNK_STEPS}" in out
    assert re.search(r"^\[1/2\] late_clm_40: (starting|step \d+/40), running for 0m0\ds \| study: 0/2 segments, "
                     rf"0/{TRUNK_STEPS - stopped + CPT_STEPS} steps, elapsed", out, re.M), out
    assert re.search(rf"^training \d+ steps from step {stopped}:", logs["late_clm_40"].read_text(), re.M)
    assert "[2/2] late_clm_40_cpt_mlm_40_8: complete" in out
    assert all(_row(out, run).endswith("complete") for run in save)
    assert {run: _step(path) for run, path in save.items()} == {
        "late_clm_40": TRUNK_STEPS, "late_clm_40_cpt_mlm_40_8": CPT_STEPS, "tiny_clm_40": TRUNK_STEPS,
        "tiny_clm_40_cpt_mlm_40_8": CPT_STEPS}
    assert {run: _attempts(log) for run, log in logs.items()} == {
        "late_clm_40": 3, "late_clm_40_cpt_mlm_40_8": 1, "tiny_clm_40": 1, "tiny_clm_40_cpt_mlm_40_8": 1}


@pytest.mark.skipif(not BRANCHING, reason="needs the branch setting (checkpoint.branch_from) in the trainer")
def test_local_branch_segment_starts_from_its_parents_checkpoint(tmp_path, tiny_corpus, capsys):
    """A 10-step budget is the 20-step run up to its decay (step 8): trained as the 20-step run's
    branch from its checkpoint at step 8, which the parent keeps. ``--train-only``: the study's
    evaluation is not started."""
    evaluation = {"tasks": ["rt_sentiment"], "lrs": [1e-3], "seeds": [0], "max_steps": 2,
                  "output_dir": str(tmp_path / "eval")}
    study = _study(tmp_path, "branches", {"tiny": _base(tiny_corpus, tmp_path)}, budgets=[20, 10], cpt=None,
                   evaluation=evaluation)
    study_dir = tmp_path / "study_dir"
    code = cli.main([str(study), "--launcher", "local", "--study-dir", str(study_dir), "--train-only"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^training: every run complete \(\d+ s\)$", out, re.M), out
    assert "evaluation:" not in out and not (tmp_path / "eval").exists()
    assert not (study_dir / "logs" / "evaluation").exists()
    assert "[2/2] tiny_clm_10: training steps 8 to 10" in out
    log = (study_dir / "logs" / "tiny_clm_10.log").read_text()
    assert re.search(r"^training \d+ steps from step 8:", log, re.M), log
    assert _step(tmp_path / "out" / "tiny_clm_10" / "ckpt") == 10
    assert Checkpoint.latest(tmp_path / "out" / "tiny_clm_20" / "ckpt" / "iter_0000008") is not None


# -- SLURM ----------------------------------------------------------------------------------------

LAUNCH_ENV = ("RECIPE", "NNODES", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "TORCHRUN", "REPO_DIR",
              "DRY_RUN", "MAX_REQUEUES", "OMP_NUM_THREADS", "MEGATRON_EXT_EXIT_STATUS_FILE", "PYTHON")


def _times(info: dict[str, str]) -> tuple[float, float]:
    return tuple(datetime.strptime(info[key], "%Y-%m-%dT%H:%M:%S").timestamp() for key in ("StartTime", "EndTime"))


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(1200)  # 163 s alone, 247 s beside the other test worker
def test_slurm_dependencies_failure_and_rerun(slurm_cluster, tiny_corpus, tmp_path, installed_package):
    """Two seeds, each a run and its CPT (4 jobs, 2 nodes). The CPU user's flags come from the study
    (``--nodes=1``), the size (``--gpus-per-node=0``) and the command line (``--time``), as each level's
    ``resources: {slurm: [...]}``. Once every run is trained, the evaluation is a job
    array of two workers, then the report. Everything runs from the installed package
    (``installed_package``), in a folder outside the checkout."""
    evaluation = {"tasks": ["rt_sentiment"], "lrs": [1e-3], "seeds": [0], "max_steps": 2, "max_length": 64,
                  "max_eval_examples": 16, "output_dir": str(tmp_path / "eval"), "workers": 2,
                  "resources": {"slurm": ["--gpus=0", "--cpus-per-task=1"]}}
    study = _study(tmp_path, "sl", {"tiny": _base(tiny_corpus, tmp_path)},
                   {"resources": {"slurm": ["--gpus-per-node=0"]}}, seeds=[1, 2],
                   resources={"slurm": ["--nodes=1"]}, evaluation=evaluation)
    study_dir = tmp_path / "study_dir"
    env = {**{k: v for k, v in slurm_cluster.env.items() if k not in LAUNCH_ENV}, "GPUS_PER_NODE": "1",
           "PYTHONPATH": installed_package["env"]["PYTHONPATH"],
           "MEGATRON_EXT_DATA": installed_package["env"]["MEGATRON_EXT_DATA"]}
    cwd = installed_package["work"]
    command = [sys.executable, "-m", "megatron_ext.cli.run_study", str(study), "--launcher", "slurm", "--study-dir",
               str(study_dir), "--sbatch-arg=--time=15", "--wait", "--poll-interval", "1"]
    runs = ["tiny_clm_40_s1", "tiny_clm_40_s1_cpt_mlm_40_8", "tiny_clm_40_s2", "tiny_clm_40_s2_cpt_mlm_40_8"]

    def records() -> dict[str, list[dict]]:
        path = study_dir / "jobs.json"
        found = json.loads(path.read_text())["runs"] if path.exists() else {}
        return {run: found.get(run, []) for run in runs}

    def jobs() -> dict[str, list[int]]:
        return {run: [r["job_id"] for r in found] for run, found in records().items()}

    # The plan of submissions, flags in order; nothing submitted.
    dry = subprocess.run(command[:-3] + ["--dry-run"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert (f"sbatch --parsable --job-name=sl.tiny_clm_40_s1_cpt_mlm_40_8 --output={study_dir}/logs/"
            "tiny_clm_40_s1_cpt_mlm_40_8-%j.out --nodes=1 --gpus-per-node=0 --time=15 --kill-on-invalid-dep=yes "
            "--dependency=afterok:<job of tiny_clm_40_s1> ") in dry.stdout, dry.stdout
    # the installed package's launch script, not the checkout's
    assert f" {installed_package['site']}/megatron_ext/launch/scripts/slurm.sbatch --config " in dry.stdout
    assert not [line for line in dry.stderr.splitlines() if line.startswith("notice:")], dry.stderr
    assert not (study_dir / "jobs.json").exists()

    # 1. Submit and follow; cancel seed 2's run as soon as its job is submitted (before it can finish).
    first = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not jobs()["tiny_clm_40_s2"]:
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.05)
    cancelled = jobs()["tiny_clm_40_s2"][0]
    slurm_cluster.run(["scancel", str(cancelled)])
    out = first.communicate(timeout=600)[0]
    assert first.returncode == 1, out
    submitted = jobs()
    assert all(len(ids) == 1 for ids in submitted.values()), submitted
    info = {run: slurm_cluster.wait(ids[0], timeout=60) for run, ids in submitted.items()}
    assert info["tiny_clm_40_s1"]["JobState"] == info["tiny_clm_40_s1_cpt_mlm_40_8"]["JobState"] == "COMPLETED"
    assert info["tiny_clm_40_s1"]["JobName"] == "sl.tiny_clm_40_s1" and info["tiny_clm_40_s1"]["NumNodes"] == "1"
    assert info["tiny_clm_40_s1"]["TimeLimit"] == "00:15:00"
    # The CPT job waited for its parent's: it started once that one had ended.
    assert records()["tiny_clm_40_s1_cpt_mlm_40_8"][0]["after"] == submitted["tiny_clm_40_s1"][0]
    assert _times(info["tiny_clm_40_s1_cpt_mlm_40_8"])[0] >= _times(info["tiny_clm_40_s1"])[1]
    # The cancelled run's CPT never ran: SLURM cancelled it with its never-satisfiable dependency.
    assert info["tiny_clm_40_s2"]["JobState"] == "CANCELLED"
    assert info["tiny_clm_40_s2_cpt_mlm_40_8"]["JobState"] == "CANCELLED"
    assert info["tiny_clm_40_s2_cpt_mlm_40_8"]["Reason"] == "DependencyNeverSatisfied"
    assert not list((study_dir / "logs").glob("tiny_clm_40_s2_cpt_mlm_40_8-*.out"))
    assert re.search(r"tiny_clm_40_s1_cpt_mlm_40_8: running -> complete: job \d+ \| study: ", out), out
    assert f"failed: job {cancelled} CANCELLED" in _row(out, "tiny_clm_40_s2")
    assert "blocked: tiny_clm_40_s2 failed" in _row(out, "tiny_clm_40_s2_cpt_mlm_40_8")
    assert _step(tmp_path / "out" / "tiny_clm_40_s1_cpt_mlm_40_8" / "ckpt") == CPT_STEPS

    # 2. The rerun leaves seed 1 alone and resubmits seed 2's run and its CPT, which waits for it.
    second = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    again = jobs()
    assert again["tiny_clm_40_s1"] == submitted["tiny_clm_40_s1"]
    assert again["tiny_clm_40_s1_cpt_mlm_40_8"] == submitted["tiny_clm_40_s1_cpt_mlm_40_8"]
    run_job, cpt_job = again["tiny_clm_40_s2"][1], again["tiny_clm_40_s2_cpt_mlm_40_8"][1]
    assert f"submitted tiny_clm_40_s2_cpt_mlm_40_8: job {cpt_job}, after job {run_job}" in second.stdout
    run_info, cpt_info = slurm_cluster.job(run_job), slurm_cluster.job(cpt_job)
    assert run_info["JobState"] == cpt_info["JobState"] == "COMPLETED"
    assert _times(cpt_info)[0] >= _times(run_info)[1]
    assert all(_row(second.stdout, run).endswith(f"complete: job {again[run][-1]}") for run in runs)
    for run, steps in zip(runs, (TRUNK_STEPS, CPT_STEPS, TRUNK_STEPS, CPT_STEPS)):
        assert _step(tmp_path / "out" / run / "ckpt") == steps

    # The failed first call submitted no evaluation; the second, once training was complete, the
    # array of two workers (the evaluation's own flags), which fine-tuned each run once; then the report.
    assert "evaluation: not started, the training is not complete" in out
    array = json.loads((study_dir / "evaluation_jobs.json").read_text())["runs"]
    assert f"submitted evaluation runs: array job {array} (2 task(s))" in second.stdout
    tasks = [slurm_cluster.job(f"{array}_{task}") for task in range(2)]
    assert [t["JobState"] for t in tasks] == ["COMPLETED"] * 2 and tasks[0]["JobName"] == "sl.eval.runs"
    assert tasks[0]["NumCPUs"] == "1"
    records = sorted((tmp_path / "eval" / "runs").glob("*/rt_sentiment/*.json"))
    assert sorted(r.parent.parent.name for r in records) == sorted(runs)
    report = json.loads((tmp_path / "eval" / "report" / "report.json").read_text())
    assert report["missing"] == [] and len(report["study_models"]) == 2  # seeds 1 and 2 pooled per run kind
