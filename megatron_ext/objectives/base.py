"""What every objective is: typed settings that turn a dataset micro-batch into model inputs,
labels and a loss mask (:class:`ObjectiveBatch`), and answer what the trainer asks of them.

Data contract (``megatron.core.datasets.gpt_dataset.GPTDataset.__getitem__``, collated to
``[b, s]``). With ``add_extra_token_to_sequence=True`` (the default) a sample reads ``s + 1``
tokens ``text`` and yields:

- ``tokens = text[:-1]`` and ``labels = text[1:]`` (already shifted for next-token prediction);
- ``loss_mask`` (float): 1 everywhere except where ``labels`` is padding and, with
  ``eod_mask_loss=True``, where ``tokens`` is the EOD token (``_get_ltor_masks_and_position_ids``);
  all zeros for batch-padding samples (``idx=None``);
- padding ids in ``tokens`` and ``labels`` are rewritten to 0, a real vocabulary id. Padding only
  occurs in batch-padding samples and, with ``drop_last_partial_validation_sequence=False``, at
  the tail of the last validation sample; training samples are never padded.

With isolated documents (``data.reset_attention_mask``) the trainer adds ``document_ends`` (bool
``[b, s]``, True at each token that ends a document: its end-of-document token); without it a row's
documents attend to each other, the paper's setting. The objectives pass it on to the model
(:attr:`ObjectiveBatch.document_ends`) and never predict across a document end.

Labels are ``IGNORE_INDEX`` wherever ``loss_mask`` is 0. Megatron's vocab-parallel cross entropy
accepts such labels (out-of-partition ids give a finite value), which the loss mask then zeroes.

Nothing here touches the model, distributed state or Megatron; only torch and the tokenizer.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from megatron_ext.tokenizer import EncoderTokenizer, MissingSpecialTokenError

IGNORE_INDEX = -100
"""Label value at positions that carry no loss (also ``torch.nn.CrossEntropyLoss``'s default)."""


@dataclass(frozen=True, kw_only=True)
class ObjectiveBatch:
    """One micro-batch ready for the model and the loss."""

    input_ids: torch.Tensor
    """Model input ids, long ``[b, s]``."""

    labels: torch.Tensor
    """Target ids, long ``[b, s]``; ``IGNORE_INDEX`` where ``loss_mask`` is 0."""

    loss_mask: torch.Tensor
    """Float ``[b, s]``; 1 where a target is scored."""

    causal: bool
    """True: causal attention (CLM). False: bidirectional attention (MLM)."""

    max_scored_per_sequence: int
    """No sequence of the batch has more scored positions than this: a bound known on the host
    without reading ``loss_mask`` (the LM head at the scored positions selects this many rows per
    sequence, so the GPU never waits for the host). MLM: ``floor(mask_ratio * s + 0.5)``; CLM: ``s``."""

    document_ends: torch.Tensor | None = None
    """Isolated documents (``data.reset_attention_mask``): bool ``[b, s]``, True at each token that
    ends a document (the batch's ``document_ends``); each document attends only within itself
    (``model.attention.attention_pattern``). None: attention spans the documents of a row."""


@dataclass(frozen=True, kw_only=True)
class PhaseProgress:
    """Where a step sits in its phase: what schedules within a phase (a masking ratio going from
    30 % to 5 %) are pure functions of, so a resumed run or a branch recomputes them exactly."""

    step: int
    """Steps of the phase already completed, in ``[0, steps)``."""

    steps: int
    """Length of the phase in steps."""

    def __post_init__(self) -> None:
        if not 0 <= self.step < self.steps:
            raise ValueError(f"phase step must be in [0, {self.steps}), got {self.step}")

    @property
    def fraction(self) -> float:
        """0 at the phase's first step, 1 at its last (0 for a one-step phase)."""
        return self.step / (self.steps - 1) if self.steps > 1 else 0.0


class Vocabulary:
    """The token ids an objective corrupts with, read from the tokenizer when first asked (a
    CLM-only run needs no mask token)."""

    def __init__(self, tokenizer: EncoderTokenizer, *, size: int) -> None:
        self.tokenizer = tokenizer
        self.size = size
        """Rows of the model's embedding (``model.vocab_size``, >= the tokenizer's ids)."""

    @property
    def eod_id(self) -> int | None:
        """The tokenizer's end-of-document id, None without one. Masking never selects it, nor
        draws it as a random replacement (which would forge a document end); whole words and
        spans end at it."""
        try:
            return self.tokenizer.eod
        except MissingSpecialTokenError:
            return None

    @property
    def never_selected_ids(self) -> frozenset[int]:
        """Ids masking neither selects nor draws: the special ids and the EOD."""
        eod = self.eod_id
        return self.special_ids if eod is None else self.special_ids | {eod}

    @property
    def mask_id(self) -> int:
        return self.tokenizer.mask  # raises MissingSpecialTokenError with the fix

    @property
    def special_ids(self) -> frozenset[int]:
        return self.tokenizer.special_ids

    @functools.lru_cache(maxsize=4)
    def word_boundaries(self, device: torch.device) -> torch.Tensor:
        """Bool ``[2, size]``: per id, whether it starts a word and whether it ends one
        (``EncoderTokenizer.word_boundaries``); ids past the tokenizer's (model padding rows) do both."""
        boundaries = torch.ones(2, self.size, dtype=torch.bool)
        boundaries[:, : self.tokenizer.vocab_size] = torch.tensor(self.tokenizer.word_boundaries(), dtype=torch.bool)
        return boundaries.to(device)


@dataclass(frozen=True, kw_only=True)
class Objective(abc.ABC):
    """Base of every objective's settings (one module per objective in this package).

    A subclass is a frozen kw-only dataclass of its settings, checked once in ``__post_init__``,
    with its ``tag`` (the YAML ``objective: {name: <tag>, ...}``) registered in
    ``megatron_ext.objectives.OBJECTIVES``. Equal settings train the same steps.
    """

    tag: ClassVar[str]
    """The YAML name and the ``objective`` of each step record in ``metrics.jsonl``."""

    causal: ClassVar[bool]
    """Attention direction of its steps: True causal, False bidirectional."""

    needs_mask_token: ClassVar[bool]
    """Whether the tokenizer must have a mask token (checked before a run starts)."""

    prediction_offset: ClassVar[int] = 0
    """Where the output that predicts a selected token sits, relative to it: 0 at the token itself
    (MLM and its variants), -1 at the position before it (MNTP). An objective whose prediction is
    not at the mask is validated by a loss of its own (:meth:`validation_objective`) and read so
    by ``tools/fill_mask.py`` (the export records the offset)."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The one name of the objective (and of a phase) in the plan, the step log, validation
        lines, ``metrics.jsonl``, plots and the docs, e.g. ``clm``, ``mlm-40``."""

    @property
    def study_kind(self) -> str:
        """The name as a study spells run kinds and output paths (``mlm_40``)."""
        return self.name.replace("-", "_")

    @abc.abstractmethod
    def make_batch(self, batch: Mapping[str, torch.Tensor], *, progress: PhaseProgress, vocabulary: Vocabulary,
                   generator: torch.Generator) -> ObjectiveBatch:
        """Turn one ``GPTDataset`` micro-batch (module docstring) into the model's inputs and loss
        targets at ``progress``; random draws come from ``generator`` only."""

    @abc.abstractmethod
    def lm_head_share(self, progress: PhaseProgress, *, seq_length: int) -> float:
        """Share of a sequence's positions at which the LM head runs when it runs only where the
        loss scores (``training.lm_head_scored_only``): FLOPs of the step at ``progress``."""

    @abc.abstractmethod
    def peak_lm_head_share(self, *, seq_length: int) -> float:
        """The largest :meth:`lm_head_share` of any step of a phase (what memory must hold)."""

    def check_tokenizer(self, tokenizer: EncoderTokenizer) -> None:
        """Raise a ``UserError`` naming the objective and the tokenizer when the objective cannot
        train with ``tokenizer`` (``pretrain_encoder.py --dry-run`` asks, and every run before its
        model is built)."""
        if self.needs_mask_token:
            try:
                tokenizer.mask
            except MissingSpecialTokenError as err:
                raise MissingSpecialTokenError(f"objective {self.name} needs a mask token: {err}") from None

    def selection_problem(self, seq_length: int, key: Callable[[str], str] = str) -> str | None:
        """Why the objective would score (nearly) nothing in sequences of ``seq_length``, naming
        the setting at fault as ``key(field)`` (its key in the recipe); None when it scores enough."""
        return None

    def validation_objective(self, eval_mask_ratio: float) -> Objective | None:
        """What validation measures for a run that trains this objective besides CLM and MLM at
        ``eval_mask_ratio`` (``objectives.validation_objectives``): None when those measure it."""
        return None

    def step_identity(self, progress: PhaseProgress) -> Hashable:
        """What a step at ``progress`` computes besides its data and learning rate: two phases'
        steps with equal identities are the same step (``training.branching``)."""
        return self

    def describe(self) -> str:
        """The name with the settings it leaves out, for messages that compare two objectives."""
        return self.name

    def to_config(self) -> dict:
        """The tagged YAML form, ``{name: <tag>, <setting>: <value>, ...}`` with the settings that
        differ from their defaults; ``megatron_ext.objectives.read_objective`` reads it back."""
        return {"name": self.tag, **{field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                                     if getattr(self, field.name) != field.default}}
