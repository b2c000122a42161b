"""The learning-rate schedule of a run: a pure function of the step, equal to Megatron-Core's.

The schedule spans the whole run, not each phase: with warmup-stable-decay (WSD) the MLM phase
continues from the CLM weights at the stable learning rate and only the end of the run decays.
Continued pretraining (CPT) is a new run from an existing checkpoint, with its own
``total_steps``, phases and a fresh schedule; a phase may also restart the warmup
(``restart_warmup``, ``phases.py``).

Step convention (Megatron's): ``step`` is the number of optimizer steps already completed, and
``lr_at(step)`` is the learning rate of the update performed next.

No Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from megatron_ext.config_loading import UserError
from megatron_ext.phases import ResolvedPhase


@dataclass(frozen=True, kw_only=True)
class LRScheduleConfig:
    """Learning-rate schedule over a whole run; names and semantics follow Megatron's flags
    (``--lr``, ``--min-lr``, ``--lr-decay-style``, ``--lr-warmup-iters``, ``--lr-warmup-init``,
    ``--lr-wsd-decay-iters``, ``--lr-wsd-decay-style``) with the decay spanning the whole run
    (Megatron's ``--lr-decay-iters`` = ``--train-iters``)."""

    lr: float
    """Peak learning rate, reached at the end of warmup (the paper: 5e-4)."""

    min_lr: float = 0.0
    """Learning rate at the end of the decay, in [0, lr]."""

    lr_decay_style: Literal["wsd", "WSD", "cosine", "linear", "constant"] = "wsd"
    """Shape after warmup: ``wsd`` (stable at ``lr``, then decay over the last
    ``lr_wsd_decay_iters`` steps), ``cosine``/``linear`` (decay from the end of warmup to the end
    of the run), ``constant`` (stay at ``lr``). Megatron-LM's spelling ``WSD`` is read as ``wsd``."""

    lr_warmup_iters: int = 0
    """Linear warmup length in steps, from ``lr_warmup_init`` to ``lr`` (the paper: 2,000)."""

    lr_warmup_init: float = 0.0
    """Learning rate at the first warmup step."""

    lr_wsd_decay_iters: int | None = None
    """``wsd`` only, required there: length of the final decay in steps (the paper: 2,000).
    Ignored by the other styles, as in Megatron-LM (so ``--lr-decay-style cosine`` works on a
    recipe that sets it; the dry run says it is unused)."""

    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    """``wsd`` only: decay curve (the paper: linear; Megatron's CLI default is exponential)."""

    def __post_init__(self) -> None:
        if self.lr_decay_style == "WSD":  # Megatron-LM's spelling
            object.__setattr__(self, "lr_decay_style", "wsd")
        if self.lr_decay_style not in ("wsd", "cosine", "linear", "constant"):
            raise UserError(
                "lr_decay_style must be one of wsd, cosine, linear, constant, "
                f"got {self.lr_decay_style!r}"
            )
        if self.lr_wsd_decay_style not in ("linear", "cosine", "exponential", "minus_sqrt"):
            raise UserError(
                "lr_wsd_decay_style must be one of linear, cosine, exponential, minus_sqrt, "
                f"got {self.lr_wsd_decay_style!r}"
            )
        if not self.lr > 0.0:
            raise UserError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr <= self.lr:
            raise UserError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if not 0.0 <= self.lr_warmup_init <= self.lr:
            raise UserError(
                f"lr_warmup_init must be in [0, lr={self.lr}], got {self.lr_warmup_init}"
            )
        if self.lr_warmup_iters < 0:
            raise UserError(f"lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        if self.lr_decay_style == "wsd":
            if self.lr_wsd_decay_iters is None or self.lr_wsd_decay_iters < 1:
                raise UserError(
                    "lr_wsd_decay_iters must be >= 1 with lr_decay_style='wsd', "
                    f"got {self.lr_wsd_decay_iters}"
                )


def _after_warmup(step: int, config: LRScheduleConfig, total_steps: int) -> float:
    """Megatron's ``get_lr`` past the warmup branch; ``lr`` up to the end of the first warmup."""
    warmup = config.lr_warmup_iters
    if config.lr_decay_style == "constant" or step <= warmup:
        return config.lr
    if config.lr_decay_style == "wsd":
        anneal_start = total_steps - config.lr_wsd_decay_iters
        # As in Megatron, the first lowered rate is at anneal_start + 1 and min_lr is reached
        # at total_steps, the step after the last update: the last update runs just above min_lr.
        if step <= anneal_start:
            coeff = 1.0
        else:
            ratio = float(step - anneal_start) / float(config.lr_wsd_decay_iters)
            coeff = {
                "linear": lambda r: 1.0 - r,
                "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
                "exponential": lambda r: 2.0 * math.pow(0.5, r) - 1.0,
                "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
            }[config.lr_wsd_decay_style](ratio)
    else:
        ratio = float(step - warmup) / float(total_steps - warmup)
        if config.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return config.min_lr + coeff * (config.lr - config.min_lr)


def lr_at(
    step: int,
    *,
    config: LRScheduleConfig,
    total_steps: int,
    phases: Sequence[ResolvedPhase] | None = None,
) -> float:
    """Learning rate of the update performed after ``step`` completed steps, in [0, total_steps].

    Equals Megatron-Core's ``OptimizerParamScheduler.get_lr`` at ``num_steps=step`` with
    ``lr_decay_steps=total_steps``, bit for bit (tests/unit/test_schedule.py steps a real one), but
    imports no Megatron: the dry run and the study planner ask it at every step, and importing
    ``megatron.core`` costs them ~5 s. Megatron quirks kept on purpose: warmup is inclusive
    (``step <= lr_warmup_iters``), so step 0 runs at ``lr_warmup_init`` (0 by default: the first
    update is a no-op) and ``lr`` is first reached at ``step == lr_warmup_iters``.

    With ``phases``, the warmup clock restarts at the start of the latest ``restart_warmup``
    phase at or before ``step``: from there the rate ramps linearly from ``lr_warmup_init`` to
    what the schedule gives without the restart, over ``lr_warmup_iters`` steps.
    """
    warmup = config.lr_warmup_iters
    if not isinstance(total_steps, int) or total_steps <= warmup:
        raise UserError(
            f"total_steps must be an integer > lr_warmup_iters={warmup}, got {total_steps!r}"
        )
    if config.lr_decay_style == "wsd" and warmup + config.lr_wsd_decay_iters > total_steps:
        raise UserError(
            f"lr_warmup_iters + lr_wsd_decay_iters = {warmup} + {config.lr_wsd_decay_iters} "
            f"exceeds total_steps={total_steps}"
        )
    if not 0 <= step <= total_steps:
        raise ValueError(f"step must be in [0, total_steps={total_steps}], got {step}")
    warmup_start = 0
    for phase in phases or ():
        if phase.restart_warmup and warmup == 0:
            raise UserError(f"phases[{phase.index}].restart_warmup needs lr_warmup_iters > 0")
        if phase.restart_warmup and phase.start <= step:
            warmup_start = max(warmup_start, phase.start)
    if phases and phases[-1].end != total_steps:
        raise UserError(f"phases end at step {phases[-1].end}, expected total_steps={total_steps}")

    target = _after_warmup(step, config, total_steps)
    if warmup > 0 and step - warmup_start <= warmup:
        # Same expression order as Megatron so the first warmup matches it bit for bit.
        init = config.lr_warmup_init
        return init + (target - init) * float(step - warmup_start) / float(warmup)
    return target
