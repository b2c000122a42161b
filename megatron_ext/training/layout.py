"""The parallel layout's rules: a world size splits into TP x PP x DP, the model over TP and PP,
every global batch over micro-batches x DP. Asked by the pre-flight (``training.preflight``, check 3),
by ``--dry-run``'s plan and by the memory estimate's micro-batch search, for each size it tries."""

from __future__ import annotations

from megatron_ext.config_loading import UserError
from megatron_ext.model.config import tensor_parallel_problem
from megatron_ext.training.config import RunConfig
from megatron_ext.training.context import rampup_schedule


def model_parallel_problem(config: RunConfig) -> str | None:
    """Why ``config``'s model does not split over its tensor- and pipeline-parallel sizes, or None:
    whatever the world size."""
    tp, pp = config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size
    m = config.model
    if (problem := tensor_parallel_problem(m, tp)) is not None:
        return problem
    if m.vocab_size % tp:
        return f"tensor_model_parallel_size={tp} must divide model.vocab_size={m.vocab_size}"
    if m.num_layers % pp:
        return f"pipeline_model_parallel_size={pp} must divide num_layers={m.num_layers}"
    return None


def check_layout(config: RunConfig, world_size: int | None) -> int | None:
    """Check that the layout and batch sizes divide, raising a ``UserError`` naming what does not:
    the one statement of these rules (``training.preflight``'s check 3, for the run before its process
    group exists, ``--dry-run`` for any world size, the study planner without one; the memory
    estimate's micro-batch search for each size it tries). Returns the data-parallel size (None
    without a world size: the model's split alone is checked)."""
    tp, pp = config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size
    if world_size is not None and (world_size < 1 or world_size % (tp * pp)):
        raise UserError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size={tp} x "
            f"pipeline_model_parallel_size={pp}"
        )
    if (problem := model_parallel_problem(config)) is not None:
        raise UserError(problem)
    if world_size is None:
        return None
    dp = world_size // (tp * pp)
    d = config.data
    if d.global_batch_size % (d.micro_batch_size * dp):
        raise UserError(
            f"data.global_batch_size={d.global_batch_size} is not divisible by micro_batch_size="
            f"{d.micro_batch_size} x data-parallel size {dp} (world {world_size} / (TP {tp} x PP {pp}))"
        )
    for batch in sorted({b for _, b in rampup_schedule(d) or ()}):
        if batch % (d.micro_batch_size * dp):
            raise UserError(f"data.rampup_batch_size {list(d.rampup_batch_size)}: the ramp's global batch {batch} is not "
                            f"divisible by micro_batch_size={d.micro_batch_size} x data-parallel size {dp}")
    for c in config.phase_contexts:
        if c.global_batch_size % (c.micro_batch_size * dp):
            raise UserError(
                f"phases[{c.phase.index}]: global batch {c.global_batch_size} is not divisible by micro batch "
                f"{c.micro_batch_size} x data-parallel size {dp} (world {world_size} / (TP {tp} x PP {pp})); set "
                f"phases[{c.phase.index}].micro_batch_size / global_batch_size")
    return dp


def layout_problem(config: RunConfig, world_size: int) -> str | None:
    """What :func:`check_layout` refuses in ``config`` at ``world_size``, or None: how a search over
    candidate settings (``memory.largest_micro_batch``) keeps to the same rules without restating them."""
    try:
        check_layout(config, world_size)
    except UserError as err:
        return str(err)
    return None
