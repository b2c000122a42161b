"""Whether one run may continue another's trajectory: the step functions two runs must share.

A run started from another run's checkpoint at step ``b`` (a *branch*) equals the same recipe
trained from step 0 only if both runs compute the same thing at every step before ``b``. In this
trainer everything a step does is a function of the step and the run's definition
(docs/design.md, "The trainer"):

- its objective and masking: ``phases.phase_at`` over ``phases.resolve_phases`` and the
  objective's ``step_identity`` at that step of its phase, which depends
  on ``training.train_iters`` when phases are given as shares (a 25/75 split switches at step 3,000
  of 12,000 but at 10,500 of 42,000);
- its learning rate: ``schedule.lr_at``, which depends on ``train_iters`` through the decay (WSD
  decays over the last ``lr_wsd_decay_iters`` steps, so a 12K run leaves the stable rate at step
  10,001 and a 42K run at 40,001: Megatron's first lowered rate is one step past the decay start);
- its data: samples ``[step x global_batch_size, (step + 1) x global_batch_size)`` of the dataset
  order;
- its MLM masks: a generator seeded from ``(training.seed, step, micro-batch group)``, the group
  counting ``data.micro_batch_size`` samples.

:func:`first_divergence` compares those functions at every step two runs both train (exactly:
the floats ``lr_at`` returns, not a tolerance) and, first, the run definition they depend on
(:data:`NOT_COMPARED` lists what is left out). :func:`check_branch` is the refusal a trainer
gives before it loads a parent's checkpoint. One thing the configs cannot tell: Megatron's
``GPTDataset`` shuffles over the epochs it builds for ``train_iters x global_batch_size`` samples,
so two run lengths give the same sample order only if every dataset of the blend is read within
the same number of epochs by both (e.g. within one: the paper's 99B tokens of FineWeb-Edu's 1.3T).
The caller that has the datasets passes ``data_order`` to compare it: :func:`data_order` (from
the ``.idx`` files, ``training.datasets.sample_order``), which :func:`check_saved_parent`, the check
of ``checkpoint.branch_from`` (``checkpoint/resume.py``), passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from megatron_ext.config_loading import ConfigError, UserError
from megatron_ext.phases import ResolvedPhase
from megatron_ext.schedule import lr_at
from megatron_ext.training.config import RunConfig
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.context import dataset_samples, dataset_spans, first_context_change, varies
from megatron_ext.training.datasets import sample_order

NOT_COMPARED: dict[str, frozenset[str] | None] = {
    # how a step is run, not what it computes (a resume may change these too); bitwise equality of a
    # branched run with the same kernels is what the exactness tests measure
    "model": frozenset({"transformer_impl",
                        "seq_length"}),  # a guard on inputs; the lengths steps read are compared per phase
    "data": frozenset({"num_workers", "data_cache_path", "eval_iters", "max_tokens_to_scan"}),
    "optimizer": frozenset({"fused"}),
    "training": frozenset({
        "train_iters",  # compared through the step functions it feeds
        "eval_interval", "eval_mask_ratio", "log_interval", "max_nonfinite_steps",
        "recompute_granularity", "recompute_num_layers", "bias_activation_fusion",
        "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "rope_fusion", "gradient_accumulation_fusion", "lm_head_scored_only",
        "exit_signal_handler", "exit_duration_in_mins", "exit_interval",
    }),
    "parallel": None,  # data order and masks are named independently of the layout
    "checkpoint": None,  # outputs and cadence; the starting point is compared as ``start``
    "logging": None,
    "schedule": None,  # compared through lr_at, step by step
}
"""Per section of :class:`RunConfig`, the fields left out of the run definition (None: the whole
section). Every other field, including fields added later, is compared."""


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """Where two runs stop being the same run."""

    step: int
    """The first optimizer step whose update differs (0: they differ from the start)."""
    reason: str
    """What differs, with both values (first run's, then second's)."""


def run_definition(config: RunConfig) -> dict[str, Any]:
    """``{"section.field": value}`` of everything that defines what ``config``'s steps compute
    apart from the step functions themselves, plus ``start`` (from scratch, or the weights a
    continued pretraining starts from)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        if field.name == "phases":
            continue
        skip = NOT_COMPARED.get(field.name, frozenset())
        if skip is None:
            continue
        section = getattr(config, field.name)
        for sub in dataclasses.fields(section):
            if sub.name not in skip:
                out[f"{field.name}.{sub.name}"] = getattr(section, sub.name)
    ckpt = config.checkpoint
    out["start"] = f"weights of {ckpt.load}" if ckpt.finetune else "from scratch"
    if ckpt.load and not ckpt.finetune:
        out["start"] = f"checkpoint.load {ckpt.load}"
    return out


def _describe_phase(phase: ResolvedPhase) -> str:
    return f"{phase.objective.describe()} (steps {phase.start}-{phase.end - 1})"


def _describe_schedule(config: RunConfig) -> str:
    total, schedule = config.training.train_iters, config.schedule
    text = f"train_iters {total}"
    if schedule.lr_decay_style == "wsd":
        text += f", decay from step {total - schedule.lr_wsd_decay_iters}"
    return text


def first_divergence(a: RunConfig, b: RunConfig, *,
                     data_order: Callable[[RunConfig], Hashable] | None = None) -> Divergence | None:
    """The first step at which runs ``a`` and ``b`` compute differently, or None when they agree
    on every step both train (``[0, min(train_iters))``).

    ``data_order``, where the caller can build the datasets: a key of a run's sample order (e.g.
    each dataset's epoch count for ``train_iters x global_batch_size`` samples), compared when the
    run lengths differ. Without it the order is assumed to be the same (see the module docstring).
    """
    da, db = run_definition(a), run_definition(b)
    for key in list(da) + [k for k in db if k not in da]:
        if da.get(key) != db.get(key):
            return Divergence(step=0, reason=f"{key}: {da.get(key)!r} vs {db.get(key)!r}")
    ta, tb = a.training.train_iters, b.training.train_iters
    if data_order is not None and ta != tb and (order_a := data_order(a)) != (order_b := data_order(b)):
        return Divergence(step=0, reason=f"sample order at train_iters {ta} ({order_a!r}) vs {tb} ({order_b!r})")
    # The steps before the first context change (length, batch, RoPE base, data) are compared one by
    # one: an objective or a learning rate that differs earlier is the first divergence.
    change = first_context_change(a.phase_contexts, b.phase_contexts, micro_batches=True)
    pa, pb = a.resolved_phases, b.resolved_phases
    ia = ib = 0
    for step in range(min(ta, tb) if change is None else change[0]):
        while pa[ia].end <= step:
            ia += 1
        while pb[ib].end <= step:
            ib += 1
        if pa[ia].objective.step_identity(pa[ia].progress(step)) != pb[ib].objective.step_identity(pb[ib].progress(step)):
            return Divergence(step=step, reason=f"step {step}: phase {_describe_phase(pa[ia])} vs "
                                                f"{_describe_phase(pb[ib])}")
        lr_a = lr_at(step, config=a.schedule, total_steps=ta, phases=pa)
        lr_b = lr_at(step, config=b.schedule, total_steps=tb, phases=pb)
        if lr_a != lr_b:
            return Divergence(step=step, reason=f"step {step}: learning rate {lr_a!r} ({_describe_schedule(a)}) "
                                                f"vs {lr_b!r} ({_describe_schedule(b)})")
    return None if change is None else Divergence(step=change[0], reason=change[1])


def shared_steps(a: RunConfig, b: RunConfig, **kwargs) -> int:
    """How many steps from step 0 runs ``a`` and ``b`` share: the checkpoint of either after that
    many steps is a valid start for the other."""
    found = first_divergence(a, b, **kwargs)
    return found.step if found is not None else min(a.training.train_iters, b.training.train_iters)


def check_branch(parent: RunConfig, child: RunConfig, step: int, **kwargs) -> None:
    """Refuse, naming the first difference, to start ``child`` from ``parent``'s full state after
    ``step`` steps unless both runs are the same run on ``[0, step)``."""
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"branch step must be a positive integer, got {step!r} (step 0 is a start from scratch)")
    if step > parent.training.train_iters:
        raise ConfigError(f"branch step {step} is past the parent's last step (train_iters "
                          f"{parent.training.train_iters})")
    if step >= child.training.train_iters:
        raise ConfigError(f"branch step {step} leaves the child nothing to train (train_iters "
                          f"{child.training.train_iters})")
    found = first_divergence(parent, child, **kwargs)
    if found is not None and found.step < step:
        raise ConfigError(f"cannot branch at step {step}: the child is not the parent's run before that step; "
                          f"first difference (parent vs child): {found.reason}")


def data_order(config: RunConfig) -> tuple:
    """The sample-order key of ``first_divergence``: per dataset of the blend, ``(prefix, epochs,
    final epoch shuffled apart)`` for ``train_iters x global_batch_size`` samples
    (``training.datasets.sample_order``; equal keys: the same samples in the same order)."""
    contexts = config.phase_contexts
    if not varies(contexts):
        return sample_order(config.data, train_samples=config.training.train_iters * config.data.global_batch_size)
    # One dataset per sequence length (training.context), each sized for what its phases read.
    all_segments = dataset_spans(contexts)
    lengths = sorted({segment.seq_length for segment in all_segments})
    first_at = {length: next(s for s in all_segments if s.seq_length == length).contexts[0] for length in lengths}
    return tuple((length, sample_order(first_at[length].data_config(config.data),
                                       train_samples=dataset_samples(all_segments, length))) for length in lengths)


def check_saved_parent(parent_run_config: dict, child: RunConfig, step: int, *, where: str) -> None:
    """:func:`check_branch` of ``child`` against the run that saved ``parent_run_config`` (a
    checkpoint's ``run_config.json``), its sample order compared too (:func:`data_order`).
    ``where`` names the parent in the errors (``checkpoint.branch_from=...``)."""
    try:
        parent = run_config_from_dict(parent_run_config)
    except ConfigError as error:
        raise UserError(f"{where}: the parent's saved run config does not read as a recipe: {error}") from None
    try:
        check_branch(parent, child, step, data_order=data_order)
    except ConfigError as error:
        raise UserError(f"{where}: {error}") from None
