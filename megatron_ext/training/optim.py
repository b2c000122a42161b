"""Megatron-Core's optimizer as the trainer uses it: the weight decay of each parameter group,
torch's fused AdamW kernel, and the optimizer's state in a checkpoint.

The engine (``megatron_engine.py``) builds the optimizer with ``get_megatron_optimizer`` (Adam with
Megatron's parameter groups, optionally the distributed optimizer) and sets each group's LR and
weight decay before every step (:func:`weight_decay_for`). :class:`MegatronOptimizerState` is how
that optimizer goes into and out of a distributed checkpoint (the
``checkpoint.reader.OptimizerCheckpointState`` protocol): the recorded format, Megatron-LM's
sharding metadata, and the megatron-core 0.19.2 bugs with torch's Adam (no TE/apex) worked
around at load.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from megatron.core import parallel_state

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
            self._allocate_state()
        return self.optimizer.sharded_state_dict(model_state, is_loading=loading,
                                                 metadata=saved_format if loading else self.format())

    def _allocate_state(self) -> None:
        """Give a fresh distributed optimizer its state tensors before a load. With torch's Adam
        (no TE/apex), megatron-core 0.19.2's ``DistributedOptimizer.state_dict`` reads the step
        from the per-parameter state, which a fresh optimizer lacks (an assertion in
        ``DistributedOptimizer.state_dict``); Megatron's own dummy initialisation (a zero-gradient step
        at the current LR, 0 before training) allocates it without moving any parameter."""
        for part in self._parts():
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
        parts = self._parts()
        with torch.no_grad(), _torch_adam_step_kept(parts):
            self.optimizer.load_state_dict(loaded)
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


@contextlib.contextmanager
def _torch_adam_step_kept(parts: list) -> Iterator[None]:
    """During a distributed-optimizer load with torch's Adam (no TE/apex): megatron-core 0.19.2's
    ``_set_main_param_and_optimizer_states`` copies every tensor of a parameter's optimizer state
    from the checkpoint, torch's per-parameter ``step`` included, which the ``fully_reshardable``
    format does not hold (``KeyError: 'step'``). The step is restored from the common state just
    before; here it is kept as it is, on these optimizer instances only (not their class)."""
    from megatron.core.optimizer import distrib_optimizer

    patched = [] if distrib_optimizer.HAVE_APEX_OR_TE else [
        part for part in parts if isinstance(part, distrib_optimizer.DistributedOptimizer)]

    def keep_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        return type(self)._set_main_param_and_optimizer_states(self, model_param, tensors)

    for part in patched:
        part._set_main_param_and_optimizer_states = types.MethodType(keep_step, part)
    try:
        yield
    finally:
        for part in patched:
            del part._set_main_param_and_optimizer_states


def _layout() -> dict:
    return {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": parallel_state.get_data_parallel_world_size()}
