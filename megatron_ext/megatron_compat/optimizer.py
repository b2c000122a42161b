"""megatron-core 0.19.2's optimizer checkpointing with torch's Adam (no Transformer Engine or apex,
as on CPU): three bugs worked around at load, on the optimizer instances only (never their class).
``training.optim.MegatronOptimizerState`` calls them; ``parts`` are the optimizer's parts
(``chained_optimizers``, or the optimizer alone)."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch


def allocate_distributed_optimizer_state(parts: list) -> None:
    """Give a fresh distributed optimizer its state tensors before a load. With torch's Adam,
    megatron-core 0.19.2's ``DistributedOptimizer.state_dict`` reads the step from the
    per-parameter state, which a fresh optimizer lacks (an assertion in
    ``DistributedOptimizer.state_dict``); Megatron's own dummy initialisation (a zero-gradient step
    at the current LR, 0 before training) allocates it without moving any parameter."""
    for part in parts:
        if not part.optimizer.state and hasattr(part, "_init_optimizer_states_with_dummy_values"):
            lrs = [group["lr"] for group in part.optimizer.param_groups]
            for group in part.optimizer.param_groups:
                group["lr"] = 0.0
            part._init_optimizer_states_with_dummy_values()
            for group, lr in zip(part.optimizer.param_groups, lrs):
                group["lr"] = lr


def restore_adam_steps(parts: list, saved_parts: list) -> None:
    """After a load: with torch's Adam the step lives per parameter; megatron-core 0.19.2 stores it
    once per group and, for the distributed optimizer, does not bring it back into a state
    allocated before the load (the per-parameter steps stay as allocated), or shares one tensor
    between all parameters, which torch's Adam increments in place once per parameter. Each
    parameter gets its own copy of the saved step."""
    for part, saved in zip(parts, saved_parts):
        groups = saved.get("optimizer", saved).get("param_groups", [])
        steps = {float(group["step"]) for group in groups if "step" in group}
        if len(steps) != 1:
            continue
        step = steps.pop()
        for param_state in part.optimizer.state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = torch.tensor(step, dtype=param_state["step"].dtype,
                                                   device=param_state["step"].device)


@contextlib.contextmanager
def torch_adam_step_kept(parts: list) -> Iterator[None]:
    """During a distributed-optimizer load with torch's Adam: megatron-core 0.19.2's
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
