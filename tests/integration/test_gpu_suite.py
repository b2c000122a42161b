"""``benchmarks/gpu_suite.py`` on CPU: the budget (caps, skipping), stages side by side, timeouts that
kill a stage's whole process tree, the summaries written after every stage, the real suite's
CPU path (what a CPU can run, the rest marked not applicable), and the suite as a launcher's job."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_suite
from benchmarks.gpu_suite import Budget, Machine, Stage

CPU = Machine(gpu=False, transformer_engine=False, fp8=False, device="cpu-test")
GPU = Machine(gpu=True, transformer_engine=True, fp8=False, device="gpu-test", gpu_count=1)


def _sleeper(seconds: float, code: int = 0, write: str | None = None):
    """A stage command: sleep, optionally write a file into the stage's folder first, exit ``code``."""
    def command(ctx):
        script = ("import pathlib, sys, time; "
                  + (f"pathlib.Path({str(ctx.stage_dir / 'out.json')!r}).write_text({write!r}); " if write else "")
                  + f"print('working', flush=True); time.sleep({seconds}); sys.exit({code})")
        return [sys.executable, "-c", script]
    return command


def _read_out(stage_dir: Path) -> dict:
    path = stage_dir / "out.json"
    return json.loads(path.read_text()) if path.is_file() else {}


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_caps_come_from_the_budget_left_and_a_stage_that_cannot_fit_is_not_started():
    clock = FakeClock()
    budget = Budget(300, 20, clock=clock)
    big = Stage(name="big", purpose="", command=_sleeper(0), max_s=200, min_s=100)
    small = Stage(name="small", purpose="", command=_sleeper(0), max_s=50, min_s=10)
    assert budget.cap_for(big) == 200  # its own max: 280 s are left
    clock.now += 150  # 130 s left
    assert budget.cap_for(big) == 130
    assert budget.cap_for(small) == 50
    clock.now += 100  # 30 s left: below big's minimum, small still fits in what is left
    assert budget.cap_for(big) is None
    assert budget.cap_for(small) == 30


def test_statuses_summaries_and_a_killed_stage_keeps_what_it_wrote(tmp_path):
    stages = [
        Stage(name="ok", purpose="finishes", command=_sleeper(0.1, write='{"answer": 42}'), max_s=30, min_s=1,
              read=_read_out),
        Stage(name="broken", purpose="exits 3", command=_sleeper(0.1, code=3), max_s=30, min_s=1),
        Stage(name="slow", purpose="outlives its cap", command=_sleeper(60, write='{"partial": true}'), max_s=2,
              min_s=1, read=_read_out),
        Stage(name="gpu_only", purpose="needs CUDA", command=_sleeper(0), max_s=30, min_s=1, needs=frozenset({"gpu"})),
        Stage(name="greedy", purpose="needs more than is left", command=_sleeper(0), max_s=900, min_s=600),
    ]
    snapshots = []
    start = time.monotonic()
    results = gpu_suite.run_suite(stages, machine=CPU, budget=Budget(120, 5), output_dir=tmp_path,
                                  on_update=lambda rs: snapshots.append([r.status for r in rs]))
    assert time.monotonic() - start < 30  # the 60 s sleeper was killed at its 2 s cap
    by_name = {r.name: r for r in results}
    assert by_name["ok"].status == "passed" and by_name["ok"].figures == {"answer": 42}
    assert by_name["broken"].status == "failed" and by_name["broken"].exit_code == 3
    assert by_name["broken"].reason == "working"  # the last line of its log
    assert by_name["slow"].status == "timed_out" and by_name["slow"].figures == {"partial": True}
    assert by_name["slow"].cap_s == 2
    assert by_name["gpu_only"].status == "not_applicable" and by_name["gpu_only"].reason == "needs a CUDA GPU"
    assert by_name["greedy"].status == "skipped" and by_name["greedy"].reason.startswith("needs >= 600 s")
    assert "working" in (tmp_path / "logs" / "broken.log").read_text()
    # Updated as it goes: a run cut at any point leaves summaries of what finished.
    assert ["passed", "running", "pending", "pending", "pending"] in snapshots

    gpu_suite.write_summaries(tmp_path, results, machine=CPU, budget=Budget(120, 5), commit="abc1234")
    record = json.loads((tmp_path / "summary.json").read_text())
    assert [s["status"] for s in record["stages"]] == ["passed", "failed", "timed_out", "not_applicable", "skipped"]
    page = (tmp_path / "summary.md").read_text()
    assert "| slow | timed_out | " in page and "killed at its cap of 2 s" in page
    assert "| greedy | skipped | - |" in page and "Commit abc1234" in page


def test_a_stage_that_stops_itself_at_its_limit_is_timed_out_and_imports_this_tree(tmp_path):
    """Exit 124 (gpu_check.py stopping pytest before the cap, to report what finished) is a time-out,
    not a failure; every stage gets this tree first on PYTHONPATH (a GPU machine's copy of the project
    is not installed)."""
    def command(ctx):
        return [sys.executable, "-c", "import os, sys; print(os.environ['PYTHONPATH']); sys.exit(124)"]

    (result,) = gpu_suite.run_suite([Stage(name="tests", purpose="", command=command, max_s=30, min_s=1)],
                                    machine=CPU, budget=Budget(60, 5), output_dir=tmp_path)
    assert (result.status, result.exit_code) == ("timed_out", 124)
    assert result.reason.startswith("stopped itself before its cap")
    log = (tmp_path / "logs" / "tests.log").read_text().splitlines()
    assert log[-1].split(":")[0] == str(gpu_suite.REPO)


def _timed_sleeper(seconds: float):
    """A stage command that records when it slept: ``[start, end]`` (epoch seconds) in ``span.json``."""
    def command(ctx):
        span = str(ctx.stage_dir / "span.json")
        return [sys.executable, "-c", f"import json, time; start = time.time(); time.sleep({seconds}); "
                                      f"open({span!r}, 'w').write(json.dumps([start, time.time()]))"]
    return command


def test_a_stage_and_its_partner_run_side_by_side(tmp_path):
    stages = [
        Stage(name="tests", purpose="", command=_timed_sleeper(3), max_s=30, min_s=1),
        Stage(name="e2e", purpose="", command=_timed_sleeper(3), max_s=30, min_s=1, alongside="tests"),
        Stage(name="after", purpose="", command=_timed_sleeper(0), max_s=30, min_s=1),
    ]
    results = gpu_suite.run_suite(stages, machine=GPU, budget=Budget(120, 5), output_dir=tmp_path)
    assert [r.status for r in results] == ["passed", "passed", "passed"]
    spans = {name: json.loads((tmp_path / name / "span.json").read_text()) for name in ("tests", "e2e", "after")}
    # The partners' sleeps overlap (one after the other, one would start after the other ended); the
    # next stage starts once both have ended.
    assert spans["e2e"][0] < spans["tests"][1] and spans["tests"][0] < spans["e2e"][1], spans
    assert spans["after"][0] >= max(spans["tests"][1], spans["e2e"][1]), spans


def test_a_stage_needing_data_without_a_data_dir_is_not_applicable(tmp_path):
    stage = Stage(name="e2e", purpose="", command=_sleeper(0), max_s=30, min_s=1, needs=frozenset({"gpu", "data"}))
    (result,) = gpu_suite.run_suite([stage], machine=GPU, budget=Budget(60, 5), output_dir=tmp_path,
                                    data_dir=tmp_path / "missing")
    assert result.status == "not_applicable" and "--data-dir" in result.reason


def test_the_stages_ask_for_variants_the_throughput_benchmark_has():
    from benchmarks import throughput

    for stage in gpu_suite.STAGES:
        ctx = gpu_suite.StageContext(machine=GPU, stage_dir=Path("/x"), data_dir=None, cap_s=100)
        argv = stage.command(ctx)
        if "--variants" in argv:
            names = argv[argv.index("--variants") + 1:]
            names = names[:next((i for i, a in enumerate(names) if a.startswith("--")), len(names))]
            assert set(names) <= set(throughput.VARIANTS), (stage.name, names)


def test_the_stages_on_a_gpu_machine_build_their_commands(tmp_path):
    """Every stage's command as a GPU machine would run it (built, not run): the shapes and files the
    visit relies on."""
    machine = Machine(gpu=True, transformer_engine=True, fp8=True, device="NVIDIA H200", gpu_count=1, xdist=True)
    commands = {}
    for stage in gpu_suite.STAGES:
        ctx = gpu_suite.StageContext(machine=machine, stage_dir=tmp_path / stage.name, data_dir=tmp_path / "demo",
                                     cap_s=200)
        commands[stage.name] = stage.command(ctx)
    bf16 = commands["throughput_1b_bf16"]
    assert bf16[bf16.index("--presets") + 1] == "1b" and "--profile" in bf16
    assert bf16[bf16.index("--output") + 1] == str(tmp_path / "throughput_1b_bf16" / "throughput.json")
    assert "--cpu-tiny" not in bf16
    assert commands["throughput_1b_fp8"][commands["throughput_1b_fp8"].index("--precisions") + 1] == "fp8"
    assert commands["resume_e2e"][-1] == str(tmp_path / "demo")
    assert bf16[bf16.index("--steps") + 1] == "8" and bf16[bf16.index("--rounds") + 1] == "2"
    assert "--no-baseline" in bf16  # the baseline is a known side: throughput_1b_known times it when it changed
    gpu_tests = commands["gpu_tests"]
    assert "--output-dir" in gpu_tests and gpu_tests[gpu_tests.index("--timeout-s") + 1] == "180"
    assert gpu_tests[gpu_tests.index("--pytest-args") + 1].startswith("-n ")
    assert "--no-baseline" in commands["throughput_1b_fp8"]
    fp8_gemm = commands["fp8_gemm"]
    assert fp8_gemm[1:3] == ["-m", "benchmarks.fp8_gemm"] and "--cpu-tiny" not in fp8_gemm
    assert fp8_gemm[fp8_gemm.index("--output") + 1] == str(tmp_path / "fp8_gemm" / "fp8_gemm.json")
    from benchmarks import checkpoint_stall

    finetune = commands["finetune_210m"]
    assert finetune[1:3] == ["-m", "benchmarks.finetune_speed"] and finetune[finetune.index("--model-size") + 1] == "210m"
    assert finetune[finetune.index("--tokenizer") + 1] == str(tmp_path / "demo" / "demo_tokenizer")
    assert finetune[finetune.index("--workers") + 1:finetune.index("--grid-runs")] == ["1", "2", "4"]
    assert commands["checkpoint_cost"][1:3] == ["-m", "benchmarks.checkpoint_stall"]
    cost = checkpoint_stall.build_parser().parse_args(commands["checkpoint_cost"][3:])
    assert (cost.preset, cost.seq_length, cost.time_limit_s) == ("210m", 512, 170)  # the cap less 30 s
    assert cost.output == tmp_path / "checkpoint_cost" / "checkpoint_stall.json"


def test_the_checkpoint_cost_stage_reports_each_writer(tmp_path):
    median = {"stall_s": 0.5, "written_s": 6.0, "cost_steps": 12.34, "share_at_interval": 0.01234, "helpers_cpu_s": 3.456}
    (tmp_path / "checkpoint_stall.json").write_text(json.dumps({
        "nvidia_resiliency_ext": None, "rounds_run": 2, "save_interval": 1000,
        "median": {"sync": {**median, "stall_s": 7.0}, "async_mcore": median}}))
    figures = gpu_suite.read_checkpoint_cost(tmp_path)
    assert figures["sides"]["async_mcore"] == {"stall_s": 0.5, "written_s": 6.0, "cost_steps": 12.3, "share_pct": 1.234,
                                               "helpers_cpu_s": 3.46}
    result = gpu_suite.StageResult(name="checkpoint_cost", purpose="", status="passed", figures=figures)
    page = gpu_suite.summary_markdown([result], machine=GPU, budget_s=100, elapsed_s=100, commit=None)
    assert "nvidia-resiliency-ext: not installed (no nvrx side); 2 rounds" in page
    assert "| sync | 7.0 | 6.0 | 12.3 | 1.234 | 3.46 |" in page and "| async_mcore | 0.5 | 6.0 | 12.3 | 1.234 | 3.46 |" in page


def test_the_finetune_stage_reports_runs_per_hour_and_the_worker_grid(tmp_path):
    (tmp_path / "finetune_speed.json").write_text(json.dumps({"model": "eurobert-210m (random weights)", "measurements": {
        "suite": {"config": {"steps": 300}, "runs_per_hour": {"ours": 90.0, "trainer": 40.0}, "ours_over_trainer": 2.25,
                  "workers": {"1": {"runs_per_hour": 95.0}, "2": {"runs_per_hour": 160.0}}}}}))
    figures = gpu_suite.read_finetune_speed(tmp_path)
    assert figures == {"model": "eurobert-210m (random weights)", "steps": 300,
                       "runs_per_hour": {"ours": 90.0, "trainer": 40.0}, "ours_over_trainer": 2.25,
                       "grid_runs_per_hour": {"1": 95.0, "2": 160.0}}


def test_the_fp8_gemm_stage_reports_speedups_per_size(tmp_path):
    """What the FP8 GEMM benchmark writes (its CPU mode, FP8 sides skipped), read into the summary."""
    from benchmarks import fp8_gemm

    fp8_gemm.main(["--cpu-tiny", "--warmup", "1", "--steps", "2", "--output", str(tmp_path / "fp8_gemm.json")])
    figures = gpu_suite.read_fp8_gemm(tmp_path)
    assert figures == {"fp8_speedup_vs_bf16": {name: {"fp8_delayed": "FP8 needs a CUDA GPU",
                                                      "fp8_tensorwise": "FP8 needs a CUDA GPU"}
                                               for name in ("tiny", "tiny x2")},
                       "fp8_delayed_pays_from": None}
    result = gpu_suite.StageResult(name="fp8_gemm", purpose="", status="passed", figures=figures)
    assert "fp8_delayed_pays_from: None" in gpu_suite.summary_markdown([result], machine=GPU, budget_s=100,
                                                                        elapsed_s=100, commit=None)


def test_cli_refuses_an_unknown_stage_and_a_budget_below_its_reserve(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_suite.main(["--stages", "environment", "nonsense"])
    assert exit_info.value.code == 2 and "--stages: unknown nonsense" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_suite.main(["--budget-s", "5", "--reserve-s", "10"])
    assert "--budget-s 5 must exceed --reserve-s 10" in capsys.readouterr().err


@pytest.mark.slow
def test_the_suite_on_cpu_runs_what_a_cpu_can_and_says_why_not_the_rest(tmp_path):
    """The real command, on this CPU: the environment and the throughput benchmark's tiny CPU mode
    run (the same code as on a GPU), the GPU-only stages are not applicable, each with its reason."""
    out = tmp_path / "suite"
    code = gpu_suite.main(["--budget-s", "400", "--output-dir", str(out), "--data-dir", str(tmp_path)])
    record = json.loads((out / "summary.json").read_text())
    status = {s["name"]: s for s in record["stages"]}
    assert code == 0, (out / "summary.md").read_text()
    assert status["environment"]["status"] == "passed"
    assert status["environment"]["figures"]["torch"]
    assert status["throughput_1b_bf16"]["status"] == "passed"
    (row,) = status["throughput_1b_bf16"]["figures"]["rows"]
    assert row["row"] == "tiny seq 128 fp32" and row["tokens_per_s"] > 0 and row["hf_tokens_per_s"] is None
    throughput = json.loads((out / "throughput_1b_bf16" / "throughput.json").read_text())
    (measured,) = throughput["rows"]  # the tiny recipe is one rank: the run's step is the one-GPU step
    assert measured["optimizer_time_s"] > 0 and measured["run_ranks"] == 1
    assert measured["run_tokens_per_s"] == pytest.approx(measured["tokens_per_s"])
    plan = json.loads((out / "plan.json").read_text())
    assert plan["kind"] and set(plan["remeasure"]) | set(plan["known"]) == {"hf", "local_spec", "local_spec_cuda_graphs",
                                                                           "te_spec_cuda_graphs"}
    assert json.loads((out / "fingerprints.json").read_text())["sides"].keys() == plan["remeasure"].keys() | plan["known"].keys()
    for name in ("te_smoke", "gpu_tests_new", "resume_e2e", "checkpoint_cost", "fp8_gemm", "throughput_1b_fp8",
                 "throughput_610m_bf16", "throughput_1b_known"):
        assert status[name]["status"] == "not_applicable" and status[name]["reason"].startswith("needs"), name
    page = (out / "summary.md").read_text()
    assert "| tiny seq 128 fp32 |" in page and "needs a CUDA GPU" in page


def test_as_a_job_the_suite_gets_the_time_limit_less_the_margin_as_its_budget(tmp_path, capsys):
    """``--launcher``: the suite is one job of that launcher (one process, one node, one GPU, the
    time limit) running this module with its budget computed here; nothing is submitted on a dry run."""
    from megatron_ext.launch import script

    out = tmp_path / "suite"
    assert gpu_suite.main(["--launcher", "slurm", "--time", "1:00:00", "--margin-s", "120", "--dry-run",
                           "--sbatch-arg=--partition=gpu", "--output-dir", str(out), "--data-dir", str(tmp_path),
                           "--stages", "environment", "gpu_tests"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"sbatch --parsable --job-name=gpu-suite --output={out}/gpu_suite-%j.out --nodes=1 --gpus=1 --time=1:00:00 "
        f"--partition=gpu --kill-on-invalid-dep=yes {script('program.sbatch')} -m benchmarks.gpu_suite "
        f"--budget-s 3480 --reserve-s 10 --output-dir {out} --data-dir {tmp_path} --stages environment gpu_tests")
    assert not out.exists()
    # the local launcher: the same program, one process here (the default time: 15 minutes less 60 s)
    assert gpu_suite.main(["--launcher", "local", "--dry-run", "--output-dir", str(out)]) == 0
    assert capsys.readouterr().out.strip() == (f"{sys.executable} -m benchmarks.gpu_suite "
                                               f"--budget-s 840 --reserve-s 10 --output-dir {out}")


@pytest.mark.parametrize("argv, message", [
    (["--time", "5"], "--time: only with --launcher"),
    (["--sbatch-arg=--partition=gpu"], "--sbatch-arg: an option of the slurm launcher (--launcher slurm)"),
    (["--launcher", "local", "--wait", "--dry-run"], "--wait: an option of the slurm launcher (--launcher slurm)"),
    (["--launcher", "slurm", "--budget-s", "100", "--dry-run"],
     "--budget-s: with --launcher the suite's budget is --time less --margin-s"),
    (["--launcher", "slurm", "--time", "1", "--dry-run"],
     "--time 1 less --margin-s 60 leaves 0 s for the suite, not more than --reserve-s 10"),
    (["--launcher", "slurm", "--time", "soon", "--dry-run"],
     "--time: expected minutes, HH:MM:SS or D-HH:MM:SS, got 'soon'"),
])
def test_job_options_that_do_not_apply_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_suite.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slurm
@pytest.mark.slow
def test_submitted_through_the_slurm_launcher_the_suite_runs_within_the_jobs_time_limit(slurm_cluster, tmp_path):
    """``gpu_suite.py --launcher slurm`` as a CPU user runs it (``--gpus=0``): the job runs the suite
    with the time limit less the margin as its budget, and the summaries land in --output-dir."""
    out = tmp_path / "suite"
    env = {k: v for k, v in slurm_cluster.env.items() if not k.startswith("SLURM_JOB") and k != "PYTHON"}
    submit = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_suite", "--launcher", "slurm", "--time", "4",
         "--sbatch-arg=--gpus=0", "--sbatch-arg=--cpus-per-task=1", "--wait", "--poll-interval", "1",
         "--output-dir", str(out), "--data-dir", str(tmp_path), "--stages", "environment", "gpu_tests"],
        env=env, cwd=gpu_suite.REPO, capture_output=True, text=True, timeout=300)
    job_id = int(re.search(r"^gpu_suite: job (\d+) ", submit.stdout, re.M).group(1))
    info = slurm_cluster.wait(job_id, timeout=60)
    log = Path(info["StdOut"]).read_text()
    assert submit.returncode == 0, submit.stdout + submit.stderr + log
    assert info["JobState"] == "COMPLETED" and info["TimeLimit"] == "00:04:00", log
    assert Path(info["StdOut"]) == out / f"gpu_suite-{job_id}.out"
    assert "budget 180 s" in log  # 4 minutes less the 60 s margin
    record = json.loads((out / "summary.json").read_text())
    assert record["budget_s"] == 180
    assert [(s["name"], s["status"]) for s in record["stages"]] == [("environment", "passed"),
                                                                    ("gpu_tests", "not_applicable")]


def test_a_throughput_stage_cut_short_reports_the_sides_it_measured(tmp_path):
    """throughput.py writes its JSON at the end, and a line per side as it goes: a stage killed at its
    cap still reports those sides."""
    (tmp_path / "throughput.sides.jsonl").write_text(
        json.dumps({"row": "1b seq 2048 bf16", "side": "megatron_ext", "tokens_per_s": 61234.0, "peak_mem_gb": 30.1,
                    "error": None}) + "\n"
        + json.dumps({"row": "1b seq 2048 bf16", "side": "cuda_graphs", "tokens_per_s": None, "peak_mem_gb": None,
                      "error": "crashed (exit 1): RuntimeError: capture failed"}) + "\n")
    figures = gpu_suite.read_throughput(tmp_path)
    assert figures["complete"] is False and [s["side"] for s in figures["sides"]] == ["megatron_ext", "cuda_graphs"]
    (tmp_path / "throughput.json").write_text(json.dumps({"device": "gpu-test", "rows": []}))
    complete = gpu_suite.read_throughput(tmp_path)  # the sides, with their settings, stay in a complete record
    assert complete["complete"] is True and complete["sides"] == figures["sides"]
    (tmp_path / "throughput.json").unlink()
    result = gpu_suite.StageResult(name="throughput_1b_bf16", purpose="", status="timed_out", figures=figures)
    page = gpu_suite.summary_markdown([result], machine=GPU, budget_s=100, elapsed_s=100, commit=None)
    assert "1b seq 2048 bf16 / megatron_ext: 61,234 tok/s, peak 30.1 GB" in page
    assert "cuda_graphs: - , peak - GB (crashed (exit 1): RuntimeError: capture failed)".replace(" ,", ",") in page


def test_the_resume_stage_passes_the_trainer_flags_it_has(tmp_path, demo_tokenizer, capsys):
    """``gpu_resume_e2e.sh`` starts the trainer with its ARGS on a GPU only; its flags are checked here
    with the trainer's dry run on the demo data (a flag the trainer does not take ended the stage at
    once: ``--attention-backend``, Megatron-LM's, until it read ``--transformer-impl``)."""
    from megatron_ext.cli import pretrain_encoder

    repo = Path(__file__).resolve().parents[2]
    script = repo / "benchmarks" / "gpu_resume_e2e.sh"
    listing = subprocess.run(
        ["bash", "-c", f'OUT={tmp_path}; DATA={demo_tokenizer.parent}; '
                       f'eval "$(sed -n "/^ARGS=(/,/)$/p" {script})"; printf "%s\\n" "${{ARGS[@]}}"'],
        capture_output=True, text=True, check=True, cwd=repo).stdout.splitlines()
    assert listing[:2] == ["--config", "examples/recipes/paper/210m_biphasic_25_75.yaml"]
    argv = [str(repo / arg) if arg.startswith("examples/") else arg for arg in listing]
    code = pretrain_encoder.main([*argv, "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "log"),
                                  "--dry-run"])
    assert code == 0, capsys.readouterr().err
    assert "(local layers)" in capsys.readouterr().out


def test_run_by_its_path_from_anywhere_the_suite_lists_every_stage(tmp_path):
    """``python benchmarks/gpu_suite.py --list`` (the form older notes and visits use) runs the module
    (``python -m benchmarks.gpu_suite``) and names every stage, from any directory: a visit's first
    call has no minute to spare for a broken path."""
    listed = subprocess.run([sys.executable, str(gpu_suite.REPO / "benchmarks" / "gpu_suite.py"), "--list"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    assert names == [stage.name for stage in gpu_suite.STAGES] and len(names) >= 15
