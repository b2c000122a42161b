"""The pretraining loop: phases (CLM/MLM) per step, WSD learning rate, checkpoints, logging.

Everything a step does is a function of the step number and the config: the phase and the
objective (``schedule.phase_at``), the learning rate (``schedule.lr_at``), the data position
(``step * global_batch_size`` samples consumed) and the MLM masks (a generator seeded from
``(seed, step, micro-batch group)``). A resumed run therefore replays exactly what an
uninterrupted run would have done; model, optimizer and RNG states come from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.config_loading import UserError
from megatron_ext import platform
from megatron_ext.model import build_encoder_model
from megatron_ext.objectives import MaskingConfig, ObjectiveBatch, apply_clm, apply_mlm
from megatron_ext.schedule import ResolvedPhase, lr_at, phase_at, resolve_phases
from megatron_ext.tokenizer import EncoderTokenizer, build_tokenizer
from megatron_ext.checkpoint import core as ckpt
from megatron_ext.training import data as data_lib
from megatron_ext.training.config import RunConfig
from megatron_ext.training.engines import Engine, MicroBatch, build_engine, megatron_transformer_overrides
from megatron_ext.training.metrics import MFU_CONVENTION, flops_per_token, lm_head_share, peak_flops_per_device
from megatron_ext.training.memory import check_fits, estimate_memory
from megatron_ext.training.plan import check_paths, make_plan

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


@dataclass(kw_only=True)
class TrainResult:
    """What a run did (returned on every rank)."""

    start_step: int
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    """Completed step -> global mean training loss."""
    valid: dict[int, dict[str, float]] = field(default_factory=dict)
    """Completed step -> {"clm": loss, "mlm": loss}."""
    skipped_steps: int = 0
    checkpoint: str | None = None
    """The last checkpoint written or loaded."""


TRAIN_STREAM, EVAL_STREAM = 0, 1


def masking_generator(seed: int, step: int, group: int, device: torch.device, *, stream: int = TRAIN_STREAM) -> torch.Generator:
    """MLM mask RNG for one micro-batch, a pure function of (seed, stream, step, micro-batch group).

    ``group = micro_batch_index * dp_size + dp_rank`` names the same samples whatever the data
    parallel size (for a fixed micro-batch size), so DP=2 masks exactly what DP=1 masks.
    Validation uses its own stream with step 0, so every evaluation masks the same positions.
    """
    state = np.random.SeedSequence([seed, stream, step, group]).generate_state(2, dtype=np.uint32)
    return torch.Generator(device=device).manual_seed(int(state[0]) << 32 | int(state[1]))


def make_objective(batch: dict[str, torch.Tensor], *, objective: str, masking: MaskingConfig | None,
                   tokenizer: EncoderTokenizer, vocab_size: int, generator: torch.Generator | None) -> ObjectiveBatch:
    """Apply the phase's objective to one GPTDataset micro-batch."""
    if objective == "clm":
        return apply_clm(batch["tokens"], batch["labels"], loss_mask=batch["loss_mask"])
    return apply_mlm(
        batch["tokens"], config=masking, mask_id=tokenizer.mask, vocab_size=vocab_size,
        special_ids=tokenizer.special_ids, generator=generator,
        maskable=batch["loss_mask"].sum(-1, keepdim=True) > 0,  # batch-padding samples
    )


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class StepLogger:
    """One readable line per logged step; every record also goes to metrics.jsonl and W&B."""

    def __init__(self, config: RunConfig, *, total_steps: int, start_step: int, wandb_run_id: str | None):
        self.config = config
        self.total_steps = total_steps
        self.is_writer = not dist.is_initialized() or dist.get_rank() == 0
        self.tokens_per_step = config.data.global_batch_size * config.data.seq_length
        name = platform.device_name()
        self.peak = peak_flops_per_device(name) if name else None
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.window_start = time.perf_counter()
        self.window_steps = 0
        self.window_flops = 0.0
        self.run_start = time.perf_counter()
        self.start_step = start_step
        self.wandb = None
        self.wandb_run_id = wandb_run_id
        if not self.is_writer:
            return
        self.log_dir = Path(config.logging.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = open(self.log_dir / "metrics.jsonl", "a", encoding="utf-8")
        if config.logging.wandb_mode != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=config.logging.wandb_project, name=config.logging.wandb_exp_name or self.log_dir.name,
                dir=str(self.log_dir), mode=config.logging.wandb_mode, config=config.to_dict(),
                id=wandb_run_id, resume="allow",
            )
            self.wandb_run_id = self.wandb.id

    def record(self, kind: str, step: int, values: dict) -> None:
        if not self.is_writer:
            return
        self.metrics.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        self.metrics.flush()
        if self.wandb is not None:
            self.wandb.log({f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def step(self, step: int, phase: ResolvedPhase, loss: float, lr: float, grad_norm: float, skipped: bool) -> None:
        self.window_steps += 1
        share = lm_head_share(phase, scored_only=self.config.training.lm_head_scored_only)
        self.window_flops += self.tokens_per_step * flops_per_token(
            self.config.model, self.config.data.seq_length, lm_head_share=share)
        values = {"objective": phase.objective, "loss": loss, "lr": lr, "grad_norm": grad_norm, "skipped": skipped}
        interval = self.config.training.log_interval
        if interval and (step % interval == 0 or step == self.total_steps):
            now = time.perf_counter()
            window_s = max(now - self.window_start, 1e-9)
            tokens_per_s = self.window_steps * self.tokens_per_step / window_s
            elapsed = now - self.run_start
            eta = elapsed / max(step - self.start_step, 1) * (self.total_steps - step)
            values["tokens_per_s"] = tokens_per_s
            line = (f"step {step:>{len(str(self.total_steps))}}/{self.total_steps} | {_phase_name(phase):<7} | "
                    f"loss {loss:.4f} | lr {lr:.2e} | gnorm {grad_norm:.3f} | {tokens_per_s:,.0f} tok/s")
            if self.peak:
                mfu = self.window_flops / window_s / (self.peak * self.world)
                values["mfu"] = mfu
                line += f" | MFU {100 * mfu:.1f}%"
            line += f" | elapsed {_duration(elapsed)} | ETA {_duration(eta)}"
            if skipped:
                line += " | SKIPPED (non-finite)"
            if self.is_writer:
                print(line, flush=True)
            self.window_start, self.window_steps, self.window_flops = now, 0, 0.0
        self.record("train", step, values)

    def close(self) -> None:
        if self.is_writer:
            self.metrics.close()
            if self.wandb is not None:
                self.wandb.finish()


def _phase_name(phase: ResolvedPhase) -> str:
    return "clm" if phase.objective == "clm" else f"mlm-{round(100 * phase.mask_ratio)}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


@torch.no_grad()
def evaluate(engine: Engine, batches: list[dict[str, torch.Tensor]], *, config: RunConfig,
             tokenizer: EncoderTokenizer) -> dict[str, float]:
    """Validation loss of both objectives on the same fixed batches (global token means)."""
    engine.model.eval()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    device = platform.device()
    masking = MaskingConfig(mask_ratio=config.training.eval_mask_ratio)
    result = {}
    for objective in ("clm", "mlm"):
        micro_batches = []
        for i, batch in enumerate(batches):
            gen = masking_generator(config.training.seed, 0, i * dp_size + dp_rank, device, stream=EVAL_STREAM)
            obj = make_objective(batch, objective=objective, masking=masking, tokenizer=tokenizer,
                                 vocab_size=config.model.vocab_size, generator=gen)
            micro_batches.append(MicroBatch(obj, batch.get("position_ids")))
        loss_sum, tokens = engine.eval_loss(micro_batches)
        result[objective] = loss_sum / tokens if tokens > 0 else math.nan
    engine.model.train()
    return result


def _trainer_state(step: int, config: RunConfig, nonfinite: int, skipped: int, wandb_run_id: str | None) -> dict:
    state = {
        "step": step,
        "consumed_samples": step * config.data.global_batch_size,
        "nonfinite_in_a_row": nonfinite,
        "skipped_steps": skipped,
        "wandb_run_id": wandb_run_id,
        **platform.rng_state(),
    }
    return state


# Model fields that may differ on resume: the attention kernels (te and local load the same weights).
RESUME_MAY_CHANGE_MODEL = ("attention_backend",)


def _meaning_changes(path: Path, config: RunConfig, tokenizer: EncoderTokenizer) -> list[str]:
    """What differs between the run that wrote ``path`` and this one in a way that changes what the
    weights mean: model fields (beyond ``RESUME_MAY_CHANGE_MODEL``) and the tokenizer's content.
    Everything else (LR, schedule, intervals, data blend, engine and layout where the optimizer
    format allows) may change on resume."""
    saved = ckpt.read_run_config(path).get("model", {})
    current = json.loads(json.dumps(config.to_dict()["model"]))  # as saved: tuples become lists
    changes = [f"model.{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in sorted(saved.keys() | current.keys())
               if key not in RESUME_MAY_CHANGE_MODEL and saved.get(key) != current.get(key)]
    fingerprint = ckpt.read_tokenizer_fingerprint(path)
    if fingerprint is not None and fingerprint != tokenizer.fingerprint():
        changes.append(f"tokenizer: {ckpt.read_tokenizer_reference(path).get('tokenizer_model')!r} (content "
                       f"{fingerprint}) -> {config.tokenizer.tokenizer_model!r} (content {tokenizer.fingerprint()})")
    return changes


def _resume(engine: Engine, path: Path, config: RunConfig, tokenizer: EncoderTokenizer) -> dict:
    """Load model and optimizer state from ``path`` if the run is the same model and the engine can
    take its optimizer state (both checked before anything is loaded); returns the trainer state."""
    changes = _meaning_changes(path, config, tokenizer)
    if changes:
        raise UserError(f"cannot resume from checkpoint {path}: this run changes what its weights mean:\n  "
                         + "\n  ".join(changes) + "\nUse the checkpoint's settings, or another checkpoint.save "
                         "directory for a new run (checkpoint.load + checkpoint.finetune to start from its weights).")
    problem = ckpt.optimizer_format_problem(ckpt.saved_optimizer_format(path), engine.optimizer_state.format())
    if problem:
        raise UserError(f"cannot resume from checkpoint {path}: {problem}. Or start from its weights only with "
                         f"checkpoint.load={path.parent} and checkpoint.finetune: true (fresh optimizer and schedule).")
    with engine.checkpointing():
        return ckpt.load_checkpoint(path, model=engine.checkpoint_model, optimizer=engine.optimizer_state)


def check_tokenizer_fits(config: RunConfig, tokenizer: EncoderTokenizer) -> None:
    if tokenizer.vocab_size > config.model.vocab_size:
        raise UserError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids but model.vocab_size is "
            f"{config.model.vocab_size}; set model.vocab_size >= {tokenizer.vocab_size} (or from_tokenizer)"
        )
    if any(p.objective == "mlm" for p in config.phases) or config.training.eval_interval:
        tokenizer.mask  # raises MissingSpecialTokenError with the fix


def _restore(engine: Engine, config: RunConfig, tokenizer: EncoderTokenizer) -> tuple[dict, str | None]:
    """The resume policy: (trainer state to continue from, checkpoint it came from).

    ``checkpoint.finetune``: the weights of ``checkpoint.load``'s newest checkpoint and a fresh
    optimizer and schedule, unless ``checkpoint.save`` already holds a checkpoint of this run (an
    interrupted continued pretraining), which is resumed in full. Otherwise the newest checkpoint
    in ``checkpoint.load`` (or ``checkpoint.save``) is resumed in full, or the run starts fresh."""
    cc = config.checkpoint
    if cc.finetune:
        path = ckpt.latest_checkpoint(cc.load)
        if path is None:
            raise UserError(f"checkpoint.load={cc.load!r}: no complete checkpoint found")
        with engine.checkpointing():
            ckpt.load_checkpoint(path, model=engine.checkpoint_model, optimizer=None)
        engine.weights_loaded()
        own = ckpt.latest_checkpoint(cc.save) if cc.save else None
        if own is not None:
            return _resume(engine, own, config, tokenizer), str(own)
        return {}, str(path)
    load_dir = cc.load or cc.save
    path = ckpt.latest_checkpoint(load_dir) if load_dir else None
    if cc.load and path is None:
        raise UserError(f"checkpoint.load={cc.load!r}: no complete checkpoint found")
    if path is None:
        return {}, None
    return _resume(engine, path, config, tokenizer), str(path)


def _micro_batch(batch: dict[str, torch.Tensor], step: int, phase: ResolvedPhase, group: int, *, config: RunConfig,
                 tokenizer: EncoderTokenizer, device: torch.device) -> MicroBatch:
    """One micro-batch of ``step`` under ``phase``'s objective; ``group`` (micro-batch index x
    data-parallel size + rank) keys its masking stream, so the masks do not depend on the layout."""
    masking = None if phase.objective == "clm" else MaskingConfig(
        mask_ratio=phase.mask_ratio, mask_replace_prob=phase.mask_replace_prob,
        random_replace_prob=phase.random_replace_prob)
    batch = _to_device(batch, device)
    gen = masking_generator(config.training.seed, step, group, device)
    obj = make_objective(batch, objective=phase.objective, masking=masking, tokenizer=tokenizer,
                         vocab_size=config.model.vocab_size, generator=gen)
    return MicroBatch(obj, batch.get("position_ids"))


def pretrain(config: RunConfig, *, exit_after_step: int | None = None) -> TrainResult:
    """Run (or resume) the configured pretraining. Initialises distributed state if needed.

    ``exit_after_step`` stops (after checkpointing) once that many steps are complete, like
    Megatron's ``--exit-interval``; used to test that resuming is exact.
    """
    check_paths(config)  # unwritable outputs and missing inputs, before anything starts
    engine = platform.resolve_engine(config.training.engine)
    platform.check_run_supported(fp8_recipe=config.training.fp8_recipe,
                                 recompute_granularity=config.training.recompute_granularity)
    backend, warning = platform.attention_backend_fallback(config.model.attention_backend)
    if warning is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(warning, file=sys.stderr, flush=True)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, attention_backend=backend))
    owns_process_group = not dist.is_initialized()
    try:
        if owns_process_group:
            platform.init_process_group_and_model_parallel(
                tensor_parallel_size=config.parallel.tensor_model_parallel_size,
                pipeline_parallel_size=config.parallel.pipeline_model_parallel_size,
                seed=config.training.seed,
            )
        return _pretrain(config, engine_name=engine, exit_after_step=exit_after_step)
    finally:
        if owns_process_group:
            platform.destroy_process_group_and_model_parallel()


def _pretrain(config: RunConfig, *, engine_name: str, exit_after_step: int | None) -> TrainResult:
    make_plan(config, dist.get_world_size())  # layout and batch sizes divide: checked before any allocation
    check_fits(estimate_memory(config, world_size=dist.get_world_size()), *platform.usable_memory_bytes())
    device = platform.device()
    tokenizer = build_tokenizer(config.tokenizer)
    check_tokenizer_fits(config, tokenizer)
    total = config.training.train_iters
    phases = resolve_phases(config.phases, total)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    data_cfg = config.data

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    model = build_encoder_model(config.model, pre_process=pp_rank == 0, post_process=pp_rank == pp_size - 1,
                                transformer_overrides=megatron_transformer_overrides(config)).to(device)
    engine = build_engine(engine_name, model, config)
    model = engine.checkpoint_model
    cc = config.checkpoint
    state, result_checkpoint = _restore(engine, config, tokenizer)
    platform.set_rng_state(state)
    start = int(state.get("step", 0))
    if start > total:
        raise UserError(f"the checkpoint is at step {start}, beyond training.train_iters={total}")
    if start == total:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"nothing to do: {result_checkpoint} already completed all {total} steps", flush=True)
        return TrainResult(start_step=start, final_step=start, checkpoint=result_checkpoint,
                           skipped_steps=int(state.get("skipped_steps", 0)))

    evaluating = bool(config.training.eval_interval and data_cfg.eval_iters)
    train_ds, valid_ds = data_lib.build_datasets(
        data_cfg, tokenizer=tokenizer, train_samples=total * data_cfg.global_batch_size,
        valid_samples=data_cfg.eval_iters * data_cfg.global_batch_size if evaluating else 0,
        seed=config.training.seed,
    )
    train_iter: Iterator = data_lib.build_train_iterator(
        train_ds, config=data_cfg, dp_rank=dp_rank, dp_size=dp_size, consumed_samples=start * data_cfg.global_batch_size,
    )  # checks that micro-batch x data-parallel size divides the global batch
    micro_per_step = data_cfg.global_batch_size // (data_cfg.micro_batch_size * dp_size)
    valid_batches = []
    if evaluating:  # the same fixed batches at every evaluation, kept on the device
        valid_batches = [_to_device(b, device) for b in data_lib.build_valid_iterator(
            valid_ds, config=data_cfg, dp_rank=dp_rank, dp_size=dp_size)]

    # The resolved engine is recorded: its optimizer state is what the checkpoint holds.
    saved_config = dataclasses.replace(config, training=dataclasses.replace(config.training, engine=engine.name)).to_dict()
    log = StepLogger(config, total_steps=total, start_step=start, wandb_run_id=state.get("wandb_run_id"))
    if log.is_writer:
        print(f"training {total} steps from step {start}: " + ", ".join(
            f"{_phase_name(p)} [{p.start}, {p.end})" for p in phases) + f"; MFU convention: {MFU_CONVENTION}", flush=True)
        print(f"engine: {engine.name}; " + platform.accelerator_summary(), flush=True)
    result = TrainResult(start_step=start, final_step=start, checkpoint=result_checkpoint)
    nonfinite = int(state.get("nonfinite_in_a_row", 0))
    skipped_total = int(state.get("skipped_steps", 0))
    saver = ckpt.CheckpointSaver(async_save=cc.async_save)
    tokenizer_reference = {**tokenizer.reference(), ckpt.TOKENIZER_FINGERPRINT: tokenizer.fingerprint()}
    model.train()
    try:
        for step in range(start, total):
            phase = phase_at(phases, step)
            lr = lr_at(step, config=config.schedule, total_steps=total, phases=phases)
            micro_batches = [_micro_batch(next(train_iter), step, phase, micro * dp_size + dp_rank, config=config,
                                          tokenizer=tokenizer, device=device) for micro in range(micro_per_step)]
            outcome = engine.train_step(micro_batches, lr)
            saver.poll()  # publishes asynchronous saves that every rank has finished
            loss, grad_norm, skipped = outcome.loss, outcome.grad_norm, outcome.skipped
            if skipped:
                nonfinite += 1
                skipped_total += 1
                if nonfinite >= config.training.max_nonfinite_steps:
                    raise NonFiniteLossError(
                        f"step {step + 1}: loss {loss} / grad norm {grad_norm} non-finite for {nonfinite} "
                        f"consecutive steps (training.max_nonfinite_steps={config.training.max_nonfinite_steps}); "
                        "lower the learning rate, check the data, or resume from an earlier checkpoint"
                    )
            else:
                nonfinite = 0
            done = step + 1
            result.final_step = done
            result.losses[done] = loss
            log.step(done, phase, loss, lr, grad_norm, skipped)
            if config.training.eval_interval and valid_batches and (done % config.training.eval_interval == 0 or done == total):
                result.valid[done] = evaluate(engine, valid_batches, config=config, tokenizer=tokenizer)
                log.record("valid", done, result.valid[done])
                if log.is_writer:
                    print(f"validation at step {done}: clm loss {result.valid[done]['clm']:.4f} | "
                          f"mlm-{round(100 * config.training.eval_mask_ratio)} loss {result.valid[done]['mlm']:.4f}", flush=True)
            exiting = exit_after_step is not None and done >= exit_after_step
            if cc.save and (done % cc.save_interval == 0 or done == total or exiting):
                with engine.checkpointing():
                    path = saver.save(
                        cc.save, step=done, model=model, optimizer=engine.optimizer_state,
                        trainer_state=_trainer_state(done, config, nonfinite, skipped_total, log.wandb_run_id),
                        run_config=saved_config, tokenizer_reference=tokenizer_reference, keep_last=cc.keep_last,
                    )
                result.checkpoint = str(path)
                if log.is_writer:
                    print(f"{'writing checkpoint in the background' if saver.in_flight else 'saved checkpoint'} "
                          f"{path}", flush=True)
            if exiting:
                break
        saver.wait()  # the last checkpoint is complete when the run returns
    finally:
        log.close()
    result.skipped_steps = skipped_total
    return result
