"""Training phases: which objective, context (sequence length, RoPE base, batch) and warmup restart
at which step; pure functions, no Megatron.

A run of ``total_steps`` optimizer steps is split into consecutive phases, e.g. the paper's
biphasic recipe "25 % CLM then 75 % MLM at 40 % masking" (:class:`Phase` as a recipe writes it,
:class:`ResolvedPhase` with its step range). Phases are half-open step ranges ``[start, end)``;
the learning rate over them is ``schedule.lr_at``'s, and what each phase reads (length, batch)
is ``training.context``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

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

    rotary_base: float | None = None
    """RoPE theta in this phase (None: ``model.rotary_base``): long phases raise it."""

    micro_batch_size: int | None = None
    """Samples per micro-batch in this phase (None: the run's, scaled by ``data.seq_length /
    seq_length`` so a micro-batch holds no more tokens than the run's)."""

    global_batch_size: int | None = None
    """Samples per step in this phase (None: the run's, scaled by ``data.seq_length / seq_length``,
    which keeps the tokens per step; given, the tokens per step may change, which the dry run says)."""

    data_path: tuple[str, ...] | None = None
    """The phase's own training blend, in the forms of ``data.data_path`` (prefixes, or Megatron's
    ``weight prefix`` pairs); None: the run's ``data.data_path``. A run any of whose phases sets
    ``data_path`` or ``temperature`` reads each source as its own stream, continued across phases
    (``training.mixtures``)."""

    temperature: float | None = None
    """Sampling temperature tau in [0, 1] of the phase's sources (the XLM-R / mmBERT rule): each
    source's share is proportional to its size ** tau, its size being its weight in ``data_path``
    or, without weights, its samples (tokens of its train split / seq_length). 1: proportional to
    size (Megatron's blend); 0: uniform; mmBERT anneals 0.7 -> 0.5 -> 0.3. None: 1."""

    valid_data_path: tuple[str, ...] | None = None
    """The blend validation reads at the evaluations of this phase (the valid split of its prefixes,
    as ``data.split`` cuts them; read whole with ``data.valid_data_path``'s per-split form), each
    source's losses reported; None: the run's validation blend, the same in every phase so that its
    losses compare over the run."""

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
        if self.rotary_base is not None and not self.rotary_base > 0:
            raise UserError(f"rotary_base must be > 0, got {self.rotary_base!r}")
        for name in ("data_path", "valid_data_path"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, str) or not value:
                    raise UserError(f"{name}: expected a non-empty list of prefixes, got {value!r}")
                object.__setattr__(self, name, tuple(str(entry) for entry in value))
        if self.temperature is not None and (isinstance(self.temperature, bool)
                                             or not isinstance(self.temperature, (int, float))
                                             or not 0.0 <= self.temperature <= 1.0):
            raise UserError(f"temperature: expected a number in [0, 1] (1: shares proportional to the "
                            f"sources' sizes, 0: uniform), got {self.temperature!r}")

    CONTEXT_KEYS = ("seq_length", "rotary_base", "micro_batch_size", "global_batch_size")
    """The keys that change what a phase's steps read (``training.context``); saved only when set."""

    DATA_KEYS = ("data_path", "temperature")
    """The keys that change which sources a phase's steps read from (``training.mixtures``); saved
    only when set."""

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
                **{key: getattr(self, key) for key in self.CONTEXT_KEYS if getattr(self, key) is not None},
                **{key: (list(value) if isinstance(value, tuple) else value)
                   for key in (*self.DATA_KEYS, "valid_data_path") if (value := getattr(self, key)) is not None}}


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

    rotary_base: float | None = None
    """See :class:`Phase` (None: the model's)."""

    micro_batch_size: int | None = None
    """See :class:`Phase` (None: the run's, scaled)."""

    global_batch_size: int | None = None
    """See :class:`Phase` (None: the run's, scaled)."""

    data_path: tuple[str, ...] | None = None
    """See :class:`Phase` (None: the run's)."""

    temperature: float | None = None
    """See :class:`Phase`."""

    valid_data_path: tuple[str, ...] | None = None
    """See :class:`Phase` (None: the run's validation blend)."""

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
                                      valid_data_path=phase.valid_data_path,
                                      **{key: getattr(phase, key) for key in Phase.CONTEXT_KEYS + Phase.DATA_KEYS}))
        start += length
    return resolved


def phase_at(resolved: Sequence[ResolvedPhase], step: int) -> ResolvedPhase:
    """The phase that contains ``step``."""
    for phase in resolved:
        if phase.start <= step < phase.end:
            return phase
    raise ValueError(f"step {step} is outside the phases' range [0, {resolved[-1].end})")
