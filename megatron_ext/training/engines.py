"""How one optimizer step runs: the portable engine and the Megatron-Core engine, both on CPU and GPU.

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
portable engine does. Those pieces assume CUDA; on CPU they run over gloo with Megatron's
CUDA-only calls redirected (``platform``, divergence 7, on from
``platform.init_process_group_and_model_parallel``), so a parallel layout can be debugged on a
laptop with the code a cluster runs.

Both satisfy :class:`Engine`, the contract the loop and the checkpoints use.

Mixed precision is the same in both: fp32 parameters, bf16 autocast of the forward, fp32 loss
and gradients; FP8 (Transformer Engine) comes from the model's ``TransformerConfig``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext import platform
from megatron_ext.objectives import ObjectiveBatch
from megatron_ext.checkpoint.core import OptimizerCheckpointState, SavedOptimizerState
from megatron_ext.training.config import OptimizerConfig, RunConfig
from megatron_ext.training.optim import (
    TorchOptimizerState,
    build_optimizer,
    grad_norm_and_clip,
    reduce_gradients,
    set_fused_adam,
    set_lr_and_weight_decay,
    weight_decay_for,
)


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


class Engine(Protocol):
    """What the loop and the checkpoints need of a training engine."""

    name: Literal["portable", "megatron"]
    model: torch.nn.Module
    """The module that runs forward (``train()``/``eval()`` are set on it)."""
    checkpoint_model: torch.nn.Module
    """The bare model whose ``sharded_state_dict`` is saved and loaded."""
    optimizer_state: OptimizerCheckpointState
    """The optimizer's state as the checkpoint writes and reads it."""

    def train_step(self, micro_batches: Sequence[MicroBatch], lr: float) -> StepOutcome:
        """One optimizer step over this rank's micro-batches (skipped when non-finite)."""

    def eval_loss(self, micro_batches: Sequence[MicroBatch]) -> tuple[float, float]:
        """(sum of token losses, token count) over the data-parallel group, no update."""

    def weights_loaded(self) -> None:
        """The model's weights were replaced without the optimizer's state (continued pretraining):
        copies the optimizer keeps of them (fp32 main parameters) are refreshed."""

    def checkpointing(self) -> contextlib.AbstractContextManager:
        """Context around a checkpoint save or load."""


def per_token_loss(model: torch.nn.Module, micro: MicroBatch, *, bf16: bool, lm_head_scored_only: bool) -> torch.Tensor:
    """Per-token cross-entropy ``[b, s]`` (fp32 compute in the model's loss; bf16 autocast forward).

    ``lm_head_scored_only``: the LM head runs at the loss mask's positions only (0 elsewhere).
    """
    batch = micro.objective
    labels = batch.labels.clamp(min=0)  # IGNORE_INDEX positions are zeroed by the loss mask
    with torch.autocast(platform.device().type, dtype=torch.bfloat16, enabled=bf16):
        return model(batch.input_ids, causal=batch.causal, position_ids=micro.position_ids, labels=labels,
                     loss_mask=batch.loss_mask if lm_head_scored_only else None,
                     max_scored_per_sequence=batch.max_scored_per_sequence)


def masked_loss_sum(per_token: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the scored tokens' losses (fp32) and their count (a tensor, for Megatron's schedules)."""
    loss_mask = micro.objective.loss_mask.to(torch.float32)
    return (per_token.float() * loss_mask).sum(), loss_mask.sum().to(torch.int)


class PortableEngine:
    """This project's step (module docstring); any device, any backend."""

    name = "portable"

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerConfig, *, bf16: bool, lm_head_scored_only: bool):
        self.model = self.checkpoint_model = model
        self.bf16 = bf16
        self.lm_head_scored_only = lm_head_scored_only
        self.optimizer_config = optimizer
        self.clip_grad = optimizer.clip_grad
        self.optimizer = build_optimizer(model, optimizer, lr=0.0)
        self.optimizer_state = TorchOptimizerState(self.optimizer)

    def _loss_sum(self, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        per_token = per_token_loss(self.model, micro, bf16=self.bf16, lm_head_scored_only=self.lm_head_scored_only)
        return masked_loss_sum(per_token, micro)

    def train_step(self, micro_batches: Sequence[MicroBatch], lr: float) -> StepOutcome:
        set_lr_and_weight_decay(self.optimizer, self.optimizer_config, lr)
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

    def checkpointing(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def weights_loaded(self) -> None:
        """The optimizer updates the model's own (fp32) parameters: nothing to refresh."""


def megatron_transformer_overrides(config: RunConfig) -> dict:
    """``TransformerConfig`` fields the run sets on top of the model's architecture (both engines
    build the model; only the Megatron engine's schedules read ``calculate_per_token_loss``)."""
    t = config.training
    overrides: dict = {"calculate_per_token_loss": True}
    if t.bias_activation_fusion:
        overrides["bias_activation_fusion"] = True
    if t.cross_entropy_loss_fusion:
        overrides.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
    if t.fp8_recipe is not None:
        overrides.update(fp8=t.fp8_format, fp8_recipe=t.fp8_recipe)
    if t.recompute_granularity is not None:
        overrides["recompute_granularity"] = t.recompute_granularity
        if t.recompute_granularity == "full":
            overrides.update(recompute_method="uniform", recompute_num_layers=t.recompute_num_layers)
    return overrides


class MegatronOptimizerState:
    """A Megatron optimizer's checkpoint state, with the sharding metadata Megatron-LM passes.

    The distributed optimizer's state is written in ``sharding_type`` (``dp_reshardable``:
    per-rank buffers, no communication, resumable at another data-parallel size;
    ``fully_reshardable``: gathered to the canonical per-parameter form, resumable at any
    layout). The format is recorded in the checkpoint and read back from it on load.
    """

    def __init__(self, optimizer, *, distributed: bool, sharding_type: str, torch_adam_fused: bool | None):
        self.optimizer = optimizer
        self.distributed = distributed
        self.sharding_type = sharding_type
        self.torch_adam_fused = torch_adam_fused
        """``optimizer.fused`` where Megatron built torch's AdamW; None with TE/apex's FusedAdam."""

    def set_kernel(self) -> None:
        """Torch's AdamW kernel as ``optimizer.fused`` says; again after each load, which brings
        back the saved parameter groups' flags."""
        if self.torch_adam_fused is not None:
            for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                set_fused_adam(part.optimizer, self.torch_adam_fused)

    def format(self) -> dict:
        recorded = {"optimizer": "megatron", "distributed_optimizer": self.distributed,
                    **_layout(), "chained_optim_avoid_prefix": True, "singleton_local_shards": False}
        if self.distributed:
            recorded["distrib_optim_sharding_type"] = self.sharding_type
        return recorded

    def sharded_state_dict(self, model_state: dict, *, saved: SavedOptimizerState | None = None) -> dict:
        # Megatron's own metadata keys are what the optimizer reads; ours are ignored by it.
        metadata = self.format() if saved is None else saved.format
        if saved is not None:
            self._allocate_state()
        return self.optimizer.sharded_state_dict(model_state, is_loading=saved is not None, metadata=metadata)

    def _allocate_state(self) -> None:
        """Give a fresh distributed optimizer its state tensors before a load. With torch's Adam
        (no TE/apex), megatron-core 0.19.2's ``DistributedOptimizer.state_dict`` reads the step
        from the per-parameter state, which a fresh optimizer lacks (an assertion in
        ``DistributedOptimizer.state_dict``); Megatron's own dummy initialisation (a zero-gradient step
        at the current LR, 0 before training) allocates it without moving any parameter."""
        for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if not part.optimizer.state and hasattr(part, "_init_optimizer_states_with_dummy_values"):
                lrs = [group["lr"] for group in part.optimizer.param_groups]
                for group in part.optimizer.param_groups:
                    group["lr"] = 0.0
                part._init_optimizer_states_with_dummy_values()
                for group, lr in zip(part.optimizer.param_groups, lrs):
                    group["lr"] = lr

    def load_state_dict(self, loaded: dict) -> None:
        # no_grad: with fp32 parameters the distributed optimizer's main parameters are views of
        # the model's, which require grad; the load copies into them.
        with torch.no_grad(), _torch_adam_step_kept():
            self.optimizer.load_state_dict(loaded)
        parts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        saved_parts = [loaded] if len(parts) == 1 else [loaded[i] for i in range(len(parts))]
        for part, saved in zip(parts, saved_parts):
            # With torch's Adam (no TE/apex) the step lives per parameter; megatron-core 0.19.2
            # stores it once per group and, for the distributed optimizer, does not bring it back
            # into a state allocated before the load (the per-parameter steps stay as allocated),
            # or shares one tensor between all parameters, which torch's Adam increments in place
            # once per parameter. Each parameter gets its own copy of the saved step.
            groups = saved.get("optimizer", saved).get("param_groups", [])
            steps = {float(group["step"]) for group in groups if "step" in group}
            if len(steps) != 1:
                continue
            step = steps.pop()
            for param_state in part.optimizer.state.values():
                if torch.is_tensor(param_state.get("step")):
                    param_state["step"] = torch.tensor(step, dtype=param_state["step"].dtype,
                                                       device=param_state["step"].device)
        self.set_kernel()


def _megatron_uses_torch_adam() -> bool:
    """Whether Megatron-Core fell back to torch's AdamW (neither Transformer Engine nor apex)."""
    from megatron.core import optimizer

    return optimizer.USING_PYTORCH_OPTIMIZER


@contextlib.contextmanager
def _torch_adam_step_kept() -> Iterator[None]:
    """During a distributed-optimizer load with torch's Adam (no TE/apex): megatron-core 0.19.2's
    ``_set_main_param_and_optimizer_states`` copies every tensor of a parameter's optimizer state
    from the checkpoint, torch's per-parameter ``step`` included, which the ``fully_reshardable``
    format does not hold (``KeyError: 'step'``). The step is restored
    from the common state just before; here it is kept as it is."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        yield
        return
    original = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

    def keep_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = keep_step
    try:
        yield
    finally:
        distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = original


def _layout() -> dict:
    return {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": parallel_state.get_data_parallel_world_size()}


class MegatronEngine:
    """Megatron-Core's DDP, optimizer and forward-backward schedules (module docstring)."""

    name = "megatron"

    def __init__(self, model: torch.nn.Module, config: RunConfig):
        platform.check_megatron_runs_here("the Megatron engine")
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.module import Float16Module

        self.config = config
        p = config.parallel
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather, use_distributed_optimizer=p.use_distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        transformer_config = model.config
        o = config.optimizer
        # bf16 parameters (model.params_dtype): Megatron-LM's mixed precision. Float16Module runs
        # the model in bf16 (its fp32 outputs: the per-token loss, computed in fp32 inside the
        # model); the optimizer keeps fp32 main parameters; gradients reduce into fp32 buffers.
        low_precision = transformer_config.bf16  # float16 is refused with the run config
        wrapped = Float16Module(transformer_config, model) if low_precision else model
        self.ddp = DistributedDataParallel(config=transformer_config, ddp_config=ddp_config, module=wrapped)
        self.optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam", lr=0.0, min_lr=0.0, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=low_precision,
                params_dtype=transformer_config.params_dtype, use_distributed_optimizer=p.use_distributed_optimizer,
                overlap_param_gather=p.overlap_param_gather,
            ),
            [self.ddp],
        )
        self.optimizer_state = MegatronOptimizerState(
            self.optimizer, distributed=p.use_distributed_optimizer, sharding_type=config.checkpoint.optimizer_format,
            torch_adam_fused=o.fused if _megatron_uses_torch_adam() else None)
        self.optimizer_state.set_kernel()
        # What Megatron-LM's training loop wires into the model config for its schedules.
        transformer_config.finalize_model_grads_func = finalize_model_grads
        transformer_config.no_sync_func = self.ddp.no_sync
        if p.overlap_grad_reduce:
            transformer_config.grad_sync_func = self.ddp.start_grad_sync
        if p.overlap_param_gather:
            transformer_config.param_sync_func = self.ddp.start_param_sync
        self.forward_backward = get_forward_backward_func()
        self.model = self.ddp
        self.checkpoint_model = model  # Float16Module delegates its (sharded) state dict to it

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
        self._set_lr(lr)
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

    def _set_lr(self, lr: float) -> None:
        """What Megatron's ``OptimizerParamScheduler.step`` does to each parameter group: the
        group's LR multiplier applied. ``get_megatron_optimizer`` builds every group with the full
        weight decay and groups the 1-D parameters (norm weights, biases) apart with ``wd_mult =
        0``, which marks them here (with the distributed optimizer a group's parameters are flat
        shards, so their shapes say nothing); the weight decay is the portable engine's rule
        (``weight_decay_for``: Megatron's unless ``optimizer.decay_norms_and_biases``)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = weight_decay_for(self.config.optimizer,
                                                     one_dimensional=group.get("wd_mult", 1.0) == 0.0)

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

    def weights_loaded(self) -> None:
        """Megatron-LM's ``reload_model_params``: fp32 main parameters (bf16 models, distributed
        optimizer) are copied again from the model, else the first step would write the
        optimizer's stale copies (the random initialisation) over the loaded weights."""
        self.optimizer.reload_model_params()

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        # Overlapped parameter all-gathers run from forward pre-hooks; Megatron-LM turns them off
        # around checkpointing so the saved parameters are the gathered ones.
        gathering = self.config.parallel.overlap_param_gather
        if gathering:
            self.ddp.disable_forward_pre_hook()
        try:
            yield
        finally:
            if gathering:
                self.ddp.enable_forward_pre_hook()


def build_engine(name: str, model: torch.nn.Module, config: RunConfig) -> Engine:
    """The engine ``name`` (resolved: ``portable`` or ``megatron``) around ``model``."""
    if name == "portable":
        return PortableEngine(model, config.optimizer, bf16=config.training.bf16,
                              lm_head_scored_only=config.training.lm_head_scored_only)
    if name == "megatron":
        return MegatronEngine(model, config)
    raise ValueError(f"unknown engine {name!r}; expected 'portable' or 'megatron'")
