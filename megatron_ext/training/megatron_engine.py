"""How one optimizer step runs: Megatron-Core's engine, on CPU and GPU.

The loop hands :class:`MegatronEngine` a step's micro-batches (already turned into
:class:`ObjectiveBatch` es) and gets back the global per-token mean loss, the gradient norm and
whether the update was skipped; the engine evaluates the same way. The loop owns everything else
(phases, LR, data order, masks, logging, checkpoints).

The step is Megatron-LM's: the model wrapped in ``megatron.core.distributed.
DistributedDataParallel`` (contiguous fp32 gradient buffers, bucketed and optionally overlapped
reduce-scatter/all-reduce), ``get_megatron_optimizer`` (Adam with Megatron's parameter groups:
no weight decay on 1-D parameters unless ``optimizer.decay_norms_and_biases``; optionally the
distributed optimizer), ``get_forward_backward_func`` (no-pipelining or 1F1B pipeline schedule)
with ``calculate_per_token_loss``, so ``finalize_model_grads`` divides the summed gradients by
the global token count (Megatron-LM's ``--calculate-per-token-loss``): every rank
back-propagates the SUM of its token losses, and the update does not depend on how the global
batch is split into micro-batches or ranks. Those pieces assume CUDA; on CPU they run over gloo
with Megatron's CUDA-only calls redirected (``cuda_on_cpu``, on from
``process_group.init_process_group_and_model_parallel``), so a parallel layout can be debugged on a
laptop with the code a cluster runs.

Mixed precision: bf16 autocast of the forward (``training.bf16``), optionally bf16 parameters
with fp32 main parameters (``model.params_dtype: bfloat16``, Megatron's ``Float16Module``), fp32
loss and gradient buffers; FP8 (Transformer Engine) comes from the model's ``TransformerConfig``.

CUDA graphs of the transformer layers (``training.cuda_graphs: megatron``): Megatron-Core's
``CudaGraphManager`` in every layer; the engine primes and captures them on its first training
step, runs validation eagerly and deletes them in ``close`` (``training.cuda_graphs``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext import hardware
from megatron_ext.megatron_compat import cuda_on_cpu
from megatron_ext.model.attention import attention_pattern
from megatron_ext.checkpoint.resume import TrainingState
from megatron_ext.objectives import ObjectiveBatch
from megatron_ext.training import cuda_graphs
from megatron_ext.training.config import RunConfig
from megatron_ext.training.optim import MegatronOptimizerState, megatron_uses_torch_adam, weight_decay_for


@dataclass(frozen=True)
class MicroBatch:
    """What one forward pass reads: the objective's inputs and targets (with the isolated documents,
    ``ObjectiveBatch.document_ends``), the positions and the RoPE base."""

    objective: ObjectiveBatch
    position_ids: torch.Tensor | None
    """``[b, s]`` RoPE positions (``data.reset_position_ids``); None: ``0..s-1`` in every row."""
    rotary_base: float | None = None
    """RoPE theta of the step's phase (``training.context.PhaseContext.rotary_base``, which the
    trainer always passes); None: the architecture's ``model.rotary_base``."""
    sources: torch.Tensor | None = None
    """``[b]`` each row's source (its position in the blend, Megatron's ``dataset_id``): an
    evaluation adds up its losses per source (:meth:`MegatronEngine.eval_loss_by_source`)."""


@dataclass(frozen=True)
class StepOutcome:
    loss: float
    """Global per-token mean loss of the step (NaN if non-finite)."""
    grad_norm: float
    """Gradient L2 norm before clipping (NaN when the step was skipped before computing it)."""
    skipped: bool
    """True when the loss or the gradient norm was non-finite: parameters were not updated."""
    scored_tokens: float
    """Tokens the loss scored in the step, over every rank (0: the loss is 0/0, NaN)."""


def per_token_loss(model: torch.nn.Module, micro: MicroBatch, *, bf16: bool, lm_head_scored_only: bool) -> torch.Tensor:
    """Per-token cross-entropy ``[b, s]`` (fp32 compute in the model's loss; bf16 autocast forward).

    ``lm_head_scored_only``: the LM head runs at the loss mask's positions only (0 elsewhere).
    """
    batch = micro.objective
    labels = batch.labels.clamp(min=0)  # IGNORE_INDEX positions are zeroed by the loss mask
    with torch.autocast(hardware.device().type, dtype=torch.bfloat16, enabled=bf16):
        return model(batch.input_ids, packed_seq_params=attention_pattern(causal=batch.causal,
                                                                          document_ends=batch.document_ends),
                     rotary_base=micro.rotary_base, position_ids=micro.position_ids, labels=labels,
                     loss_mask=batch.loss_mask if lm_head_scored_only else None,
                     max_scored_per_sequence=batch.max_scored_per_sequence)


def masked_loss_sum(per_token: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the scored tokens' losses (fp32) and their count (a tensor, for Megatron's schedules)."""
    loss_mask = micro.objective.loss_mask.to(torch.float32)
    return (per_token.float() * loss_mask).sum(), loss_mask.sum().to(torch.int)


def megatron_transformer_overrides(config: RunConfig) -> dict:
    """``TransformerConfig`` fields the run sets on top of the model's architecture (the engine's
    schedules read ``calculate_per_token_loss``)."""
    t = config.training
    overrides: dict = {"calculate_per_token_loss": True}
    if t.bias_activation_fusion:
        overrides["bias_activation_fusion"] = True
    if t.cross_entropy_loss_fusion:
        overrides.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl=t.cross_entropy_fusion_impl)
    if t.rope_fusion:
        overrides["apply_rope_fusion"] = True
    if t.gradient_accumulation_fusion:
        overrides["gradient_accumulation_fusion"] = True
    if t.fp8_recipe is not None:
        overrides.update(fp8=t.fp8_format, fp8_recipe=t.fp8_recipe)
    if t.deterministic:  # Megatron's deterministic code paths (e.g. the embedding's backward)
        overrides["deterministic_mode"] = True
    if t.recompute_granularity is not None:
        overrides["recompute_granularity"] = t.recompute_granularity
        if t.recompute_granularity == "full":
            overrides.update(recompute_method="uniform", recompute_num_layers=t.recompute_num_layers)
    overrides.update(cuda_graphs.transformer_overrides(config))
    return overrides


class MegatronEngine(TrainingState):
    """Megatron-Core's DDP, optimizer and forward-backward schedules (module docstring); what the
    checkpoints save and load is its :class:`~megatron_ext.checkpoint.resume.TrainingState`."""

    def __init__(self, model: torch.nn.Module, config: RunConfig):
        cuda_on_cpu.check_megatron_runs_here("the Megatron engine")
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
            torch_adam_fused=o.fused if megatron_uses_torch_adam() else None)
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
        """The module that runs forward (``train()``/``eval()`` are set on it)."""
        self.checkpoint_model = model  # Float16Module delegates its (sharded) state dict to it
        self.graphs: cuda_graphs.LayerGraphs | None = None
        """The layer graphs (``training.cuda_graphs``), captured on the first training step."""
        if cuda_graphs.enabled(config):
            if transformer_config.cuda_graph_impl != cuda_graphs.LOCAL:
                raise RuntimeError(f"training.cuda_graphs={config.training.cuda_graphs!r} but the model was built with "
                                   f"cuda_graph_impl={transformer_config.cuda_graph_impl!r}: pass "
                                   "megatron_transformer_overrides(config) to build_encoder_model")
            self.graphs = cuda_graphs.LayerGraphs(self.ddp, patterns=cuda_graphs.attention_patterns(config),
                                                  bf16_autocast=config.training.bf16)

    def _forward_step(self, data_iterator: Iterator[MicroBatch], model: torch.nn.Module, *, sources: int = 0):
        """Megatron's forward step: the micro-batch's per-token loss, and its reduction; with
        ``sources``, also each source's ``(loss sum, tokens)`` by the rows' ``MicroBatch.sources``."""
        micro = next(data_iterator)
        t = self.config.training
        output = per_token_loss(model, micro, bf16=t.bf16, lm_head_scored_only=t.lm_head_scored_only)

        def loss_func(per_token: torch.Tensor):
            loss_sum, n = masked_loss_sum(per_token, micro)
            reported = {"loss": torch.stack([loss_sum.detach(), n.detach().float()])}
            if sources and micro.sources is not None:  # per row, added up per source
                mask = micro.objective.loss_mask.to(torch.float32)
                rows = torch.stack([(per_token.detach().float() * mask).sum(dim=1), mask.sum(dim=1)], dim=1)
                reported["by_source"] = torch.zeros(sources, 2, device=rows.device).index_add_(
                    0, micro.sources.to(rows.device, torch.long), rows)
            return loss_sum, n, reported

        return output, loss_func

    def _run(self, micro_batches: Sequence[MicroBatch], *, forward_only: bool,
             sources: int = 0) -> tuple[float, float, list[tuple[float, float]]]:
        """(sum of token losses, token count, each of ``sources`` sources' two) over the
        data-parallel group, after the forward (and backward) passes of ``micro_batches``."""
        # The shape the pipeline's stages exchange: the batches' own (a phase may change the
        # sequence length and the micro-batch size, ``training.context``).
        d = self.config.data
        micro_batch_size, seq_length = (tuple(micro_batches[0].objective.input_ids.shape) if micro_batches
                                        else (d.micro_batch_size, d.seq_length))
        reported = self.forward_backward(
            forward_step_func=functools.partial(self._forward_step, sources=sources),
            data_iterator=iter(micro_batches), model=[self.ddp],
            num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
        totals = torch.zeros(1 + sources, 2, dtype=torch.float64, device=hardware.device())
        for item in reported or []:  # only the last pipeline stage reports losses
            totals[0] += item["loss"].double()
            if "by_source" in item:
                totals[1:] += item["by_source"].double()
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # share with the other stages
            dist.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
        return float(totals[0, 0]), float(totals[0, 1]), [(loss, tokens) for loss, tokens in totals[1:].tolist()]

    def train_step(self, micro_batches: Sequence[MicroBatch], lr: float) -> StepOutcome:
        """One optimizer step over this rank's micro-batches (skipped when non-finite)."""
        self._set_lr(lr)
        if self.graphs is not None and not self.graphs.captured:
            # Megatron captures what the schedule recorded; its gradients are discarded below.
            self.graphs.capture(lambda priming: self._run(priming, forward_only=False), micro_batches)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_sum, tokens, _ = self._run(micro_batches, forward_only=False)
        loss = loss_sum / tokens if tokens > 0 else math.nan
        if not (math.isfinite(loss) and self._gradients_finite()):
            self.ddp.zero_grad_buffer()
            return StepOutcome(loss=loss, grad_norm=math.nan, skipped=True, scored_tokens=tokens)
        _, grad_norm, _ = self.optimizer.step()  # clips to optimizer.clip_grad, then updates
        grad_norm = math.nan if grad_norm is None else float(grad_norm)
        return StepOutcome(loss=loss, grad_norm=grad_norm, skipped=not math.isfinite(grad_norm), scored_tokens=tokens)

    def _set_lr(self, lr: float) -> None:
        """What Megatron's ``OptimizerParamScheduler.step`` does to each parameter group: the
        group's LR multiplier applied. ``get_megatron_optimizer`` builds every group with the full
        weight decay and groups the 1-D parameters (norm weights, biases) apart with ``wd_mult =
        0``, which marks them here (with the distributed optimizer a group's parameters are flat
        shards, so their shapes say nothing); the weight decay is ``weight_decay_for``'s
        (Megatron's rule unless ``optimizer.decay_norms_and_biases``)."""
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
        """(sum of token losses, token count) over the data-parallel group, no update (eagerly
        with layer graphs: validation's shapes and patterns need not be the captured ones)."""
        loss_sum, tokens, _ = self.eval_loss_by_source(micro_batches, 0)
        return loss_sum, tokens

    @torch.no_grad()
    def eval_loss_by_source(self, micro_batches: Sequence[MicroBatch], sources: int
                            ) -> tuple[float, float, list[tuple[float, float]]]:
        """:meth:`eval_loss`, and in the same pass ``(sum of token losses, token count)`` of each of
        the ``sources`` sources the micro-batches' rows name (``MicroBatch.sources``), over the
        data-parallel group."""
        with self.graphs.eager() if self.graphs is not None else contextlib.nullcontext():
            return self._run(micro_batches, forward_only=True, sources=sources)

    def close(self) -> None:
        """Release what outlives a step: the layer graphs and Megatron's global graph state (the
        engine trains no more after this)."""
        if self.graphs is not None:
            self.graphs.close()

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
