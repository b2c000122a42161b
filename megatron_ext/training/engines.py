"""How one optimizer step runs: the portable engine (CPU and GPU) and the Megatron-Core engine (GPU).

Both take a step's micro-batches (already turned into :class:`ObjectiveBatch` es by the loop) and
return the global per-token mean loss, the gradient norm and whether the update was skipped; both
evaluate the same way. The loop owns everything else (phases, LR, data order, masks, logging,
checkpoints), so a run's arithmetic is the same under either engine up to reduction order.

``portable`` is this project's own step: every micro-batch's token-loss SUM is back-propagated,
gradients are all-reduced flat over data parallelism and divided by the global token count, the
norm is clipped tensor-parallel-aware, torch AdamW steps (``optim.py``). It runs everywhere.

``megatron`` is Megatron-LM's step: the model wrapped in ``megatron.core.distributed.
DistributedDataParallel`` (contiguous fp32 gradient buffers, bucketed and optionally overlapped
reduce-scatter/all-reduce), ``get_megatron_optimizer`` (Adam with Megatron's parameter groups:
no weight decay on 1-D parameters, as the portable engine; optionally the distributed optimizer),
``get_forward_backward_func`` (no-pipelining or 1F1B pipeline schedule) with
``calculate_per_token_loss`` so ``finalize_model_grads`` divides by the global token count as the
portable engine does. Those pieces allocate CUDA buffers (DESIGN.md section 3): GPU only.

Mixed precision is the same in both: fp32 parameters, bf16 autocast of the forward, fp32 loss
and gradients; FP8 (Transformer Engine) comes from the model's ``TransformerConfig``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext import platform
from megatron_ext.objectives import ObjectiveBatch
from megatron_ext.training.config import OptimizerConfig, RunConfig
from megatron_ext.training.optim import build_optimizer, grad_norm_and_clip, reduce_gradients, set_lr


@dataclass(frozen=True)
class MicroBatch:
    """What one forward pass reads."""

    objective: ObjectiveBatch
    position_ids: torch.Tensor | None


@dataclass(frozen=True)
class StepOutcome:
    loss: float
    """Global per-token mean loss of the step (NaN if non-finite)."""
    grad_norm: float
    """Gradient L2 norm before clipping (NaN when the step was skipped before computing it)."""
    skipped: bool
    """True when the loss or the gradient norm was non-finite: parameters were not updated."""


def per_token_loss(model: torch.nn.Module, micro: MicroBatch, *, bf16: bool, lm_head_scored_only: bool) -> torch.Tensor:
    """Per-token cross-entropy ``[b, s]`` (fp32 compute in the model's loss; bf16 autocast forward).

    ``lm_head_scored_only``: the LM head runs at the loss mask's positions only (0 elsewhere).
    """
    batch = micro.objective
    labels = batch.labels.clamp(min=0)  # IGNORE_INDEX positions are zeroed by the loss mask
    with torch.autocast(platform.device().type, dtype=torch.bfloat16, enabled=bf16):
        return model(batch.input_ids, causal=batch.causal, position_ids=micro.position_ids, labels=labels,
                     loss_mask=batch.loss_mask if lm_head_scored_only else None)


def masked_loss_sum(per_token: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the scored tokens' losses (fp32) and their count (a tensor, for Megatron's schedules)."""
    loss_mask = micro.objective.loss_mask.to(torch.float32)
    return (per_token.float() * loss_mask).sum(), loss_mask.sum().to(torch.int)


class PortableEngine:
    """This project's step (module docstring); any device, any backend."""

    name = "portable"

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerConfig, *, bf16: bool, lm_head_scored_only: bool):
        self.model = model
        self.bf16 = bf16
        self.lm_head_scored_only = lm_head_scored_only
        self.clip_grad = optimizer.clip_grad
        self.optimizer = build_optimizer(model, optimizer, lr=0.0)

    @property
    def checkpoint_model(self) -> torch.nn.Module:
        return self.model

    def _loss_sum(self, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        per_token = per_token_loss(self.model, micro, bf16=self.bf16, lm_head_scored_only=self.lm_head_scored_only)
        return masked_loss_sum(per_token, micro)

    def train_step(self, micro_batches: Sequence[MicroBatch], lr: float) -> StepOutcome:
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        local_tokens, local_loss = 0, 0.0
        for micro in micro_batches:
            loss_sum, n = self._loss_sum(micro)
            loss_sum.backward()
            local_tokens += int(n)
            local_loss += float(loss_sum.item())
        _, loss = reduce_gradients(self.model, local_tokens, local_loss)
        grad_norm = grad_norm_and_clip(self.model, self.clip_grad) if math.isfinite(loss) else math.nan
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        return StepOutcome(loss=loss, grad_norm=grad_norm, skipped=skipped)

    @torch.no_grad()
    def eval_loss(self, micro_batches: Sequence[MicroBatch]) -> tuple[float, float]:
        """(sum of token losses, token count) over the data-parallel group."""
        totals = torch.zeros(2, dtype=torch.float64, device=platform.device())
        for micro in micro_batches:
            loss_sum, n = self._loss_sum(micro)
            totals += torch.stack([loss_sum.double(), n.double()])
        if dist.is_initialized():
            dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        return float(totals[0]), float(totals[1])

    def before_checkpoint(self) -> None:
        pass

    def after_checkpoint(self) -> None:
        pass


def megatron_transformer_overrides(config: RunConfig) -> dict:
    """``TransformerConfig`` fields the run sets on top of the model's architecture (both engines
    build the model; only the Megatron engine's schedules read ``calculate_per_token_loss``)."""
    t = config.training
    overrides: dict = {"calculate_per_token_loss": True}
    if t.fp8_recipe is not None:
        overrides.update(fp8=t.fp8_format, fp8_recipe=t.fp8_recipe)
    if t.recompute_granularity is not None:
        overrides["recompute_granularity"] = t.recompute_granularity
        if t.recompute_granularity == "full":
            overrides.update(recompute_method="uniform", recompute_num_layers=t.recompute_num_layers)
    return overrides


class MegatronEngine:
    """Megatron-Core's DDP, optimizer and forward-backward schedules (module docstring); CUDA only."""

    name = "megatron"

    def __init__(self, model: torch.nn.Module, config: RunConfig):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not platform.on_gpu():
            raise ValueError("training.engine: megatron needs CUDA (Megatron-Core's DDP and optimizer allocate CUDA "
                             "buffers); use training.engine: portable or auto")
        self.config = config
        p = config.parallel
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather, use_distributed_optimizer=p.use_distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        transformer_config = model.config
        self.ddp = DistributedDataParallel(config=transformer_config, ddp_config=ddp_config, module=model)
        o = config.optimizer
        self.optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam", lr=0.0, min_lr=0.0, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=False,
                params_dtype=torch.float32, use_distributed_optimizer=p.use_distributed_optimizer,
                overlap_param_gather=p.overlap_param_gather,
            ),
            [self.ddp],
        )
        # What Megatron-LM's training loop wires into the model config for its schedules.
        transformer_config.finalize_model_grads_func = finalize_model_grads
        transformer_config.no_sync_func = self.ddp.no_sync
        if p.overlap_grad_reduce:
            transformer_config.grad_sync_func = self.ddp.start_grad_sync
        if p.overlap_param_gather:
            transformer_config.param_sync_func = self.ddp.start_param_sync
        self.forward_backward = get_forward_backward_func()
        self.model = self.ddp

    @property
    def checkpoint_model(self) -> torch.nn.Module:
        return self.ddp.module

    def _forward_step(self, data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
        micro = next(data_iterator)
        t = self.config.training
        output = per_token_loss(model, micro, bf16=t.bf16, lm_head_scored_only=t.lm_head_scored_only)

        def loss_func(per_token: torch.Tensor):
            loss_sum, n = masked_loss_sum(per_token, micro)
            return loss_sum, n, {"loss": torch.stack([loss_sum.detach(), n.detach().float()])}

        return output, loss_func

    def _run(self, micro_batches: Sequence[MicroBatch], *, forward_only: bool) -> tuple[float, float]:
        d = self.config.data
        reported = self.forward_backward(
            forward_step_func=self._forward_step, data_iterator=iter(micro_batches), model=[self.ddp],
            num_microbatches=len(micro_batches), seq_length=d.seq_length, micro_batch_size=d.micro_batch_size,
            forward_only=forward_only,
        )
        totals = torch.zeros(2, dtype=torch.float64, device=platform.device())
        for item in reported or []:  # only the last pipeline stage reports losses
            totals += item["loss"].double()
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # share with the other stages
            dist.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
        return float(totals[0]), float(totals[1])

    def train_step(self, micro_batches: Sequence[MicroBatch], lr: float) -> StepOutcome:
        set_lr(self.optimizer, lr)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_sum, tokens = self._run(micro_batches, forward_only=False)
        loss = loss_sum / tokens if tokens > 0 else math.nan
        if not (math.isfinite(loss) and self._gradients_finite()):
            self.ddp.zero_grad_buffer()
            return StepOutcome(loss=loss, grad_norm=math.nan, skipped=True)
        _, grad_norm, _ = self.optimizer.step()  # clips to optimizer.clip_grad, then updates
        grad_norm = math.nan if grad_norm is None else float(grad_norm)
        return StepOutcome(loss=loss, grad_norm=grad_norm, skipped=not math.isfinite(grad_norm))

    @torch.no_grad()
    def _gradients_finite(self) -> bool:
        """Whether the gradients of every rank are finite. Checked before the update because
        Megatron's fp32 and distributed optimizers step whatever the gradient norm is (only fp16
        loss scaling skips), which would turn a non-finite gradient into NaN parameters. A NaN
        or inf anywhere makes its buffer's sum non-finite, and the sum all-reduced over the
        world (TP, PP and DP ranks) too: one pass over the buffers and one host sync."""
        buffers = self.ddp.buffers + self.ddp.expert_parallel_buffers
        total = torch.stack([b.grad_data.sum(dtype=torch.float32) for b in buffers]).sum()
        dist.all_reduce(total)
        return math.isfinite(float(total))

    @torch.no_grad()
    def eval_loss(self, micro_batches: Sequence[MicroBatch]) -> tuple[float, float]:
        return self._run(micro_batches, forward_only=True)

    # Overlapped parameter all-gathers run from forward pre-hooks; Megatron-LM turns them off
    # around checkpointing so the saved parameters are the gathered ones.
    def before_checkpoint(self) -> None:
        if self.config.parallel.overlap_param_gather:
            self.ddp.disable_forward_pre_hook()

    def after_checkpoint(self) -> None:
        if self.config.parallel.overlap_param_gather:
            self.ddp.enable_forward_pre_hook()


def build_engine(name: str, model: torch.nn.Module, config: RunConfig) -> PortableEngine | MegatronEngine:
    """The engine ``name`` (resolved: ``portable`` or ``megatron``) around ``model``."""
    if name == "portable":
        return PortableEngine(model, config.optimizer, bf16=config.training.bf16,
                              lm_head_scored_only=config.training.lm_head_scored_only)
    if name == "megatron":
        return MegatronEngine(model, config)
    raise ValueError(f"unknown engine {name!r}; expected 'portable' or 'megatron'")
