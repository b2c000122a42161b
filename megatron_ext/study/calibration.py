"""``--calibrate``: the study's speeds timed on this machine, through the launch layer; and the cost
flags' work for the study tools (:func:`report_study_cost`: calibrate when asked, estimate, print,
refuse a budget).

Each distinct training shape (model, batch, precision, objective) of a study runs a few steps as a
trainer job of the local launcher (``megatron_ext.launch.local``), the first steps (warm-up) left
out of the timing; then one fine-tuning run per family and size runs as an evaluation job, in the
environment of one of the study's evaluation workers. What they measured is a
:class:`~megatron_ext.study.cost.Calibration`, which the cost model (``performance/cost.py``,
``study/cost.py``: no process started) prices from first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.launch import TRAINER, Job, JobEvents, JobState
from megatron_ext.launch.local import LocalLauncher
from megatron_ext.performance.cost import Speed, calibration_key, check_budget, speed_table
from megatron_ext.study.cost import (Calibration, StudyCost, costed_config, finetune_families, format_study_cost,
                                     study_cost)
from megatron_ext.training.config import RunConfig
from megatron_ext.training.dry_run import phase_flops


def steady_step_seconds(records: list[dict], *, warmup: int, tokens_per_step: int) -> float:
    """Mean seconds per step of a trainer's ``metrics.jsonl`` train records logged at every step
    (each with its ``tokens_per_s``), the first ``warmup`` steps excluded."""
    timed = [tokens_per_step / r["tokens_per_s"] for r in records
             if r.get("kind") == "train" and "tokens_per_s" in r][warmup:]
    if not timed:
        raise UserError(f"calibration: no step after the {warmup} warm-up step(s) was timed")
    return sum(timed) / len(timed)


def calibration_recipe(recipe: dict, objective_phase: dict, *, steps: int, root: Path) -> dict:
    """``recipe`` cut to ``steps`` steps of one objective, writing under ``root``: nothing loaded or kept."""
    from megatron_ext.training.recipe import deep_merge

    trimmed = deep_merge(recipe, {
        "phases": [{"objective": objective_phase["objective"], "share": 1.0}],
        "training": {"train_iters": steps, "eval_interval": 0, "log_interval": 1, "exit_duration_in_mins": None,
                     "exit_interval": None},
        "data": {"eval_iters": 0},  # no validation at all, the final one included (Megatron-LM's eval_interval 0 keeps it)
        "schedule": {"lr_warmup_iters": 1, "lr_wsd_decay_iters": 1},
        "checkpoint": {"save": str(root / "checkpoints"), "save_interval": steps, "keep_last": 1},
        "logging": {"log_dir": str(root / "log"), "wandb_mode": "disabled"},
    })
    for key in ("load", "finetune", "branch_from", "branch_step", "keep_steps"):
        trimmed["checkpoint"].pop(key, None)
    return trimmed


def _run_job(job: Job, what: str) -> None:
    """``job`` through the local launcher, to its end; a failure is refused in one line naming
    ``what`` and the job's last line of output."""
    launcher = LocalLauncher()
    job_id = launcher.submit(job)
    stopped = launcher.follow([job_id], JobEvents())
    state: JobState = launcher.state(job_id)
    if stopped is not None:
        raise UserError(f"--calibrate: stopped by {stopped} during {what}")
    if not state.succeeded:
        log = state.log or launcher.log_file(job, job_id)
        try:
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        except OSError:
            tail = []
        raise UserError(f"--calibrate: {what} failed ({state.detail or f'exit {state.exit_code}'}): "
                        f"{tail[0] if tail else '(no output)'}; its log: {log}")


def calibrate_training(runs: Iterable, *, warmup: int = 2, steps: int = 4,
                       say: Callable[[str], None] = print) -> tuple[dict[tuple, Speed], dict[str, Path]]:
    """Time ``warmup + steps`` steps of each distinct shape of ``runs`` (a study's planned runs:
    ``.name``, ``.size``, ``.recipe``, ``.config``) with the trainer on this machine; returns the
    speeds by :func:`~megatron_ext.performance.cost.calibration_key` and, per size, a checkpoint of the
    last calibration run (what the fine-tuning calibration starts from)."""
    import yaml

    speeds: dict[tuple, Speed] = {}
    checkpoints: dict[str, Path] = {}
    scratch = Path(tempfile.mkdtemp(prefix="calibration-"))
    for run in runs:
        config = costed_config(run)
        for index, phase in enumerate(run.recipe["phases"]):
            objective = config.resolved_phases[index].objective.tag
            key = calibration_key(config, objective)
            if key in speeds:
                continue
            root = scratch / f"{len(speeds)}"
            recipe = calibration_recipe(run.recipe, phase, steps=warmup + steps, root=root)
            path = root / "recipe.yaml"
            root.mkdir(parents=True)
            path.write_text(yaml.safe_dump(recipe, sort_keys=False))
            started = time.perf_counter()
            _run_job(Job(name=f"calibration.{run.name}.{objective}", module=TRAINER,
                         args=("--config", str(path)), log=root / "trainer", per_gpu=True),
                     f"the trainer on {run.name}'s shape")
            wall = time.perf_counter() - started
            records = [json.loads(line) for line in (root / "log" / "metrics.jsonl").read_text().splitlines()]
            tokens = config.data.global_batch_size * config.data.seq_length
            step_s = steady_step_seconds(records, warmup=warmup, tokens_per_step=tokens)
            flops = _one_step_flops(config, objective)
            all_steps = sum(tokens / r["tokens_per_s"] for r in records if "tokens_per_s" in r)
            speeds[key] = Speed(flops_per_s=flops / step_s, source="calibrated",
                                startup_s=max(0.0, wall - all_steps),
                                detail=f"{steps} steps of {run.size} {objective} timed here after {warmup} warm-up "
                                       f"({step_s:.3g} s/step, start-up and save {max(0.0, wall - all_steps):.0f} s)")
            checkpoints[run.size] = root / "checkpoints"
            say(f"calibrated {run.size} {objective}: {speeds[key].detail}")
    return speeds, checkpoints


def _one_step_flops(config: RunConfig, objective: str) -> float:
    """FLOPs of one step of ``config``'s first phase training ``objective``."""
    for phase in config.resolved_phases:
        if phase.objective.tag == objective:
            return sum(f for _, f in phase_flops(config, phase.start, phase.start + 1))
    raise AssertionError(objective)


def calibrate_finetuning(plan, checkpoints: dict[str, Path], *, say: Callable[[str], None] = print
                         ) -> dict[tuple[str, str], float]:
    """Seconds of one fine-tuning run per family for each size, timed here on ``checkpoints`` (a
    calibration run's, per size) at the study's settings (its first LR and seed, one task per
    family), as one of the study's ``evaluation.workers`` evaluation jobs would run it (its share of
    the cores on CPU)."""
    from megatron_ext.study.evaluation import evaluation_settings

    spec = plan.study.evaluation
    if spec is None:
        return {}
    first: dict[str, str] = {}
    for task, family, _ in finetune_families(spec.tasks):
        first.setdefault(family, task)
    one = dataclasses.replace(spec, tasks=tuple(first.values()), seeds=spec.seeds[:1] or (0,))
    lrs = spec.lrs[:1] or (5e-5,)
    found: dict[tuple[str, str], float] = {}
    scratch = Path(tempfile.mkdtemp(prefix="calibration-eval-"))
    for size, checkpoint in checkpoints.items():
        out = scratch / size
        # As one of evaluation.workers copies of the evaluation job: its share of the cores.
        threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, spec.workers)))}
        _run_job(Job(name=f"calibration.eval.{size}", module="megatron_ext.cli.evaluate",
                     args=("--models", f"calibration={checkpoint}", "--output-dir", str(out),
                           *evaluation_settings(one, lrs)), env=threads, log=scratch / f"evaluate-{size}"),
                 f"a fine-tuning run of {size}")
        for family, task in first.items():
            records = [json.loads(p.read_text()) for p in (out / "runs" / "calibration").glob(f"{task}/*.json")]
            if records:
                found[size, family] = sum(r["seconds"] for r in records) / len(records)
                say(f"calibrated fine-tuning {size} {family} ({task}): {found[size, family]:.1f} s per run")
    return found


def calibrate(plan, *, say: Callable[[str], None] = print) -> Calibration:
    """``--calibrate``: the study's training shapes, then one fine-tuning run per family and size."""
    say("calibrating on this machine: a few steps of each distinct shape, then one fine-tuning run per family")
    training, checkpoints = calibrate_training(plan.runs, say=say)
    return Calibration(training=training, finetuning=calibrate_finetuning(plan, checkpoints, say=say))


def report_study_cost(plan, args: argparse.Namespace, *, say: Callable[[str], None] = print,
                      show: bool = True) -> StudyCost:
    """The cost flags' work for a study tool: calibrate when asked, estimate, print (``show``), and
    refuse a budget the estimate exceeds."""
    calibration = calibrate(plan, say=say) if args.calibrate else Calibration()
    speeds = speed_table(args, calibration.training)
    if args.gpus is not None and args.gpus < 1:
        raise UserError(f"--gpus: expected at least 1, got {args.gpus}")
    cost = study_cost(plan, speeds=speeds, gpus=args.gpus, gpus_per_node=args.gpus_per_node, calibration=calibration)
    if show:
        say(format_study_cost(plan, cost))
    check_budget(args.budget_gpu_hours, cost.total_gpu_hours, cost.items(), f"study {plan.study.name}")
    return cost
