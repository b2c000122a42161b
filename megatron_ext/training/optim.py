"""Optimizer, data-parallel gradient reduction and tensor-parallel-aware gradient clipping.

The loss of a step is the mean over every scored token of the global batch (all micro-batches,
all data-parallel ranks): each rank back-propagates the SUM of its token losses, gradients and
token counts are summed over the data-parallel group, and gradients are divided by the global
token count. So the update does not depend on how the global batch is split into micro-batches
or ranks (tested: data parallel 2 vs 1). Megatron-LM calls this ``--calculate-per-token-loss``.

The portable engine's step (``training.engine: portable``) and how its torch optimizer goes into
a checkpoint (``TorchOptimizerState``); the Megatron engine uses Megatron-Core's DDP and optimizer
instead, and shares only ``set_fused_adam``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_ext import platform
from megatron_ext.checkpoint.core import SavedOptimizerState
from megatron_ext.config_loading import UserError
from megatron_ext.training.config import OptimizerConfig


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig, *, lr: float) -> torch.optim.AdamW:
    """AdamW over two groups, matrices and 1-D parameters (norm weights, biases); the second
    decays only with ``optimizer.decay_norms_and_biases`` (:func:`set_lr_and_weight_decay`)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay}],
        lr=lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
    )
    set_lr_and_weight_decay(optimizer, config, lr)
    set_fused_adam(optimizer, config.fused)
    return optimizer


def weight_decay_for(config: OptimizerConfig, *, one_dimensional: bool) -> float:
    """The weight decay of a parameter group: the configured one, except for a group of 1-D
    parameters (norm weights, biases) unless ``optimizer.decay_norms_and_biases``."""
    return 0.0 if one_dimensional and not config.decay_norms_and_biases else config.weight_decay


def set_fused_adam(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Switch a torch Adam/AdamW to its fused kernel or back, in place (``optimizer.fused``).

    Megatron-Core builds torch's AdamW without ``fused=True`` when neither Transformer Engine nor
    apex provides its FusedAdam: on an H100 that optimizer took 42.9 ms of a 1B step against
    15.6 ms fused on the same tensors (a multi-tensor kernel per group instead of a loop of
    elementwise ops). Torch reads the flag per group at every step; ``load_state_dict`` brings
    back the saved groups' flags, so this is applied again after each load. The per-parameter
    ``step`` lives on the parameter's device for the fused kernel, on the CPU otherwise (torch's
    placement for each)."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = (True, False) if fused else (None, None)
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(dtype=torch.float32, device=param.device if fused else "cpu")


def set_lr_and_weight_decay(optimizer: torch.optim.Optimizer, config: OptimizerConfig, lr: float) -> None:
    """The step's LR and each group's weight decay, set before every update: a loaded checkpoint
    brings back the saving run's group settings, and this run's config decides."""
    for group in optimizer.param_groups:
        group["lr"] = lr
        # Read from the parameters, not from flags saved with the group: it holds whatever
        # checkpoint the groups were loaded from.
        group["weight_decay"] = weight_decay_for(
            config, one_dimensional=all(param.dim() < 2 for param in group["params"]))


def reduce_gradients(model: torch.nn.Module, local_tokens: int, local_loss_sum: float) -> tuple[int, float]:
    """Sum gradients, token counts and loss sums over data parallelism; scale grads to the mean.

    Returns ``(global_tokens, global_mean_loss)``.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    stats = torch.tensor([float(local_tokens), local_loss_sum], dtype=torch.float64, device=platform.device())
    group = parallel_state.get_data_parallel_group()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)
        dist.all_reduce(stats, group=group)
    tokens, loss_sum = int(stats[0].item()), float(stats[1].item())
    if tokens > 0:
        for p in params:
            p.grad.div_(tokens)
    return tokens, (loss_sum / tokens if tokens > 0 else math.nan)


def grad_norm_and_clip(model: torch.nn.Module, max_norm: float) -> float:
    """Global gradient L2 norm over the whole (tensor-parallel sharded) model; clip if > max_norm.

    Tensor-parallel shards (``param.tensor_model_parallel``) are summed over the tensor-parallel
    group; replicated parameters (norms) are counted once, as Megatron's ``clip_grad_norm_fp32``
    does with ``param_is_not_tensor_parallel_duplicate``.
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    squares = torch.zeros((), dtype=torch.float64, device=platform.device())
    grads = []
    for p in model.parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            squares += p.grad.detach().double().pow(2).sum()
    group = parallel_state.get_model_parallel_group()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    norm = math.sqrt(float(squares))
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for grad in grads:
            grad.mul_(scale)
    return norm


class TorchOptimizerState:
    """A torch optimizer whose parameters are sharded like the model's: its state is saved under
    ``optimizer.state.<exp_avg|...>.<weight key>``; per-parameter ``step`` is stored once, as
    Megatron's optimizers do."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.fused = bool(optimizer.param_groups[0].get("fused"))  # the kernel it was built with

    def format(self) -> dict:
        return {"optimizer": "torch"}

    def sharded_state_dict(self, model_state: dict, *, saved: SavedOptimizerState | None = None) -> dict:
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        id_to_sharded = get_param_id_to_sharded_param_map(model_state, params)
        state = self.optimizer.state_dict()
        if saved is not None:
            # A fresh optimizer has no state yet: give it placeholders of the saved kinds and dtypes.
            kinds = {key.split(".")[2] for key in saved.tensors if key.startswith("optimizer.state.")}
            state["state"] = {
                i: {kind: torch.empty(param.shape, device=param.device,
                                      dtype=saved.tensors[f"optimizer.state.{kind}.{id_to_sharded[i].key}"].dtype)
                    for kind in kinds}
                for i, param in enumerate(params)
            }
        steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
        if len(steps) > 1:
            raise UserError(f"optimizer step differs between parameters ({sorted(steps)}); "
                             "only a shared step can be checkpointed")
        step = next((s["step"] for s in state["state"].values() if "step" in s), None)
        optim_state_to_sharding_state(state, id_to_sharded, exclude_keys=("step",))
        if step is not None:
            state["state"]["common_step"] = step
        return state

    def load_state_dict(self, loaded: dict) -> None:
        step = loaded["state"].pop("common_step", None)
        if step is not None:
            for param_state in loaded["state"].values():
                param_state["step"] = step.clone() if torch.is_tensor(step) else step
        self.optimizer.load_state_dict(loaded)
        set_fused_adam(self.optimizer, self.fused)  # the loaded groups carry the saving run's kernel
