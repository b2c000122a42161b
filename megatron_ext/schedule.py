"""Training phases (which objective at which step) and the learning-rate schedule: pure functions.

A run of ``total_steps`` optimizer steps is split into consecutive phases, e.g. the paper's
biphasic recipe "25 % CLM then 75 % MLM at 40 % masking". The learning-rate schedule spans the
whole run, not each phase: with warmup-stable-decay (WSD) the MLM phase continues from the CLM
weights at the stable learning rate and only the end of the run decays. Continued pretraining
(CPT) is a new run from an existing checkpoint, with its own ``total_steps``, phases and a fresh
schedule; a phase may also restart the warmup (``restart_warmup``).

Step convention (Megatron's): ``step`` is the number of optimizer steps already completed, and
``lr_at(step)`` is the learning rate of the update performed next. Phases are half-open step
ranges ``[start, end)``.

No Megatron; objectives (``megatron_ext.objectives``) are typed settings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from megatron_ext.config_loading import ConfigError, UserError, build_dataclass
from megatron_ext.objectives import Objective, PhaseProgress, read_objective


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One phase of a run, before its length is resolved against the step budget."""

    objective: Objective
    """What the phase trains (``megatron_ext.objectives``), e.g. ``MLM(mask_ratio=0.4)``."""

    steps: int | None = None
    """Length in optimizer steps; give exactly one of ``steps`` and ``share``."""

    share: float | None = None
    """Length as a share of the run's ``total_steps``, in (0, 1]."""

    restart_warmup: bool = False
    """Restart the learning-rate warmup at this phase's first step."""

    seq_length: int | None = None
    """Tokens per sample in this phase (None: ``data.seq_length``). A longer final phase is how a
    run extends its context (EuroBERT's annealing at 8,192): from the phase's first step the data
    is Megatron's dataset of the same prefixes at this length (``training.context``)."""

    rope_base: float | None = None
    """RoPE theta in this phase (None: ``model.rotary_base``): long phases raise it."""

    micro_batch_size: int | None = None
    """Samples per micro-batch in this phase (None: the run's, scaled by ``data.seq_length /
    seq_length`` so a micro-batch holds no more tokens than the run's)."""

    global_batch_size: int | None = None
    """Samples per step in this phase (None: the run's, scaled by ``data.seq_length / seq_length``,
    which keeps the tokens per step; given, the tokens per step may change, which the dry run says)."""

    def __post_init__(self) -> None:
        if not isinstance(self.objective, Objective):
            raise UserError(f"objective must be one of megatron_ext.objectives.OBJECTIVES' settings, "
                            f"got {self.objective!r}")
        if (self.steps is None) == (self.share is None):
            raise UserError(
                "exactly one of steps and share must be set, "
                f"got steps={self.steps}, share={self.share}"
            )
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise UserError(f"steps must be a positive integer, got {self.steps!r}")
        if self.share is not None and not 0.0 < self.share <= 1.0:
            raise UserError(f"share must be in (0, 1], got {self.share}")
        for name in ("seq_length", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        if self.rope_base is not None and not self.rope_base > 0:
            raise UserError(f"rope_base must be > 0, got {self.rope_base!r}")

    CONTEXT_KEYS = ("seq_length", "rope_base", "micro_batch_size", "global_batch_size")
    """The keys that change what a phase's steps read (``training.context``); saved only when set."""

    @classmethod
    def from_config(cls, raw: Any, where: str) -> Phase:
        """A phase of a recipe: ``{objective: {name: mlm, mask_ratio: 0.4}, share: 0.75}``, or with
        the objective's settings beside its name (``{objective: mlm, mask_ratio: 0.4, share: 0.75}``)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping like {{objective: clm, share: 0.25}}, got {raw!r}")
        if "objective" not in raw:
            raise ConfigError(f"{where}: missing required key(s) ['objective']")
        own = {f.name for f in dataclasses.fields(cls)}
        phase = {key: value for key, value in raw.items() if key in own}
        phase["objective"] = read_objective(raw["objective"], where,
                                            flat_settings={k: v for k, v in raw.items() if k not in own})
        return build_dataclass(cls, phase, where)

    def to_config(self) -> dict[str, Any]:
        """The tagged YAML form :meth:`from_config` reads back."""
        return {"objective": self.objective.to_config(), "steps": self.steps, "share": self.share,
                "restart_warmup": self.restart_warmup,
                **{key: getattr(self, key) for key in self.CONTEXT_KEYS if getattr(self, key) is not None}}


@dataclass(frozen=True, kw_only=True)
class ResolvedPhase:
    """A phase placed on the step axis."""

    index: int
    """Position in the phase list."""

    objective: Objective
    """See :class:`Phase`."""

    start: int
    """First step of the phase."""

    end: int
    """One past the last step of the phase."""

    restart_warmup: bool
    """See :class:`Phase`."""

    seq_length: int | None = None
    """See :class:`Phase` (None: the run's)."""

    rope_base: float | None = None
    """See :class:`Phase` (None: the model's)."""

    micro_batch_size: int | None = None
    """See :class:`Phase` (None: the run's, scaled)."""

    global_batch_size: int | None = None
    """See :class:`Phase` (None: the run's, scaled)."""

    @property
    def name(self) -> str:
        """The objective's name, e.g. ``clm`` or ``mlm-40`` (``Objective.name``)."""
        return self.objective.name

    @property
    def steps(self) -> int:
        """Number of steps in the phase."""
        return self.end - self.start

    def progress(self, step: int) -> PhaseProgress:
        """Where ``step`` (a step of this phase) sits in it."""
        return PhaseProgress(step=step - self.start, steps=self.steps)


def _phase_lengths(phases: Sequence[Phase], total_steps: int) -> list[int]:
    uses_steps = phases[0].steps is not None
    for i, phase in enumerate(phases):
        if (phase.steps is not None) != uses_steps:
            raise UserError(
                f"phases[{i}] sets {'share' if uses_steps else 'steps'} but phases[0] sets "
                f"{'steps' if uses_steps else 'share'}: give every phase steps or every phase share"
            )
    if uses_steps:
        lengths = [phase.steps for phase in phases]
        if sum(lengths) != total_steps:
            raise UserError(
                f"phases[*].steps sum to {sum(lengths)}, expected total_steps={total_steps}"
            )
        return lengths
    shares = [phase.share for phase in phases]
    if abs(math.fsum(shares) - 1.0) > 1e-9:
        raise UserError(f"phases[*].share sum to {math.fsum(shares)}, expected 1")
    # Largest remainder in exact rational arithmetic (normalised by the float sum), so lengths
    # sum to total_steps exactly; ties go to the earlier phase.
    exact = [Fraction(s) * total_steps / sum(map(Fraction, shares)) for s in shares]
    lengths = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(phases)), key=lambda i: (-(exact[i] - lengths[i]), i))
    for i in by_remainder[: total_steps - sum(lengths)]:
        lengths[i] += 1
    for i, length in enumerate(lengths):
        if length == 0:
            raise UserError(
                f"phases[{i}].share={shares[i]} gives 0 of total_steps={total_steps} steps"
            )
    return lengths


def resolve_phases(phases: Sequence[Phase], total_steps: int) -> list[ResolvedPhase]:
    """Place ``phases`` back to back on ``[0, total_steps)``; shares become whole steps."""
    if not isinstance(total_steps, int) or total_steps < 1:
        raise UserError(f"total_steps must be a positive integer, got {total_steps!r}")
    if not phases:
        raise UserError("phases must not be empty")
    resolved, start = [], 0
    for i, (phase, length) in enumerate(zip(phases, _phase_lengths(phases, total_steps))):
        resolved.append(ResolvedPhase(index=i, objective=phase.objective, start=start, end=start + length,
                                      restart_warmup=phase.restart_warmup,
                                      **{key: getattr(phase, key) for key in Phase.CONTEXT_KEYS}))
        start += length
    return resolved


def phase_at(resolved: Sequence[ResolvedPhase], step: int) -> ResolvedPhase:
    """The phase that contains ``step``."""
    for phase in resolved:
        if phase.start <= step < phase.end:
            return phase
    raise ValueError(f"step {step} is outside the phases' range [0, {resolved[-1].end})")


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


def rope_base_after(raw_phases: Any, total_steps: Any, steps_done: int) -> float | None:
    """The ``rope_base`` a saved run trained its last step with after ``steps_done`` steps: of the
    phase of step ``steps_done - 1`` in ``raw_phases`` (the run config's phases as
    :meth:`Phase.to_config` writes them) over ``total_steps``; None when that phase has none (the
    model's ``rotary_base``) or the saved config has no phases (an import)."""
    if not isinstance(raw_phases, list) or not raw_phases or not isinstance(total_steps, int):
        return None
    phases = [Phase.from_config(raw, f"phases[{i}]") for i, raw in enumerate(raw_phases)]
    return phase_at(resolve_phases(phases, total_steps), min(max(steps_done - 1, 0), total_steps - 1)).rope_base
