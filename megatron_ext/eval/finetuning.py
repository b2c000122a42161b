"""The fine-tuning recipe (protocol) shared by every task family (the paper's, after EncodEval).

One fine-tuning run = one (model, task, learning rate, seed). Defaults follow the paper: batch 32,
AdamW (0.9, 0.95), eps 1e-5, weight decay 0.1, linear schedule with 10 % warmup, gradient clipping
at 1.0, 1,000 steps (token classification: one epoch), bfloat16 on GPU (autocast, and the weights
and AdamW state held in bfloat16), bidirectional attention always (the exported EuroBERT models
are bidirectional). Each family module (``families/{sc,tc,qa,ir}.py``) exposes
``run(model_dir, task_dir, config) -> RunResult`` and fine-tunes with :func:`finetune`, so the
optimizer, schedule, seeding and precision are the same for every task.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from megatron_ext import hardware
from megatron_ext.config_loading import UserError
from megatron_ext.progress import progress

T = TypeVar("T")

PAPER_LR_GRID = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4)
PAPER_SEEDS = (0, 1, 2, 3, 4)


@dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    """Hyper-parameters of one fine-tuning run."""

    lr: float
    """Peak learning rate (the grid value of this run); 0 for a zero-shot run, which trains nothing
    (a :attr:`~megatron_ext.eval.family.Family.zero_shot` family)."""
    seed: int
    """Seed of the head initialisation, data order and dropout."""
    batch_size: int = 32
    """Examples per optimizer step."""
    max_steps: int = 1000
    """Optimizer steps (sequence classification, QA, retrieval)."""
    epochs: float | None = None
    """If set, train this many passes over the training set instead of ``max_steps``
    (the paper: one epoch for token classification)."""
    warmup_ratio: float = 0.1
    """Share of the steps with linear warmup; then linear decay to 0."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-5
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not on norms and biases)."""
    max_length: int | None = None
    """Inputs are truncated to this many tokens (capped by the model's positions). None: the
    paper's protocol, 99 % of the model's maximum input length (EncodEval, ``abstract_eval.py``
    on the MLM_vs_CLM branch), i.e. 2,028 tokens for the paper's 2,048-position encoders."""
    max_eval_examples: int | None = None
    """Score at most this many validation/test examples (CI-sized runs); None: all."""
    bf16: bool | None = None
    """bfloat16 autocast; None: on when training on a GPU."""
    bf16_weights: bool | None = None
    """Hold the weights (encoder and head) and AdamW's state in bfloat16, as the paper's protocol
    does (EncodEval loads the model with ``dtype: bfloat16`` and trains with ``bf16: true``: no
    float32 master copy). None: with :attr:`bf16`. False: float32 weights under bf16 autocast
    (finer updates, twice the memory)."""
    device: str | None = None
    """``cuda`` or ``cpu``; None: CUDA when available."""
    sc_head: Literal["model", "mean_linear"] = "model"
    """Sequence classification's head. ``model``: the model's own
    ``AutoModelForSequenceClassification`` head, as the paper's protocol (EncodEval's SC configs
    name that class; for this project's EuroBERT exports: mean pooling, dense, GELU, linear).
    ``mean_linear``: a linear layer on the mean-pooled last hidden states, the same for every
    architecture."""

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise UserError(f"lr must be > 0 (0: a zero-shot run, nothing trained), got {self.lr}")
        if self.batch_size < 1 or self.max_steps < 1:
            raise UserError("batch_size and max_steps must be >= 1")
        if self.epochs is not None and self.epochs <= 0:
            raise UserError(f"epochs must be > 0, got {self.epochs}")
        if self.max_length is not None and self.max_length < 8:
            raise UserError(f"max_length must be >= 8 tokens (or None: 99 % of the model's), got {self.max_length}")
        if self.sc_head not in ("model", "mean_linear"):
            raise UserError(f"sc_head must be 'model' or 'mean_linear', got {self.sc_head!r}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise UserError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device or hardware.device().type)

    @property
    def use_bf16(self) -> bool:
        return self.torch_device.type == "cuda" if self.bf16 is None else self.bf16

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype the run's model is held and updated in (:attr:`bf16_weights`)."""
        bf16 = self.use_bf16 if self.bf16_weights is None else self.bf16_weights
        return torch.bfloat16 if bf16 else torch.float32

    def steps_for(self, n_train: int) -> int:
        """Optimizer steps of this run for a training set of ``n_train`` examples."""
        if self.epochs is None:
            return self.max_steps
        return max(1, round(self.epochs * n_train / self.batch_size))


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """Scores of one fine-tuning run (validation picks the LR; test is reported)."""

    metric: str
    """Name of the task metric, e.g. ``accuracy``, ``f1``, ``ndcg@10``."""
    validation: float
    """Metric on the validation split (0-100)."""
    test: float
    """Metric on the test split (0-100)."""
    steps: int
    """Optimizer steps taken."""
    seconds: float = 0.0
    """Wall time of the run."""
    extra: dict[str, float] = field(default_factory=dict)
    """Other metrics (e.g. exact match next to F1)."""
    losses: list[float] = field(default_factory=list)
    """Training loss of every optimizer step (what :func:`finetune` returns)."""
    per_example: dict[str, dict[str, float]] = field(default_factory=dict)
    """``{"validation": {row id: score}, "test": {...}}``: each scored example's own score (0-100;
    correct or not, a sentence's entity F1, a question's F1, a query's NDCG@10), saved with the
    run: the paper ranks models with paired tests on them (:mod:`megatron_ext.eval.ranking`)."""


def set_seed(seed: int) -> None:
    """Seed Python, numpy and torch (``torch.manual_seed`` seeds every device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


FUSED_ADAMW_DEVICES = ("cuda", "cpu")
"""Devices where AdamW runs as torch's fused kernel (one per step, not one per parameter; on 2 CPU
cores 3-4x faster for MiniLM's 22 M parameters), as ``transformers.Trainer``'s default does."""


def finetune_optimizer(model: torch.nn.Module, config: FinetuneConfig, total_steps: int):
    """AdamW (no decay on 1-D parameters; fused where :data:`FUSED_ADAMW_DEVICES`) and the linear
    warmup/decay schedule."""
    from transformers import get_linear_schedule_with_warmup

    if config.lr <= 0:
        raise UserError(f"fine-tuning needs lr > 0, got {config.lr} (lr 0 marks a zero-shot run)")

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
        fused=config.torch_device.type in FUSED_ADAMW_DEVICES,
    )
    scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=int(config.warmup_ratio * total_steps), num_training_steps=total_steps
    )
    return optimizer, scheduler


def autocast(config: FinetuneConfig):
    """bf16 autocast when the config asks for it, else a no-op context."""
    if not config.use_bf16:
        return contextlib.nullcontext()
    return torch.autocast(config.torch_device.type, dtype=torch.bfloat16)


FINITE_CHECK_STEPS = 50
"""Steps between two reads of the losses on the host (each waits for the device): a diverged run
is stopped at most this many steps after its first non-finite loss."""


def _check_finite(losses: list[torch.Tensor], lr: float) -> None:
    finite = torch.isfinite(torch.stack(losses)).tolist()
    if not all(finite):
        raise FloatingPointError(f"non-finite loss at step {finite.index(False)} (lr {lr:g})")


def finetune(model: torch.nn.Module, batches: Iterator[dict], *, config: FinetuneConfig, total_steps: int,
             loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor], desc: str = "fine-tune") -> list[float]:
    """Run ``total_steps`` optimizer steps of ``loss_fn(model, batch)``; returns the losses.

    ``batches`` must yield at least ``total_steps`` batches (cycle the training set as needed).
    Gradients are clipped to norm 1.0. The losses stay on the device (no host sync per step, so
    a GPU never waits for the host's next batch); every :data:`FINITE_CHECK_STEPS` steps and at
    the end they are checked, and a non-finite one stops the run with a FloatingPointError naming
    its step (the harness records it as a diverged run: LR too high, which is what stability
    measures).
    """
    optimizer, scheduler = finetune_optimizer(model, config, total_steps)
    model.train()
    losses: list[torch.Tensor] = []
    # A bar on a terminal. In a log file, an evaluation grid is hundreds of fine-tunes of seconds
    # to minutes, and the grid already logs one line per finished run (its result and the grid's
    # ETA): so no line at 10% marks and no closing line, only the time-based line (every
    # LINE_SECONDS) of a fine-tune that runs longer than that: a long one still shows it is alive.
    for step in progress(range(total_steps), desc=desc, unit="step", leave=False, mininterval=2.0,
                         every_percent=None, final_line=False):
        batch = next(batches)
        with autocast(config):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if (step + 1) % FINITE_CHECK_STEPS == 0 or step + 1 == total_steps:
            _check_finite(losses, config.lr)
    model.eval()
    return torch.stack(losses).float().tolist()


def by_length(items: Sequence[T], length: Callable[[T], int], batch_size: int) -> Iterator[tuple[list[int], list[T]]]:
    """``items`` in batches for scoring, longest first, each with its items' positions in ``items``
    (to put predictions back in order). Sorted, a batch pads to little more than its own inputs:
    in file order the suite's SC and TC splits pad to about twice their tokens."""
    order = sorted(range(len(items)), key=lambda i: -length(items[i]))
    for start in range(0, len(order), batch_size):
        positions = order[start:start + batch_size]
        yield positions, [items[i] for i in positions]


def load_encoder(model_dir: str, config: FinetuneConfig, *, num_labels: int | None = None
                 ) -> tuple[Any, torch.nn.Module]:
    """The tokenizer and bare encoder (``AutoModel`` in the run's weights dtype, on its device) of a HF
    directory; with ``num_labels``, its ``AutoModelForSequenceClassification`` (a new head) instead.

    The tokenizer's ``model_max_length`` is set to the run's input length (:func:`input_length`).
    Causal LMs are
    refused: their ``AutoModel`` attends causally while the protocol fine-tunes bidirectionally
    (export such checkpoints with ``--format eurobert``, which is bidirectional by construction).
    """
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(model_dir)
    causal = [name for name in hf_config.architectures or [] if name.endswith("ForCausalLM")]
    if causal:
        raise UserError(f"{model_dir} is a causal LM ({causal[0]}): its AutoModel attends causally; "
                        "fine-tuning needs a bidirectional encoder (e.g. an export with --format eurobert)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        raise UserError(f"{model_dir}: the tokenizer has no pad token (set pad_token in tokenizer_config.json)")
    tokenizer.model_max_length = input_length(config, getattr(hf_config, "max_position_embeddings", None),
                                              where=model_dir)
    if num_labels is None:
        encoder = load_pretrained(AutoModel, model_dir, dtype=config.weights_dtype)
    else:
        encoder = load_pretrained(AutoModelForSequenceClassification, model_dir, num_labels=num_labels,
                                  dtype=config.weights_dtype, pad_token_id=tokenizer.pad_token_id)
    encoder = encoder.to(config.torch_device)
    return tokenizer, encoder


class _LoadReports(logging.Filter):
    """Holds back transformers' weight-loading report (a table of every key not loaded) until
    :meth:`release` (the caller found it says something unexpected)."""

    logger = logging.getLogger("transformers.modeling_utils")

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.records.append(record)
            return False
        return True

    def release(self) -> None:
        for record in self.records:
            self.logger.handle(record)
        self.records = []


@contextlib.contextmanager
def held_load_reports() -> Iterator[_LoadReports]:
    """While loading Hugging Face weights: no progress bar, and the load report held back (printed
    if the load fails, since it explains the failure; otherwise when the caller releases it).

    Every fine-tuning run printed the report: its new task head is missing from the checkpoint and
    an exported encoder's LM head is unused, both expected."""
    from transformers.utils import logging as hf_logging

    held = _LoadReports()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    held.logger.addFilter(held)
    try:
        yield held
    except BaseException:
        held.logger.removeFilter(held)
        held.release()
        raise
    finally:
        held.logger.removeFilter(held)
        if bar:
            hf_logging.enable_progress_bar()


def load_pretrained(model_class: Any, model_dir: str, **kwargs: Any) -> torch.nn.Module:
    """``model_class.from_pretrained(model_dir, **kwargs)`` printing transformers' load report only
    when weights of the encoder itself are missing or mismatched (:func:`held_load_reports`): a task
    head that the checkpoint lacks, or checkpoint weights the model does not use, are expected."""
    with held_load_reports() as reports:
        model, loading = model_class.from_pretrained(model_dir, output_loading_info=True, **kwargs)
    body_only = model.base_model is model  # a bare encoder: every weight is the encoder's
    prefix = f"{model.base_model_prefix}."
    if loading["mismatched_keys"] or any(body_only or key.startswith(prefix) for key in loading["missing_keys"]):
        reports.release()
    return model


PAPER_LENGTH_SHARE = 0.99
"""Share of the model's maximum input length the paper's protocol truncates to."""


def input_length(config: FinetuneConfig, model_positions: int | None, *, where: str) -> int:
    """Tokens per input: ``config.max_length`` capped by the model's positions (an export's
    pretraining context), or by default ``PAPER_LENGTH_SHARE`` of those positions."""
    if config.max_length is not None:
        return min(config.max_length, model_positions or config.max_length)
    if not model_positions:
        raise UserError(f"{where}: config.json has no max_position_embeddings to take 99 % of; set max_length "
                        "(--max-length)")
    return round(PAPER_LENGTH_SHARE * model_positions)


def cycle_batches(examples: list, batch_size: int, seed: int) -> Iterator[list]:
    """Endless shuffled mini-batches over ``examples`` (a new permutation per pass)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(examples))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [examples[i] for i in order[start:start + batch_size]]
        if len(examples) < batch_size:
            yield [examples[i] for i in order]


def eval_subset(rows: list, limit: int | None) -> list:
    """At most ``limit`` of ``rows`` (all when None): the same spread-out sample for every run.

    Not the first rows: split files are grouped by source document (and some sources by class),
    so a prefix would be a biased sample.
    """
    if limit is None or len(rows) <= limit:
        return rows
    keep = np.random.default_rng(0).choice(len(rows), size=limit, replace=False)
    return [rows[i] for i in sorted(keep)]


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token states over real (non-padding) tokens: ``[b, s, h] -> [b, h]``."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)


class OwnHeadModel(torch.nn.Module):
    """A transformers ``*For*Classification`` model called like :class:`LinearHeadModel`:
    ``model(inputs) -> logits``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**inputs).logits


class LinearHeadModel(torch.nn.Module):
    """An encoder and a linear head over its last hidden states: per sequence (mean pooled over
    real tokens, sequence classification) or per token (token classification)."""

    def __init__(self, encoder: torch.nn.Module, num_labels: int, *, pooled: bool):
        super().__init__()
        self.encoder = encoder
        self.pooled = pooled
        self.head = torch.nn.Linear(encoder.config.hidden_size, num_labels)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.encoder(**inputs).last_hidden_state
        if self.pooled:
            hidden = mean_pool(hidden, inputs["attention_mask"])
        return self.head(hidden.to(self.head.weight.dtype))

