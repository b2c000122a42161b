"""Prove and measure the GPU path inside a time budget: the command of a GPU visit, or of a check of a
new GPU node or cluster image.

    .venv/bin/python -m benchmarks.gpu_suite --budget-s 480 --output-dir runs/gpu_suite
    .venv/bin/python -m benchmarks.gpu_suite --list                     # the stages, in order of value
    .venv/bin/python -m benchmarks.gpu_suite --stages environment throughput_1b_bf16 --budget-s 200
    .venv/bin/python -m benchmarks.gpu_suite --launcher slurm --time 00:15:00 --sbatch-arg=--partition=gpu

With ``--launcher NAME`` (a launcher of ``megatron_ext.launch``: local, slurm) the suite is not run
here but submitted as a job of that launcher: one process on one node with one GPU, for ``--time``
(default 00:15:00), its budget that time less ``--margin-s`` (default 60 s: the job's start-up and
end), computed here, so that nothing in the job asks its scheduler. The command prints the job's id,
its log and where the summaries will land (``--output-dir``, default
``runs/gpu_suite/<date>-<time>``); ``--dry-run`` prints the submission instead. Each launcher's own
options apply (``--sbatch-arg=--cpus-per-task=16``, ``--wait``; ``python -m benchmarks.gpu_suite
--help``); the local launcher runs the job here at once and waits for it.

Stages run one after the other in order of value (or side by side where they cannot disturb each
other's figures: the `gpu` tests and the resume run share the GPU, never with a timing), each in
processes of its own under its own time cap:

- a stage that this machine cannot run (no GPU, no Transformer Engine, no FP8) is marked
  ``not_applicable`` with the reason;
- a stage's cap is ``min(its max_s, the budget left)``, the budget left being ``--budget-s`` minus
  the time spent so far and ``--reserve-s`` (kept for the summary and the copy back);
- a stage whose ``min_s`` no longer fits is ``skipped`` with the seconds it needed and had;
- a stage that runs out of its cap is killed (its whole process group) and marked ``timed_out``;
  what it wrote so far is still read.

Into ``--output-dir``: ``summary.md`` (a page a person reads in a minute), ``summary.json`` (the same
as data: every stage's status, cap, wall time, exit code, key figures), ``logs/<stage>.log`` (each
stage's whole output) and each stage's own files under ``<stage>/``. Both summaries are rewritten
after every stage, so a run cut short by its machine's time limit still leaves them.

On CPU the same command runs what a CPU can (the environment, the throughput benchmark's tiny CPU
mode) and marks the rest not applicable: that is how the suite's logic is tested in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_ext.launch import Job

if not __package__:  # run by its path (python benchmarks/gpu_suite.py, as older notes say): be the module
    _root = str(Path(__file__).resolve().parent.parent)
    _env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_root, os.environ.get("PYTHONPATH")]))}
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.gpu_suite", *sys.argv[1:]], _env)

from benchmarks import gpu_visits  # standard library only: the suite's process stays light
from megatron_ext.performance.devices import device_kind  # the same

REPO = Path(__file__).resolve().parent.parent

STOPPED_AT_ITS_OWN_LIMIT = 124
"""The exit code of a stage that stops itself a little before its cap so as to report what finished
(``gpu_check.py --timeout-s``; ``timeout``'s convention): timed out, not failed."""

STATUSES = ("passed", "failed", "timed_out", "skipped", "not_applicable")
"""passed: exit 0; failed: another exit code; timed_out: killed at its cap, or stopped itself before
it (exit 124); skipped: the budget left
was below its ``min_s``; not_applicable: this machine lacks what it needs (GPU, TE, FP8)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Machine:
    """What this machine can run, probed once by the suite (in a child process: the suite itself
    never creates a CUDA context, so every stage has the device to itself)."""

    gpu: bool
    transformer_engine: bool
    fp8: bool
    device: str
    gpu_count: int = 0
    xdist: bool = False

    def lacks(self, needs: frozenset[str]) -> str | None:
        """Why a stage needing ``needs`` cannot run here, or None."""
        if "gpu" in needs and not self.gpu:
            return "needs a CUDA GPU"
        if "te" in needs and not self.transformer_engine:
            return "needs Transformer Engine, which does not import here"
        if "fp8" in needs and not self.fp8:
            return "needs FP8 (Transformer Engine on compute capability >= 8.9)"
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageContext:
    """What a stage's command is built from."""

    machine: Machine
    stage_dir: Path
    data_dir: Path | None
    cap_s: float
    """The stage's time cap: a command that can stop by itself before it (and still write its report) is told."""
    plan: VisitPlan | None = None
    """What the committed visits already answer on this device kind (None: re-measure everything)."""
    python: str = sys.executable


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisitPlan:
    """What this visit need not measure again (``benchmarks/visit_plan.py``): the known sides to
    re-measure on this device kind, with why, and the ``gpu`` tests already passed on it."""

    kind: str
    remeasure: dict[str, str]
    """Known side -> why it is re-measured."""
    known: dict[str, str]
    """Known side -> why it is not (the visit that timed it)."""
    passed_tests: frozenset[str] = frozenset()

    @classmethod
    def for_device(cls, device: str) -> "VisitPlan":
        from benchmarks import visit_plan

        kind = device_kind(device)
        decisions = visit_plan.plan_known_sides(kind)
        return cls(kind=kind, remeasure={n: d.reason for n, d in decisions.items() if d.remeasure},
                   known={n: d.reason for n, d in decisions.items() if not d.remeasure},
                   passed_tests=frozenset(visit_plan.passed_gpu_tests(kind)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage of the suite: a command, the time it may take, and how to read what it wrote."""

    name: str
    purpose: str
    command: Callable[[StageContext], list[str]]
    max_s: float
    """The most this stage is given (its cap when the budget allows)."""
    min_s: float
    """Below this much budget left the stage is skipped: it could not produce a useful result."""
    needs: frozenset[str] = frozenset()
    """Subset of {"gpu", "te", "fp8", "data"} (data: ``--data-dir`` with the demo tokenizer and dataset)."""
    read: Callable[[Path], dict] | None = None
    """Key figures from the stage's folder (also after a timeout: what was written so far)."""
    alongside: str | None = None
    """The name of the stage that runs at the same time as this one (this one is started with it)."""
    in_full_run: bool = True
    """False: run only when named with ``--stages`` (a short visit's subset of a full stage)."""
    skip_if: Callable[[StageContext, dict], str | None] | None = None
    """Given the context and the results so far (name -> ``StageResult``): why this stage has nothing to
    change this visit (it is then ``skipped`` with that reason), or None to run it. ``--stages`` runs it
    anyway."""


def _python_probe(probe: str) -> Callable[[StageContext], list[str]]:
    return lambda ctx: [ctx.python, "-m", "benchmarks.gpu_suite", "--probe", probe,
                        "--probe-output", str(ctx.stage_dir / f"{probe}.json")]


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------------
# Probes: small checks that run in a child process of their own (``--probe NAME``).


def probe_machine() -> dict:
    """What this machine is and has (the suite reads it to decide what applies)."""
    import importlib.util

    import torch

    from megatron_ext import hardware

    gpu = hardware.on_gpu()
    te = hardware.transformer_engine_available() if gpu else importlib.util.find_spec("transformer_engine") is not None
    fp8 = gpu and te and torch.cuda.get_device_capability() >= hardware.FP8_MIN_COMPUTE_CAPABILITY
    return {"gpu": gpu, "transformer_engine": bool(te), "fp8": bool(fp8),
            "device": hardware.device_name() or f"cpu{os.cpu_count()}",
            "gpu_count": torch.cuda.device_count() if gpu else 0,
            "xdist": importlib.util.find_spec("xdist") is not None}


def probe_environment() -> dict:
    """Device, driver, memory, versions of every library the GPU path uses."""
    import torch

    from megatron_ext import hardware

    record = {**probe_machine(), "versions": hardware.software_versions()}
    if hardware.on_gpu():
        props = torch.cuda.get_device_properties(0)
        record.update(compute_capability=".".join(map(str, torch.cuda.get_device_capability())),
                      memory_gb=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    record["accelerators"] = hardware.accelerator_summary()
    return record


def probe_te_smoke() -> dict:
    """Transformer Engine's building blocks on this GPU, each on its own: an FP8 ``LayerNormMLP``
    forward and backward (delayed scaling), bidirectional and causal fused attention in bf16."""
    import torch
    import transformer_engine
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    checks: dict[str, str] = {}

    def check(name: str, fn: Callable[[], str]) -> None:
        try:
            checks[name] = "ok: " + fn()
        except Exception as error:  # a record of what failed, the suite goes on
            checks[name] = f"FAILED: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    # The TE smoke test of the 2026-11-26 visit (results/gpu_visits/h200-2026-11-26/visit.sh, in git history at 0f77063), kept here
    # as a check of every visit: the same lines on purpose.
    def fp8_mlp() -> str:
        mlp = te.LayerNormMLP(256, 1024, normalization="RMSNorm", activation="swiglu").cuda()
        x = torch.randn(64, 256, device="cuda", requires_grad=True)
        with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
            y = mlp(x)
        y.float().sum().backward()
        torch.cuda.synchronize()
        return f"output mean |y| {float(y.float().abs().mean()):.4f}, grad finite {bool(x.grad.isfinite().all())}"

    def attention(mask: str) -> Callable[[], str]:
        def run() -> str:
            attn = te.DotProductAttention(4, 64, attn_mask_type=mask, qkv_format="sbhd").cuda()
            q = torch.randn(128, 2, 4, 64, device="cuda", dtype=torch.bfloat16)
            out = attn(q, q, q)
            torch.cuda.synchronize()
            return f"shape {tuple(out.shape)}"
        return run

    check("fp8_layernorm_mlp", fp8_mlp)
    check("attention_no_mask", attention("no_mask"))
    check("attention_causal", attention("causal"))
    return {"transformer_engine": transformer_engine.__version__, "checks": checks,
            "passed": all(v.startswith("ok") for v in checks.values())}


PROBES = {"machine": probe_machine, "environment": probe_environment, "te_smoke": probe_te_smoke}


def _te_smoke_exit(record: dict) -> int:
    return 0 if record.get("passed", True) else 1


# --------------------------------------------------------------------------------------------------
# Stage readers: the figures a person wants from each stage's folder.


def read_environment(stage_dir: Path) -> dict:
    record = _read_json(stage_dir / "environment.json") or {}
    versions = record.get("versions", {})
    return {"device": record.get("device"), "compute_capability": record.get("compute_capability"),
            "memory_gb": record.get("memory_gb"), "driver": versions.get("driver"),
            **{k: versions.get(k) for k in ("torch", "cuda", "megatron_core", "transformer_engine", "transformers",
                                            "nvidia_resiliency_ext")}}


def read_te_smoke(stage_dir: Path) -> dict:
    record = _read_json(stage_dir / "te_smoke.json") or {}
    return {"transformer_engine": record.get("transformer_engine"), **record.get("checks", {})}


def read_fp8_gemm(stage_dir: Path) -> dict:
    """FP8's speedup over bf16 per layer size and recipe, and the first size where it pays."""
    record = _read_json(stage_dir / "fp8_gemm.json") or {}
    speedups = {row["shape"]["name"]: {precision: side.get("speedup_vs_bf16", side.get("skipped"))
                                       for precision, side in row["sides"].items() if precision != "bf16"}
                for row in record.get("rows", [])}
    return {"fp8_speedup_vs_bf16": speedups, "fp8_delayed_pays_from": record.get("fp8_delayed_pays_from")}


def read_finetune_speed(stage_dir: Path) -> dict:
    """Fine-tuning runs per GPU-hour: ours, the plain Trainer, and the grid at each worker count."""
    record = _read_json(stage_dir / "finetune_speed.json") or {}
    measurement = (record.get("measurements") or {}).get("suite") or {}
    return {"model": record.get("model"), "steps": (measurement.get("config") or {}).get("steps"),
            "runs_per_hour": measurement.get("runs_per_hour"), "ours_over_trainer": measurement.get("ours_over_trainer"),
            "grid_runs_per_hour": {n: w.get("runs_per_hour") for n, w in (measurement.get("workers") or {}).items()}}


def read_throughput(stage_dir: Path) -> dict:
    """Per row: tokens/s, MFU, step time, peak memory (and the trainer's estimate), the HF ratio, each
    variant's ratio and each side's wall time, from the JSON throughput.py writes at its end; when the
    stage was cut before, the sides it measured (``throughput.sides.jsonl``, one line per side)."""
    record = _read_json(stage_dir / "throughput.json")
    # Each side as written, with the settings it ran (benchmarks/recipe_defaults.py compares them).
    sides = gpu_visits.read_side_records(stage_dir)
    if record is None:
        return {"rows": [], "complete": False, "sides": sides} if sides else {}
    rows = []
    for row in record.get("rows", []):
        rows.append({
            "row": f"{row.get('model')} seq {row.get('seq_length')} {row.get('precision')}",
            "shape": f"{row.get('micro_batches_per_step')} x {row.get('micro_batch_size')}",
            "tokens_per_s": row.get("tokens_per_s"), "mfu": row.get("mfu"), "step_time_s": row.get("step_time_s"),
            "peak_mem_gb": row.get("peak_mem_gb"), "estimated_mem_gb": row.get("estimated_mem_gb"),
            "hf_tokens_per_s": row.get("hf_tokens_per_s"),
            "speedup_vs_hf": row.get("speedup_vs_hf"), "errors": row.get("errors") or {},
            "variants": {name: {"tokens_per_s": v.get("tokens_per_s"), "default_speedup": v.get("default_speedup"),
                                "peak_mem_gb": v.get("peak_mem_gb"), "estimated_mem_gb": v.get("estimated_mem_gb"),
                                "same_as_default": v.get("same_as_default", False), "same_as": v.get("same_as"),
                                "error": v.get("error")}
                         for name, v in (row.get("variants") or {}).items()},
            "side_wall_s": {side: wall["total"] for side, wall in (row.get("wall_s") or {}).items()
                            if isinstance(wall, dict) and wall.get("total") is not None},
        })
    return {"device": record.get("device"), "rows": rows, "complete": True, "sides": sides}


def read_gpu_tests(stage_dir: Path) -> dict:
    reports = gpu_visits.read_gpu_test_reports(stage_dir)
    if not reports:
        return {}
    report = reports[0]
    counts: dict[str, int] = {}
    for t in report.tests:
        counts[t.outcome] = counts.get(t.outcome, 0) + 1
    problems = [f"{t.outcome.upper()} {t.test}: {t.error or ''}".strip()
                for t in report.tests if t.outcome in ("failed", "error")]
    return {"counts": counts, "collected": report.collected, "problems": problems,
            "collection_errors": list(report.collection_errors), "fp8_vs_bf16_loss": report.fp8_vs_bf16_loss,
            "pytest_exit_code": report.pytest_exit_code}


def read_resume_e2e(stage_dir: Path) -> dict:
    return _read_json(stage_dir / "resume_compare.json") or {}


def read_checkpoint_cost(stage_dir: Path) -> dict:
    """Per side of checkpoint_stall.py (sync, each asynchronous writer): the median stall, time until
    published, cost in plain steps and as a share of a run saving every ``save_interval`` steps, and the
    CPU seconds of the writer processes meanwhile."""
    record = _read_json(stage_dir / "checkpoint_stall.json")
    if record is None:
        return {}
    sides = {side: {"stall_s": round(m["stall_s"], 3), "written_s": round(m["written_s"], 2),
                    "cost_steps": round(m["cost_steps"], 1), "share_pct": round(100 * m["share_at_interval"], 3),
                    "helpers_cpu_s": None if m.get("helpers_cpu_s") is None else round(m["helpers_cpu_s"], 2)}
             for side, m in record.get("median", {}).items()}
    return {"nvidia_resiliency_ext": record.get("nvidia_resiliency_ext"), "rounds": record.get("rounds_run"),
            "save_interval": record.get("save_interval"), "sides": sides}


# --------------------------------------------------------------------------------------------------
# The stages, in order of value. The fine-tuning stage comes before the writers' cost: the study's
# cost estimate waits for its figure (runs per GPU-hour), and two visits in a row ended before it.

THROUGHPUT_TIMING = ["--warmup", "3", "--steps", "8", "--rounds", "2"]
"""A GPU visit's timings: 3 warm-up steps (CUDA graphs are captured during warm-up), 2 rounds of 8
timed steps per side (3 steps x 2 before 2026-11-28 were within the +-3 % noise of the effects they
decided)."""

WANTED_VARIANTS_1B = ("cross_entropy_te", "micro_batch_18", "isolated_documents")
"""What the 1B bf16 row times against the recipe's configuration first: the changes that could still
move its default or a target (Transformer Engine's fused cross entropy; one micro-batch of 18, which
halves the layers' host calls per step; documents isolated through THD, whose target is >= 0.95x the
cross-document tokens/s). Names of ``throughput.VARIANTS`` (checked by a test, not
here: importing the benchmark loads torch, Megatron and TE, ~13 s of a GPU visit, into the suite's own
process). The sides whose answers a visit already holds are ``KNOWN_VARIANTS_1B``, re-measured by the
plan only."""

KNOWN_VARIANTS_1B = ("local_spec", "local_spec_cuda_graphs", "te_spec_cuda_graphs")
"""The 1B sides earlier visits answered (``visit_plan.KNOWN_SIDES``, with the Hugging Face baseline):
``throughput_1b_known`` times those the plan says changed."""


def _throughput(preset: str, precision: str, *, variants: tuple[str, ...] | Callable[[StageContext], tuple[str, ...]] = (),
                hf: bool | Callable[[StageContext], bool] = True, profile: bool = False) -> Callable[[StageContext], list[str]]:
    def command(ctx: StageContext) -> list[str]:
        argv = [ctx.python, "-m", "benchmarks.throughput", "--output", str(ctx.stage_dir / "throughput.json")]
        if ctx.machine.gpu:
            argv += ["--presets", preset, "--seq-lengths", "2048", "--precisions", precision, *THROUGHPUT_TIMING]
            argv += ["--variants", *(variants(ctx) if callable(variants) else variants)]
        else:  # the same code at the CPU's tiny size (what CI checks); the variants are GPU settings
            argv += ["--cpu-tiny", "--warmup", "1", "--steps", "1", "--rounds", "1", "--variants"]
        if not (hf(ctx) if callable(hf) else hf):
            argv.append("--no-baseline")
        if profile:
            argv += ["--profile", str(ctx.stage_dir / "profiles")]
        return argv
    return command


def _gpu_tests(ctx: StageContext) -> list[str]:
    # gpu_check stops pytest itself a little before the cap, so its report is written from what finished.
    argv = [ctx.python, "-m", "benchmarks.gpu_check", "--output-dir", str(ctx.stage_dir),
            "--timeout-s", str(int(max(30.0, ctx.cap_s - 20)))]
    if ctx.machine.xdist:
        # The gpu tests are small models, each with its own runs and folders. Spread test by test, not
        # file by file: 25 of them are in test_gpu.py, which `--dist loadfile` put on one worker (the
        # 2026-11-27 H100 visit ran 17 of 29 in its 230 s). A module fixture (the CPU reference run)
        # may then be built by more than one worker: CPU work beside the GPU's, cheaper than the wait.
        argv += ["--pytest-args", "-n 6 --dist load"]
    return argv


def _new_gpu_tests(ctx: StageContext) -> list[str]:
    """The ``gpu`` tests not yet passed on this device kind (the plan's ``passed_tests`` deselected)."""
    passed = sorted(ctx.plan.passed_tests) if ctx.plan is not None else []
    argv = _gpu_tests(ctx)
    if passed:
        deselect = " ".join(f"--deselect {shlex.quote(test)}" for test in passed)
        if "--pytest-args" in argv:
            at = argv.index("--pytest-args") + 1
            argv[at] = f"{argv[at]} {deselect}"
        else:
            argv += ["--pytest-args", deselect]
    return argv


def _known_variants(ctx: StageContext) -> tuple[str, ...]:
    if ctx.plan is None:
        return KNOWN_VARIANTS_1B
    return tuple(v for v in KNOWN_VARIANTS_1B if v in ctx.plan.remeasure)


def _nothing_known_changed(ctx: StageContext, results: dict) -> str | None:
    if ctx.plan is None or ctx.plan.remeasure:
        return None
    return "every known side is answered on this device kind: " + "; ".join(
        f"{name}: {why}" for name, why in ctx.plan.known.items())


def _fp8_gemms_do_not_pay(ctx: StageContext, results: dict) -> str | None:
    """FP8 at 1B is timed end to end only when its GEMMs pay at 1B's layer shapes (``fp8_gemm``)."""
    gemm = results.get("fp8_gemm")
    if gemm is None or gemm.status != "passed":
        return None  # no answer from the GEMMs: the whole step decides
    at_1b = (gemm.figures.get("fp8_speedup_vs_bf16") or {}).get("1b") or {}
    best = max((v for v in at_1b.values() if isinstance(v, (int, float))), default=None)
    if best is not None and best <= 1.0:
        return f"FP8's GEMMs at 1B's layer shapes are x{best:.2f} of bf16 (fp8_gemm): FP8 cannot pay end to end"
    return None


def _gpu_tests_of(expression: str) -> Callable[[StageContext], list[str]]:
    """The ``gpu`` tests that ``-k expression`` selects (a short visit's check of one change)."""
    return lambda ctx: [*_gpu_tests(ctx), "-k", expression]


def _checkpoint_cost(ctx: StageContext) -> list[str]:
    # The resume run's shape (210M, seq 512, micro-batch 16); every writer the machine has (nvrx where
    # nvidia-resiliency-ext >= 0.6.0 imports), rounds while the cap allows (model build and the
    # persistent writers' start-up, ~1 min, come first).
    return [ctx.python, "-m", "benchmarks.checkpoint_stall", "--preset", "210m", "--vocab-size", "32768",
            "--seq-length", "512", "--micro-batch-size", "16", "--rounds", "3", "--steps-after", "20",
            "--time-limit-s", str(int(max(60.0, ctx.cap_s - 30))), "--output", str(ctx.stage_dir / "checkpoint_stall.json")]


def _resume_e2e(ctx: StageContext) -> list[str]:
    # training.deterministic: a resumed run must then repeat the uninterrupted one exactly (the script
    # exits 1 otherwise); without it GPU runs drift in the last bits and "how close" has no threshold.
    return ["env", "DETERMINISTIC=1", "bash", str(REPO / "benchmarks" / "gpu_resume_e2e.sh"), str(ctx.stage_dir),
            str(ctx.data_dir)]


def _finetune_speed(ctx: StageContext) -> list[str]:
    # EuroBERT-210M's shape, one SC task, the paper's batch and LR protocol, bf16 on the GPU; 300 steps
    # (the paper's runs are 1,000: the time per step is what a study's cost scales). The demo tokenizer
    # (--data-dir) and the task in the asset cache (benchmarks/results/gpu_visits/README.md: preparing a visit).
    tokenizer = ["--tokenizer", str(ctx.data_dir / "demo_tokenizer")] if ctx.data_dir else []  # run only with it
    return [ctx.python, "-m", "benchmarks.finetune_speed", "--model-size", "210m", *tokenizer, "--steps", "300",
            "--rounds", "1", "--workers", "1", "2", "4", "--grid-runs", "4", "--label", "suite",
            "--output", str(ctx.stage_dir / "finetune_speed.json")]


STAGES: tuple[Stage, ...] = (
    Stage(name="environment", purpose="device, driver, versions", command=_python_probe("environment"),
          max_s=120, min_s=10, read=read_environment),
    Stage(name="te_smoke", purpose="Transformer Engine: FP8 LayerNormMLP, fused attention (no mask, causal)",
          command=_python_probe("te_smoke"), max_s=90, min_s=20, needs=frozenset({"gpu", "te"}), read=read_te_smoke),
    Stage(name="throughput_1b_bf16",
          purpose="1B, seq 2048, bf16: the recipe's configuration (with a profile) vs TE's fused cross entropy, "
                  "one micro-batch of 18 and documents isolated (THD); the step as one GPU and as a 64-rank run pays it",
          command=_throughput("1b", "bf16", variants=WANTED_VARIANTS_1B, hf=False, profile=True),
          max_s=240, min_s=90, read=read_throughput),
    Stage(name="fp8_gemm", purpose="one layer's GEMMs, bf16 vs FP8 (delayed, tensorwise), from 210M to Llama-3-70B "
                                   "sizes: from what size FP8 pays",
          command=lambda ctx: [ctx.python, "-m", "benchmarks.fp8_gemm",
                               "--output", str(ctx.stage_dir / "fp8_gemm.json")],
          max_s=90, min_s=40, needs=frozenset({"fp8"}), read=read_fp8_gemm),
    Stage(name="throughput_1b_fp8", purpose="1B, seq 2048, FP8 (delayed scaling): the recipe's configuration in FP8, "
                                            "when FP8's GEMMs pay at 1B",
          command=_throughput("1b", "fp8", hf=False), max_s=150, min_s=60, needs=frozenset({"fp8"}),
          read=read_throughput, skip_if=_fp8_gemms_do_not_pay),
    Stage(name="throughput_610m_bf16", purpose="610M, seq 2048, bf16: the recipe's configuration (its MFU target)",
          command=_throughput("610m", "bf16", hf=False), max_s=150, min_s=60, needs=frozenset({"gpu"}),
          read=read_throughput),
    Stage(name="finetune_210m", purpose="evaluation harness at EuroBERT-210M's size, one SC task, bf16: fine-tuning "
                                        "runs per GPU-hour, ours vs transformers.Trainer, and the grid with 1, 2 and 4 "
                                        "workers sharing the GPU",
          command=_finetune_speed, max_s=240, min_s=90, needs=frozenset({"gpu", "data"}), read=read_finetune_speed),
    Stage(name="gpu_tests_new", purpose="the `gpu` tests not yet passed on this device kind (benchmarks/gpu_check.py)",
          command=_new_gpu_tests, max_s=240, min_s=90, needs=frozenset({"gpu"}), read=read_gpu_tests),
    Stage(name="throughput_1b_known", purpose="1B bf16: the known sides (Hugging Face, the local spec, CUDA graphs) "
                                              "whose code or device kind changed since they were last timed",
          command=_throughput("1b", "bf16", variants=_known_variants,
                              hf=lambda ctx: ctx.plan is None or "hf" in ctx.plan.remeasure),
          max_s=200, min_s=60, needs=frozenset({"gpu"}), read=read_throughput, skip_if=_nothing_known_changed),
    Stage(name="resume_e2e", purpose="210M biphasic with training.deterministic, killed during its step-200 save, "
                                     "resumed: the same losses as uninterrupted; speed after each save",
          command=_resume_e2e, max_s=260, min_s=150, needs=frozenset({"gpu", "data"}), read=read_resume_e2e),
    Stage(name="checkpoint_cost", purpose="what a save costs training (210M): stall and slower steps while the "
                                          "writer works, sync vs each asynchronous writer (mcore, forked, nvrx)",
          command=_checkpoint_cost, max_s=240, min_s=120, needs=frozenset({"gpu"}), read=read_checkpoint_cost),
    # Only with --stages: all the gpu tests, a short visit's check of one change, and sides answered before.
    Stage(name="gpu_tests", purpose="every `gpu`-marked test (benchmarks/gpu_check.py)", command=_gpu_tests,
          max_s=300, min_s=120, needs=frozenset({"gpu"}), read=read_gpu_tests, in_full_run=False),
    Stage(name="gpu_tests_fusions", purpose="the fusion `gpu` tests only: loss and gradient buffers with each "
                                            "fusion against without (a short visit's check of the recipes' default)",
          command=_gpu_tests_of("fusion_gives_the_unfused"), max_s=90, min_s=30, needs=frozenset({"gpu", "te"}),
          read=read_gpu_tests, in_full_run=False),
    Stage(name="throughput_1b_fusions", purpose="1B bf16: the recipe's configuration vs each of its fusions undone",
          command=_throughput("1b", "bf16", variants=("no_rope_fusion", "no_grad_accum_fusion"), hf=False),
          max_s=150, min_s=80, needs=frozenset({"gpu"}), read=read_throughput, in_full_run=False),
    Stage(name="throughput_1b_micro3", purpose="1B bf16: the recipe's 2 micro-batches of 9 against its earlier "
                                               "6 of 3 (the same sequences): speed and peak memory",
          command=_throughput("1b", "bf16", variants=("micro_batch_3",), hf=False), max_s=120, min_s=60,
          needs=frozenset({"gpu"}), read=read_throughput, in_full_run=False),
)


# --------------------------------------------------------------------------------------------------
# Running stages inside the budget.


@dataclasses.dataclass(kw_only=True)
class StageResult:
    name: str
    purpose: str
    status: str = "pending"
    reason: str | None = None
    cap_s: float | None = None
    wall_s: float | None = None
    exit_code: int | None = None
    command: str | None = None
    log: str | None = None
    figures: dict = dataclasses.field(default_factory=dict)


class Budget:
    """Seconds left for stages: ``budget_s`` from the start, less ``reserve_s`` for the end."""

    def __init__(self, budget_s: float, reserve_s: float, clock: Callable[[], float] = time.monotonic):
        self.budget_s, self.reserve_s, self.clock = budget_s, reserve_s, clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.budget_s - self.reserve_s - self.elapsed()

    def cap_for(self, stage: Stage) -> float | None:
        """The stage's cap, or None when its ``min_s`` no longer fits."""
        left = self.left()
        return None if left < stage.min_s else min(stage.max_s, left)


def _start(stage: Stage, ctx: StageContext, log_path: Path, result: StageResult, cap: float) -> subprocess.Popen:
    argv = stage.command(ctx)
    result.command = shlex.join(argv)
    result.cap_s = round(cap, 1)
    result.log = str(log_path)
    log = open(log_path, "w", encoding="utf-8")
    log.write(f"$ {result.command}\n(cap {cap:.0f} s)\n\n")
    log.flush()
    # A session of its own: a timeout kills the stage's whole process tree (torchrun, pytest workers).
    return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _with_repo(os.environ.get("PYTHONPATH"))})


def _with_repo(pythonpath: str | None) -> str:
    """``PYTHONPATH`` with the project first: what a stage starts beyond its ``python -m`` in this tree
    (pytest's workers, the trainer under the resume script) imports megatron_ext from this tree whether
    or not it is installed."""
    return os.pathsep.join([str(REPO), *(p for p in (pythonpath or "").split(os.pathsep) if p and p != str(REPO))])


def _kill_tree(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _finish(stage: Stage, proc: subprocess.Popen, result: StageResult, started: float, cap: float,
            ctx: StageContext) -> None:
    try:
        code = proc.wait(timeout=max(0.0, started + cap - time.monotonic()))
        result.status, result.exit_code = ("passed" if code == 0 else "failed"), code
        if code == STOPPED_AT_ITS_OWN_LIMIT:  # the stage stopped itself before the cap (gpu_check.py)
            result.status, result.reason = "timed_out", f"stopped itself before its cap of {cap:.0f} s (exit 124)"
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        result.status, result.exit_code = "timed_out", proc.returncode
        result.reason = f"killed at its cap of {cap:.0f} s"
    result.wall_s = round(time.monotonic() - started, 1)
    if stage.read is not None:
        try:
            result.figures = stage.read(ctx.stage_dir)
        except Exception as error:  # the figures are a report: a reader's bug must not lose the run
            result.figures = {"read_error": f"{type(error).__name__}: {error}"}
    if result.status == "failed":
        result.reason = result.reason or _last_line(Path(result.log))


def _last_line(log: Path) -> str | None:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1][:300] if lines else None


def run_suite(stages: tuple[Stage, ...] | list[Stage], *, machine: Machine, budget: Budget, output_dir: Path,
              data_dir: Path | None = None, on_update: Callable[[list[StageResult]], None] | None = None,
              python: str = sys.executable, plan: VisitPlan | None = None,
              chosen: bool = False) -> list[StageResult]:
    """Run ``stages`` in order inside ``budget`` (module docstring); ``on_update`` gets the results
    after every change of state (the summaries are written from it). ``plan``: what this device kind's
    visits already answer (``Stage.skip_if`` reads it); ``chosen``: the stages were named
    (``--stages``), so each runs whatever the plan says."""
    results = {s.name: StageResult(name=s.name, purpose=s.purpose) for s in stages}
    ordered = [results[s.name] for s in stages]
    by_name = {s.name: s for s in stages}
    partners = {s.alongside: s for s in stages if s.alongside and s.alongside in by_name}
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)

    def update() -> None:
        if on_update is not None:
            on_update(ordered)

    def applicable(stage: Stage) -> bool:
        reason = machine.lacks(stage.needs)
        if reason is None and "data" in stage.needs and not (data_dir and (data_dir / "demo_dataset").is_dir()):
            reason = "needs --data-dir (demo_tokenizer/ and demo_dataset/)"
        if reason is not None:
            results[stage.name].status, results[stage.name].reason = "not_applicable", reason
            return False
        if stage.skip_if is not None and not chosen:
            plan_context = StageContext(machine=machine, stage_dir=output_dir / stage.name, data_dir=data_dir,
                                        cap_s=0.0, plan=plan, python=python)
            if (reason := stage.skip_if(plan_context, results)) is not None:
                results[stage.name].status, results[stage.name].reason = "skipped", reason
                return False
        return True

    for stage in stages:
        if stage.alongside in by_name:  # started with its partner
            continue
        group = [stage] + ([partners[stage.name]] if stage.name in partners else [])
        running = []
        for member in group:
            if not applicable(member):
                continue
            cap = budget.cap_for(member)
            if cap is None:
                r = results[member.name]
                r.status, r.reason = "skipped", f"needs >= {member.min_s:.0f} s, {max(0.0, budget.left()):.0f} s left"
                continue
            ctx = StageContext(machine=machine, stage_dir=output_dir / member.name, data_dir=data_dir, cap_s=cap,
                               plan=plan, python=python)
            ctx.stage_dir.mkdir(parents=True, exist_ok=True)
            results[member.name].status = "running"
            proc = _start(member, ctx, output_dir / "logs" / f"{member.name}.log", results[member.name], cap)
            running.append((member, proc, time.monotonic(), cap, ctx))
            print(f"[{budget.elapsed():5.0f} s] {member.name}: started (cap {cap:.0f} s)", flush=True)
        update()
        for member, proc, started, cap, ctx in running:
            _finish(member, proc, results[member.name], started, cap, ctx)
            r = results[member.name]
            print(f"[{budget.elapsed():5.0f} s] {member.name}: {r.status} in {r.wall_s:.0f} s"
                  + (f" ({r.reason})" if r.reason else ""), flush=True)
            update()
    for r in ordered:
        if r.status in ("skipped", "not_applicable"):
            print(f"[{budget.elapsed():5.0f} s] {r.name}: {r.status} ({r.reason})", flush=True)
    update()
    return ordered


# --------------------------------------------------------------------------------------------------
# Summaries.


def _fmt(value, spec: str = ",.0f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _figure_lines(result: StageResult) -> list[str]:
    f = result.figures
    if not f:
        return []
    if "read_error" in f:
        return [f"- (figures could not be read: {f['read_error']})"]
    if result.name == "environment":
        return ["- " + ", ".join(f"{k} {v}" for k, v in f.items() if v is not None)]
    if "rows" in f:
        lines = [] if f.get("complete", True) else ["- partial: the stage was cut before its end; the sides it measured:"]
        for side in f.get("sides", []):
            speed = "-" if side.get("tokens_per_s") is None else f"{side['tokens_per_s']:,.0f} tok/s"
            lines.append(f"  - {side['row']} / {side['side']}: {speed}, peak {_fmt(side.get('peak_mem_gb'), '.1f')} GB"
                         + (f" ({side['error']})" if side.get("error") else ""))
        if f["rows"]:
            lines += ["", "| row | micro-batches | tok/s | MFU | ms/step | peak GB (estimate) | HF tok/s | vs HF |",
                      "|---|---|---|---|---|---|---|---|"]
        for row in f["rows"]:
            mfu = None if row["mfu"] is None else 100 * row["mfu"]
            step = None if row["step_time_s"] is None else 1e3 * row["step_time_s"]
            ratio = "-" if row["speedup_vs_hf"] is None else f"x{row['speedup_vs_hf']:.2f}"
            lines.append(f"| {row['row']} | {row['shape']} | {_fmt(row['tokens_per_s'])} | {_fmt(mfu, '.1f')} % | "
                         f"{_fmt(step)} | {_fmt(row['peak_mem_gb'], '.1f')} ({_fmt(row.get('estimated_mem_gb'), '.1f')}) | "
                         f"{_fmt(row['hf_tokens_per_s'])} | {ratio} |")
        for row in f["rows"]:
            for name, v in row["variants"].items():
                if v.get("same_as_default"):
                    lines.append(f"- {row['row']}, variant `{name}`: the same as the default on this machine (not timed)")
                elif v.get("same_as"):
                    lines.append(f"- {row['row']}, variant `{name}`: the same as variant `{v['same_as']}` on this "
                                 "machine (timed once)")
                elif v["error"]:
                    lines.append(f"- {row['row']}, variant `{name}`: {v['error']}")
                else:
                    speedup = "-" if v["default_speedup"] is None else f"x{v['default_speedup']:.2f}"
                    lines.append(f"- {row['row']}: the recipe's configuration is {speedup} variant `{name}` "
                                 f"({_fmt(v['tokens_per_s'])} tok/s, {_fmt(v['peak_mem_gb'], '.1f')} GB)")
            for side, error in row["errors"].items():
                lines.append(f"- {row['row']}, {side}: {error}")
            if row.get("side_wall_s"):
                lines.append(f"- {row['row']}, wall time per side (s): "
                             + ", ".join(f"{k} {v:.0f}" for k, v in row["side_wall_s"].items()))
        return lines
    if result.name == "checkpoint_cost":
        lines = [f"- nvidia-resiliency-ext: {f.get('nvidia_resiliency_ext') or 'not installed (no nvrx side)'}; "
                 f"{f.get('rounds')} rounds; share of a run saving every {f.get('save_interval')} steps",
                 "", "| side | stall s | written after s | cost (plain steps) | share % | writers' CPU s |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {side} | {v['stall_s']} | {v['written_s']} | {v['cost_steps']} | {v['share_pct']} | "
                  f"{_fmt(v.get('helpers_cpu_s'), '.2f')} |" for side, v in f.get("sides", {}).items()]
        return lines
    if "counts" in f:  # a gpu_check report (gpu_tests and its subsets)
        counts = ", ".join(f"{n} {k}" for k, n in sorted(f.get("counts", {}).items())) or "no test report"
        lines = [f"- {counts}"]
        lines += [f"- {p}" for p in f.get("problems", [])]
        lines += [f"- collection error: {e}" for e in f.get("collection_errors", [])]
        if f.get("fp8_vs_bf16_loss"):
            lines.append(f"- FP8 vs bf16 training loss: `{json.dumps(f['fp8_vs_bf16_loss'])}`")
        return lines
    return ["- " + ", ".join(f"{k}: {v}" for k, v in f.items())]


def summary_markdown(results: list[StageResult], *, machine: Machine, budget_s: float, elapsed_s: float,
                     commit: str | None) -> str:
    """The page a person reads first."""
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines = [f"# GPU suite on {machine.device}", "",
             f"Commit {commit or 'unknown'}; budget {budget_s:.0f} s, used {elapsed_s:.0f} s; "
             + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", "",
             "| stage | status | wall / cap (s) | what | note |", "|---|---|---|---|---|"]
    for r in results:
        wall = f"{_fmt(r.wall_s)} / {_fmt(r.cap_s)}" if r.cap_s is not None else "-"
        lines.append(f"| {r.name} | {r.status} | {wall} | {r.purpose} | {(r.reason or '').replace('|', '/')} |")
    for r in results:
        figures = _figure_lines(r)
        if figures:
            lines += ["", f"## {r.name}", "", *figures]
    lines += ["", "Logs: `logs/<stage>.log`; each stage's files: `<stage>/`; everything as data: `summary.json`."]
    return "\n".join(lines) + "\n"


def write_summaries(output_dir: Path, results: list[StageResult], *, machine: Machine, budget: Budget,
                    commit: str | None) -> None:
    record = {"device": machine.device, "machine": dataclasses.asdict(machine), "commit": commit,
              "budget_s": budget.budget_s, "reserve_s": budget.reserve_s, "elapsed_s": round(budget.elapsed(), 1),
              "stages": [dataclasses.asdict(r) for r in results]}
    for name, text in (("summary.json", json.dumps(record, indent=2, default=str) + "\n"),
                       ("summary.md", summary_markdown(results, machine=machine, budget_s=budget.budget_s,
                                                       elapsed_s=budget.elapsed(), commit=commit))):
        tmp = output_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, output_dir / name)


def write_plan(output_dir: Path, plan: VisitPlan, *, commit: str | None) -> None:
    """The visit's plan (``plan.json``) and the fingerprints of the known sides' code in this tree
    (``fingerprints.json``: the next visit's plan compares against them)."""
    from benchmarks import visit_plan

    (output_dir / "plan.json").write_text(json.dumps(
        {"kind": plan.kind, "remeasure": plan.remeasure, "known": plan.known,
         "passed_tests": sorted(plan.passed_tests)}, indent=1) + "\n")
    visit_plan.write_fingerprints(output_dir, visit_plan.tree_fingerprints(REPO), commit=commit,
                                  how="recorded by gpu_suite.py from the tree it ran")


def _commit() -> str | None:
    """The project's commit: ``MEGATRON_EXT_COMMIT`` when set (a copy of the tree without its own git
    history, e.g. on a lent GPU machine, would name another commit), else git's."""
    if os.environ.get("MEGATRON_EXT_COMMIT"):
        return os.environ["MEGATRON_EXT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def probe_machine_in_child(python: str = sys.executable) -> Machine:
    """``probe_machine`` in a child process (no CUDA context in the suite's own process)."""
    run = subprocess.run([python, "-m", "benchmarks.gpu_suite", "--probe", "machine"], cwd=REPO,
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"probing this machine failed (exit {run.returncode}): {(run.stdout + run.stderr)[-2000:]}")
    return Machine(**json.loads(run.stdout.strip().splitlines()[-1]))


DEFAULT_BUDGET_S = 480
"""The suite's budget when it runs here (``--budget-s``)."""
DEFAULT_JOB_TIME = "00:15:00"
"""The time limit of the suite as a job (``--time``)."""
DEFAULT_MARGIN_S = 60
"""Seconds of a job's time limit kept for its start-up and its end (``--margin-s``)."""


def build_parser() -> argparse.ArgumentParser:
    from megatron_ext.launch import LAUNCHERS, launcher_class

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--budget-s", type=float, default=None,
        help=f"seconds for the whole suite (default {DEFAULT_BUDGET_S}; with --launcher: --time less --margin-s)")
    add("--reserve-s", type=float, default=10, help="seconds kept at the end for the summaries (default 10)")
    add("--output-dir", type=Path, default=None, help="default: runs/gpu_suite/<device>")
    add("--data-dir", type=Path, default=None,
        help="folder with demo_tokenizer/ and demo_dataset/ (the resume run's corpus); default: $MEGATRON_EXT_DATA "
             "or data/, where `make demo-data` puts them")
    add("--stages", nargs="+", default=None, metavar="STAGE",
        help="run these stages only, in this order (default: all, in order of value): "
             + ", ".join(s.name for s in STAGES))
    add("--list", action="store_true", help="print the stages and their time limits, then exit")
    add("--probe", choices=sorted(PROBES), default=None, help=argparse.SUPPRESS)
    add("--probe-output", type=Path, default=None, help=argparse.SUPPRESS)
    job = parser.add_argument_group("as a job", "submit the suite through a launcher instead of running it here")
    job.add_argument("--launcher", choices=list(LAUNCHERS), default=None,
                     help="submit the suite as a job of this launcher: " + ", ".join(LAUNCHERS))
    job.add_argument("--time", default=None, metavar="TIME",
                     help=f"the job's time limit: minutes, HH:MM:SS or D-HH:MM:SS [{DEFAULT_JOB_TIME}]")
    job.add_argument("--margin-s", type=float, default=None,
                     help=f"seconds of --time kept for the job's start-up and end [{DEFAULT_MARGIN_S}]")
    job.add_argument("--dry-run", action="store_true", help="print the submission; submit nothing")
    for name in LAUNCHERS:
        launcher_class(name).add_arguments(parser.add_argument_group(f"{name} launcher"))
    return parser


def _misplaced_options(args: argparse.Namespace) -> list[str]:
    """The options given that do not apply: the job's without ``--launcher``, a launcher's own
    without that launcher (each would be ignored)."""
    from megatron_ext.launch import LAUNCHERS, launcher_class

    misplaced = []
    if args.launcher is None:
        misplaced += [f"{flag}: only with --launcher" for flag, value in
                      (("--time", args.time), ("--margin-s", args.margin_s), ("--dry-run", args.dry_run or None))
                      if value is not None]
    for name in LAUNCHERS:
        if name == args.launcher:
            continue
        own = argparse.ArgumentParser(add_help=False)
        launcher_class(name).add_arguments(own.add_argument_group(name))
        misplaced += [f"--{dest.replace('_', '-')}: an option of the {name} launcher (--launcher {name})"
                      for dest, default in vars(own.parse_args([])).items() if getattr(args, dest) != default]
    return misplaced


def suite_job(args: argparse.Namespace) -> tuple[Job, float]:
    """The suite as a job (``--launcher``), and its budget: one process on one node with one GPU
    for ``--time``, given that time less ``--margin-s``; its log and summaries in ``--output-dir``.
    ValueError: a bad ``--time``, or a budget that leaves nothing beyond ``--reserve-s``."""
    from megatron_ext.launch import Job, Resources

    try:
        resources = Resources(nodes=1, gpus_per_node=1, time=args.time or DEFAULT_JOB_TIME)
    except ValueError as err:
        raise ValueError(f"--time: {str(err).removeprefix('time: ')}") from None
    margin_s = DEFAULT_MARGIN_S if args.margin_s is None else args.margin_s
    budget_s = resources.time_s - margin_s
    if budget_s <= args.reserve_s:
        raise ValueError(f"--time {resources.time} less --margin-s {margin_s:g} leaves {budget_s:g} s for the suite, "
                         f"not more than --reserve-s {args.reserve_s:g}")
    output_dir = (args.output_dir or REPO / "runs" / "gpu_suite" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    suite_args = ["--budget-s", f"{budget_s:g}", "--reserve-s", f"{args.reserve_s:g}", "--output-dir", str(output_dir)]
    if args.data_dir is not None:
        suite_args += ["--data-dir", str(args.data_dir.resolve())]
    if args.stages:
        suite_args += ["--stages", *args.stages]
    return Job(name="gpu-suite", module="benchmarks.gpu_suite", args=tuple(suite_args), workdir=REPO,
               log=output_dir / "gpu_suite", resources=resources), budget_s


def submit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--launcher``: submit the suite as a job and say where it is; follow it where the launcher
    does (the local one runs it now). Exit 0: submitted (followed: the job succeeded)."""
    from megatron_ext.config_loading import UserError
    from megatron_ext.launch import JobEvents, launcher_class

    if args.budget_s is not None:
        parser.error("--budget-s: with --launcher the suite's budget is --time less --margin-s")
    try:
        job, budget_s = suite_job(args)
    except ValueError as err:
        parser.error(str(err))
    try:
        launcher = launcher_class(args.launcher).from_args(args)
        if args.dry_run:
            print(launcher.describe(job, []))
            return 0
        job_id = launcher.submit(job)
    except UserError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    output_dir = job.log.parent
    print(f"gpu_suite: job {job_id} ({args.launcher} launcher, time limit {job.resources.time}, suite budget {budget_s:g} s)\n"
          f"  log      {launcher.log_file(job, job_id)}\n"
          f"  summary  {output_dir / 'summary.md'} and summary.json (rewritten after every stage)", flush=True)
    if not launcher.follows:
        return 0
    stopped = launcher.follow([job_id], JobEvents())
    state = launcher.state(job_id)
    print(f"gpu_suite: job {job_id} {'stopped by ' + stopped if stopped else state.detail or state.status}",
          flush=True)
    return 0 if state.succeeded else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.probe is not None:
        record = PROBES[args.probe]()
        text = json.dumps(record, default=str)
        if args.probe_output is not None:
            args.probe_output.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(text)
        return _te_smoke_exit(record) if args.probe == "te_smoke" else 0
    if args.list:
        for s in STAGES:
            needs = f" [needs {', '.join(sorted(s.needs))}]" if s.needs else ""
            with_ = f" (alongside {s.alongside})" if s.alongside else ""
            only = "" if s.in_full_run else " (only with --stages)"
            print(f"{s.name:22} min {s.min_s:4.0f} s, max {s.max_s:4.0f} s{needs}{with_}{only}: {s.purpose}")
        return 0
    misplaced = _misplaced_options(args)
    if misplaced:
        parser.error("; ".join(misplaced))
    by_name = {s.name: s for s in STAGES}
    if args.stages:
        unknown = [n for n in args.stages if n not in by_name]
        if unknown:
            parser.error(f"--stages: unknown {', '.join(unknown)}; known: {', '.join(by_name)}")
        stages = [by_name[n] for n in args.stages]
    else:
        stages = [s for s in STAGES if s.in_full_run]
    if args.launcher is not None:
        return submit(parser, args)
    if args.budget_s is None:
        args.budget_s = DEFAULT_BUDGET_S
    if args.budget_s <= args.reserve_s:
        parser.error(f"--budget-s {args.budget_s:g} must exceed --reserve-s {args.reserve_s:g}")
    budget = Budget(args.budget_s, args.reserve_s)
    machine = probe_machine_in_child()
    slug = "".join(c if c.isalnum() else "_" for c in machine.device).strip("_").lower()
    output_dir = args.output_dir or REPO / "runs" / "gpu_suite" / slug
    output_dir.mkdir(parents=True, exist_ok=True)
    data_dir = args.data_dir or Path(os.environ.get("MEGATRON_EXT_DATA", REPO / "data"))
    commit = _commit()
    print(f"gpu_suite: {machine.device}, budget {args.budget_s:.0f} s, {len(stages)} stage(s) -> {output_dir}",
          flush=True)
    plan = VisitPlan.for_device(machine.device)
    write_plan(output_dir, plan, commit=commit)
    for name, why in plan.remeasure.items():
        print(f"plan: re-measure {name} ({why})", flush=True)
    for name, why in plan.known.items():
        print(f"plan: known {name} ({why})", flush=True)
    print(f"plan: {len(plan.passed_tests)} gpu test(s) already passed on {plan.kind} (gpu_tests_new deselects them)",
          flush=True)
    results = run_suite(stages, machine=machine, budget=budget, output_dir=output_dir, data_dir=data_dir,
                        on_update=lambda rs: write_summaries(output_dir, rs, machine=machine, budget=budget,
                                                             commit=commit),
                        plan=plan, chosen=bool(args.stages))
    print(f"wrote {output_dir / 'summary.md'} and summary.json ({budget.elapsed():.0f} s)")
    return 0 if all(r.status in ("passed", "not_applicable") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
