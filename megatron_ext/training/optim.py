"""Megatron-Core's optimizer as the trainer uses it: the weight decay of each parameter group,
torch's fused AdamW kernel, and the optimizer's state in a checkpoint.

The engine (``megatron_engine.py``) builds the optimizer with ``get_megatron_optimizer`` (Adam with
Megatron's parameter groups, optionally the distributed optimizer) and sets each group's LR and
weight decay before every step (:func:`weight_decay_for`). :class:`MegatronOptimizerState` is how
that optimizer goes into and out of a distributed checkpoint (the
``checkpoint.reader.OptimizerCheckpointState`` protocol): the recorded format, Megatron-LM's
sharding metadata, and the megatron-core 0.19.2 bugs with torch's Adam (no TE/apex) worked
around at load (``megatron_compat.optimizer``).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_ext.megatron_compat import optimizer as compat
from megatron_ext.training.config import OptimizerConfig


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


def megatron_uses_torch_adam() -> bool:
    """Whether Megatron-Core builds torch's AdamW: neither Transformer Engine nor apex imports, or
    the run is on CPU (where ``cuda_on_cpu`` makes Megatron choose torch's optimizers)."""
    from megatron.core import optimizer

    return optimizer.USING_PYTORCH_OPTIMIZER


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

    def _parts(self) -> list:
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def set_kernel(self) -> None:
        """Torch's AdamW kernel as ``optimizer.fused`` says; again after each load, which brings
        back the saved parameter groups' flags."""
        if self.torch_adam_fused is not None:
            for part in self._parts():
                set_fused_adam(part.optimizer, self.torch_adam_fused)

    def format(self) -> dict:
        recorded = {"optimizer": "megatron", "distributed_optimizer": self.distributed,
                    **_layout(), "chained_optim_avoid_prefix": True, "singleton_local_shards": False}
        if self.distributed:
            recorded["distrib_optim_sharding_type"] = self.sharding_type
        return recorded

    def sharded_state_dict(self, model_state: dict, *, saved_format: dict | None = None) -> dict:
        # Megatron's own metadata keys are what the optimizer reads; ours are ignored by it.
        loading = saved_format is not None
        if loading:
            compat.allocate_distributed_optimizer_state(self._parts())
        return self.optimizer.sharded_state_dict(model_state, is_loading=loading,
                                                 metadata=saved_format if loading else self.format())

    def load_state_dict(self, loaded: dict) -> None:
        # no_grad: with fp32 parameters the distributed optimizer's main parameters are views of
        # the model's, which require grad; the load copies into them.
        parts = self._parts()
        with torch.no_grad(), compat.torch_adam_step_kept(parts):
            self.optimizer.load_state_dict(loaded)
        compat.restore_adam_steps(parts, [loaded] if len(parts) == 1 else [loaded[i] for i in range(len(parts))])
        self.set_kernel()


def _layout() -> dict:
    return {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": parallel_state.get_data_parallel_world_size()}
