"""Masked language modeling (MLM): a share of the positions is selected, corrupted (mask token,
random token or kept) and predicted with bidirectional attention.

:func:`apply_mlm` is the corruption as a pure tensor function (also used by ``hf.mlm_loss``):
it takes ``tokens`` only (the dataset's labels, loss mask and causal attention mask are ignored;
the model must attend bidirectionally). Because padding looks like token 0, pass ``maskable`` to
exclude it when a batch may contain padding, e.g. ``maskable=(loss_mask.sum(-1, keepdim=True) >
0)`` drops batch-padding samples. Which positions are selected is a :data:`Selection`; the
variants of this package (whole words, spans, MNTP's shifted targets) reuse everything else.

:class:`MLM` is the objective: its ratio may follow a schedule within the phase (mmBERT anneals
30 % -> 15 % -> 5 % over its phases; ModernBERT trains at 30 %), a pure function of the step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_ext.config_loading import UserError
from megatron_ext.objectives.base import IGNORE_INDEX, Objective, ObjectiveBatch, PhaseProgress, Vocabulary


@dataclass(frozen=True, kw_only=True)
class MaskingConfig:
    """How MLM corrupts its input. Replacement probabilities apply to the selected positions."""

    mask_ratio: float
    """Share of the maskable positions of each sequence that are selected (the paper: 0.2-0.5)."""

    mask_replace_prob: float = 1.0
    """Probability that a selected position becomes the mask token (1.0: the paper's likely
    setting; BERT's 80/10/10 is 0.8)."""

    random_replace_prob: float = 0.0
    """Probability that a selected position becomes a random non-special token (BERT: 0.1).
    The remaining ``1 - mask_replace_prob - random_replace_prob`` keep their original token."""

    def __post_init__(self) -> None:
        if not 0.0 < self.mask_ratio < 1.0:
            raise UserError(f"mask_ratio must be in (0, 1), got {self.mask_ratio}")
        for name in ("mask_replace_prob", "random_replace_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UserError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.mask_replace_prob + self.random_replace_prob > 1.0 + 1e-12:
            raise UserError(
                "mask_replace_prob + random_replace_prob must be <= 1, got "
                f"{self.mask_replace_prob} + {self.random_replace_prob}"
            )


@dataclass(frozen=True, kw_only=True)
class Selected:
    """What a :data:`Selection` picked."""

    positions: torch.Tensor
    """Bool ``[b, s]``: the positions predicted."""

    bound: int
    """A host-side bound on any row's count (``ObjectiveBatch.max_scored_per_sequence``)."""

    replaced_together: torch.Tensor | None = None
    """Long ``[b, s]`` in ``[0, s]``: selected positions with the same number share one replacement
    draw (mask, random or kept as a whole: SpanBERT's spans); None: each position draws its own."""


Selection = Callable[..., Selected]
"""``select(tokens, eligible, *, mask_ratio, generator) -> Selected``: which of the ``eligible``
positions of ``tokens`` (both ``[b, s]``) are predicted."""


def select_uniform(tokens: torch.Tensor, eligible: torch.Tensor, *, mask_ratio: float,
                   generator: torch.Generator) -> Selected:
    """An exact count per sequence: ``floor(mask_ratio * n + 0.5)`` positions drawn uniformly
    without replacement among the ``n`` eligible positions of that sequence (lower variance than
    per-position Bernoulli draws; a sequence with few eligible positions may get none)."""
    # Rank uniform scores per row with non-eligible positions pushed last; ranking (not a score
    # threshold) keeps the count exact even when float32 scores tie.
    scores = torch.rand(tokens.shape, generator=generator, device=tokens.device)
    scores = scores.masked_fill(~eligible, 2.0)
    order = scores.argsort(dim=1)
    ranks = torch.empty_like(order).scatter_(
        1, order, torch.arange(tokens.shape[1], device=tokens.device).expand_as(order)
    )
    selected = ranks < selected_counts(eligible, mask_ratio).unsqueeze(1)
    return Selected(positions=selected, bound=max_selected(tokens.shape[1], mask_ratio))


def selected_counts(eligible: torch.Tensor, mask_ratio: float) -> torch.Tensor:
    """``floor(mask_ratio * n + 0.5)`` per row of ``eligible``, ``n`` its eligible positions."""
    return torch.floor(eligible.sum(dim=1, dtype=torch.float64) * mask_ratio + 0.5).long()


MIN_SELECTED_PER_SEQUENCE = 2
"""The fewest positions a ratio may select in a full sequence (``MLM.selection_problem``): below
it, sequences that hold a document boundary or padding select none, and steps score nothing."""


def max_selected(seq_length: int, mask_ratio: float) -> int:
    """:func:`selected_counts` at ``n = seq_length``, its largest value (in float64, as there)."""
    return math.floor(seq_length * mask_ratio + 0.5)


# The two tables below are made once per device: copying a host tensor to a GPU waits for the
# device, a host sync per micro-batch otherwise.
@functools.lru_cache(maxsize=16)
def _ids_on(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``ids`` as a long tensor on ``device``."""
    return torch.tensor(ids, dtype=torch.long).to(device)


@functools.lru_cache(maxsize=16)
def _excluded_table(excluded_ids: tuple[int, ...], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Bool ``[vocab_size]`` on ``device``: True at ``excluded_ids``."""
    table = torch.zeros(vocab_size, dtype=torch.bool)
    table[list(excluded_ids)] = True
    return table.to(device)


def apply_mlm(
    tokens: torch.Tensor,
    *,
    config: MaskingConfig,
    mask_id: int,
    vocab_size: int,
    special_ids: Collection[int],
    generator: torch.Generator,
    maskable: torch.Tensor | None = None,
    select: Selection = select_uniform,
    document_ends: torch.Tensor | None = None,
) -> ObjectiveBatch:
    """Corrupt ``tokens`` ``[b, s]`` (ids in ``[0, vocab_size)``) for masked language modeling.

    Eligible = not in ``special_ids``, not ``mask_id``, and True in ``maskable`` (a bool tensor
    broadcastable to ``tokens``) when given. ``select`` picks among them (default
    :func:`select_uniform`). Each selected position (or group of positions, where the selection
    says which are ``replaced_together``) is then independently replaced by ``mask_id``, by uniformly
    drawn ids of ``[0, vocab_size)`` outside ``special_ids``/``mask_id``, or kept, with the config's
    probabilities. ``document_ends`` (isolated documents, ``ObjectiveBatch.document_ends``) is passed
    on to the model with the batch; an end of document is never selected (it must be in
    ``special_ids``, which are never drawn either).

    The output is a function of the inputs and ``generator``'s state, which must live on
    ``tokens.device``.
    """
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(
            f"tokens must be a long [b, s] tensor, got {tokens.dtype} {tuple(tokens.shape)}"
        )
    if not 0 <= mask_id < vocab_size:
        raise ValueError(f"mask_id must be in [0, vocab_size={vocab_size}), got {mask_id}")
    excluded_ids = sorted({*special_ids, mask_id})
    if excluded_ids[0] < 0 or excluded_ids[-1] >= vocab_size:
        raise ValueError(
            f"special_ids must be in [0, vocab_size={vocab_size}), got {sorted(special_ids)}"
        )
    # A lookup in a per-device table: torch.isin sorts (and waits for the device) once the
    # special ids are many (a Llama-3 vocabulary has 256).
    eligible = ~_excluded_table(tuple(excluded_ids), vocab_size, tokens.device)[tokens]
    if maskable is not None:
        eligible &= maskable.to(device=tokens.device, dtype=torch.bool)
    picked = select(tokens, eligible, mask_ratio=config.mask_ratio, generator=generator)
    selected = picked.positions

    choice = torch.rand(tokens.shape, generator=generator, device=tokens.device)
    if picked.replaced_together is not None:  # one draw per group: the draw at the group's number
        choice = choice.gather(1, picked.replaced_together.clamp(max=tokens.shape[1] - 1))
    to_mask = selected & (choice < config.mask_replace_prob)
    input_ids = tokens.masked_fill(to_mask, mask_id)
    if config.random_replace_prob > 0.0:
        replace_prob = config.mask_replace_prob + config.random_replace_prob
        to_random = selected & ~to_mask & (choice < replace_prob)
        # A uniform id outside ``excluded``: the r-th such id is r plus the count of excluded ids
        # at or below it, which searchsorted over ``excluded[i] - i`` gives (a nonzero() over
        # the vocabulary would wait for the device).
        draws = torch.randint(
            vocab_size - len(excluded_ids), tokens.shape, generator=generator, device=tokens.device
        )
        holes = _ids_on(tuple(e - i for i, e in enumerate(excluded_ids)), tokens.device)
        input_ids = torch.where(to_random, draws + torch.searchsorted(holes, draws, right=True), input_ids)

    return ObjectiveBatch(
        input_ids=input_ids,
        labels=tokens.masked_fill(~selected, IGNORE_INDEX),
        loss_mask=selected.float(),
        causal=False,
        max_scored_per_sequence=picked.bound,
        document_ends=document_ends,
    )


@dataclass(frozen=True, kw_only=True)
class MLM(Objective):
    """Masked language modeling; the variants of this package (whole words, spans, MNTP) are
    subclasses that change which positions are selected or what is predicted where."""

    tag = "mlm"
    causal = False
    needs_mask_token = True

    mask_ratio: float
    """Share of the maskable positions of each sequence that are selected, in (0, 1) (the paper:
    0.2-0.5); with a schedule, the share at the phase's first step."""

    mask_replace_prob: float = 1.0
    """Probability that a selected position becomes the mask token (BERT's 80/10/10 is 0.8)."""

    random_replace_prob: float = 0.0
    """Probability that a selected position becomes a random non-special token (BERT: 0.1)."""

    mask_ratio_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """How the ratio moves within the phase: ``constant``, or ``linear``/``cosine`` from
    ``mask_ratio`` at the phase's first step to ``final_mask_ratio`` at its last."""

    final_mask_ratio: float | None = None
    """The ratio at the phase's last step; required with a ``linear``/``cosine`` schedule, unset
    with ``constant``."""

    def __post_init__(self) -> None:
        if self.mask_ratio_schedule not in ("constant", "linear", "cosine"):
            raise UserError("mask_ratio_schedule must be one of constant, linear, cosine, "
                            f"got {self.mask_ratio_schedule!r}")
        if (self.mask_ratio_schedule == "constant") != (self.final_mask_ratio is None):
            raise UserError(f"final_mask_ratio must be set exactly when mask_ratio_schedule is linear or cosine, "
                            f"got final_mask_ratio={self.final_mask_ratio} with {self.mask_ratio_schedule!r}")
        # The replacement checks and the ratio's range live in MaskingConfig; the schedule is
        # monotone, so its two ends bound every step's ratio. Each end is named by its own key.
        for field, ratio in self.ratio_fields():
            try:
                self.masking(ratio)
            except UserError as err:
                raise UserError(str(err).replace("mask_ratio", field, 1)) from None

    def ratio_fields(self) -> tuple[tuple[str, float], ...]:
        """``(key, ratio)`` at the phase's first and last steps: a schedule is monotone, so every
        step's ratio lies between them."""
        ends = (("mask_ratio", self.mask_ratio),)
        return ends if self.final_mask_ratio is None else (*ends, ("final_mask_ratio", self.final_mask_ratio))

    def ratio_ends(self) -> tuple[float, ...]:
        """The ratios at the phase's first and last steps (:meth:`ratio_fields`)."""
        return tuple(ratio for _, ratio in self.ratio_fields())

    def selection_problem(self, seq_length: int, key: Callable[[str], str] = str) -> str | None:
        # The count of a sequence with every position maskable; a sequence holding a document
        # boundary or padding gets fewer, so a count below the floor leaves many with none.
        positions = self.selectable_positions(seq_length)
        for field, ratio in self.ratio_fields():
            count = max_selected(positions, ratio)
            if count < MIN_SELECTED_PER_SEQUENCE:
                return (f"{key(field)}: {ratio:g} of the {positions} maskable positions of a sequence (data.seq_length "
                        f"{seq_length}) selects {count} per sequence, fewer than {MIN_SELECTED_PER_SEQUENCE}: most "
                        f"steps would score nothing; raise {key(field)} to at least "
                        f"{(MIN_SELECTED_PER_SEQUENCE - 0.5) / positions:.3g} or lengthen data.seq_length")
        return None

    def validation_objective(self, eval_mask_ratio: float) -> Objective | None:
        # A prediction away from the mask (MNTP's) is not what MLM's same-position loss measures.
        return type(self)(mask_ratio=eval_mask_ratio) if self.prediction_offset != 0 else None

    def selectable_positions(self, seq_length: int) -> int:
        """Positions of a ``seq_length`` sequence that may be selected (all of them for MLM)."""
        return seq_length

    def masking(self, ratio: float) -> MaskingConfig:
        return MaskingConfig(mask_ratio=ratio, mask_replace_prob=self.mask_replace_prob,
                             random_replace_prob=self.random_replace_prob)

    def mask_ratio_at(self, progress: PhaseProgress) -> float:
        """The masking ratio of the step at ``progress``: a pure function of the step."""
        if self.final_mask_ratio is None:
            return self.mask_ratio
        start, end, t = self.mask_ratio, self.final_mask_ratio, progress.fraction
        if self.mask_ratio_schedule == "linear":
            return start + (end - start) * t
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * t))

    @property
    def name(self) -> str:
        """``mlm-40`` at a constant 0.4; ``mlm-30to5`` for a linear 0.3 -> 0.05 schedule,
        ``mlm-30to5-cosine`` for a cosine one."""
        return self._spelled(lambda ratio: str(round(100 * ratio)), "-")

    @property
    def study_kind(self) -> str:
        # Studies spell percents with up to six digits (``mlm_12.5``) where the step log rounds
        # (``mlm-12``); both spellings name committed results, so each stays.
        return self._spelled(lambda ratio: f"{100 * ratio:.6g}", "_")

    def _spelled(self, percent: Callable[[float], str], separator: str) -> str:
        text = f"{self.tag}{separator}{percent(self.mask_ratio)}"
        if self.final_mask_ratio is not None:
            text += f"to{percent(self.final_mask_ratio)}"
            if self.mask_ratio_schedule == "cosine":
                text += f"{separator}cosine"
        return text

    def describe(self) -> str:
        text = f"{self.tag} {self.mask_ratio:g}"
        if self.final_mask_ratio is not None:
            text += f"->{self.final_mask_ratio:g} {self.mask_ratio_schedule}"
        if (self.mask_replace_prob, self.random_replace_prob) != (1.0, 0.0):
            text += f", replace {self.mask_replace_prob}/{self.random_replace_prob}"
        return text

    def select(self, vocabulary: Vocabulary, device: torch.device, document_ends: torch.Tensor | None) -> Selection:
        """Which positions are predicted (:data:`Selection`), with the batch's isolated documents
        (``ObjectiveBatch.document_ends``; None: not isolated)."""
        return select_uniform

    def make_batch(self, batch: Mapping[str, torch.Tensor], *, progress: PhaseProgress, vocabulary: Vocabulary,
                   generator: torch.Generator) -> ObjectiveBatch:
        tokens = batch["tokens"]
        return apply_mlm(
            tokens, config=self.masking(self.mask_ratio_at(progress)), mask_id=vocabulary.mask_id,
            # The tokenizer's ids: random replacements never draw the model's padding rows.
            vocab_size=vocabulary.tokenizer.vocab_size, special_ids=vocabulary.never_selected_ids,
            generator=generator,
            maskable=batch["loss_mask"].sum(-1, keepdim=True) > 0,  # batch-padding samples
            select=self.select(vocabulary, tokens.device, batch.get("document_ends")),
            document_ends=batch.get("document_ends"),
        )

    def lm_head_share(self, progress: PhaseProgress, *, seq_length: int) -> float:
        return self.mask_ratio_at(progress)

    def peak_lm_head_share(self, *, seq_length: int) -> float:
        return max(self.ratio_ends())

    def step_identity(self, progress: PhaseProgress) -> Hashable:
        # A step computes the same as another when everything but the schedule matches and the
        # ratios agree at that step (a constant 0.4 phase and a schedule passing through 0.4).
        return dataclasses.replace(self, mask_ratio=self.mask_ratio_at(progress), mask_ratio_schedule="constant",
                                   final_mask_ratio=None)
