"""The fine-tuning run of the linear-head families: sequence (SC) and token (TC) classification.

Both fine-tune the encoder with a head (:class:`~megatron_ext.eval.finetuning.LinearHeadModel`, or
SC's own transformers head) under the shared protocol, then score its predictions on the validation and test subsets. What
differs (the head's input, mean-pooled or per token; the label set; the loss; the prediction; the
score) is a :class:`LinearHeadTask` that :mod:`.sc` and :mod:`.tc` pass to :func:`run_linear_head`.
Not a family itself: :data:`megatron_ext.eval.families.FAMILIES` lists those.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_ext.eval.finetuning import (
    FinetuneConfig,
    LinearHeadModel,
    OwnHeadModel,
    RunResult,
    cycle_batches,
    eval_subset,
    finetune,
    load_encoder,
    set_seed,
)
from megatron_ext.eval.family import TaskSchema


@dataclass(frozen=True, kw_only=True)
class LinearHeadTask:
    """What one linear-head family brings to :func:`run_linear_head`."""

    schema: TaskSchema
    """The family's rows (its name is shown in the progress bar)."""
    pooled: bool
    """One prediction per sequence (mean-pooled states) or one per token."""
    metric: str
    """The key of ``score``'s result reported as validation and test; the other keys go to
    :attr:`RunResult.extra` as ``<split>_<key>``."""
    label_names: Callable[[Path, list[dict]], list[str]]
    """The label set, from the task directory and every row read (it may normalise the rows' labels
    in place); the head has one output per name."""
    loss: Callable[[LinearHeadModel, Any, list[dict], list[str], FinetuneConfig], torch.Tensor]
    """Training loss of a batch: ``(model, tokenizer, rows, label names, config)``."""
    predict: Callable[[LinearHeadModel, Any, list[dict], list[str], FinetuneConfig], list]
    """Predictions for rows, same arguments as ``loss``."""
    score: Callable[[list[dict], list], dict[str, float]]
    """Scores (0-100) of the predictions for rows."""
    example_scores: Callable[[list[dict], list], list[float]]
    """Each row's own score (0-100) from its prediction (:attr:`RunResult.per_example`)."""
    check_tokenizer: Callable[[str, Any], None] | None = None
    """Refuses a tokenizer the family cannot use (``model_dir``, tokenizer), before the head exists."""
    own_head: Callable[[FinetuneConfig], bool] = lambda config: False
    """Whether the run uses the model's own transformers classification head
    (:class:`~megatron_ext.eval.finetuning.OwnHeadModel`) instead of :class:`LinearHeadModel`."""


def run_linear_head(task: LinearHeadTask, model_dir: str, task_dir: Path,
                    config: FinetuneConfig) -> RunResult:
    """Fine-tune ``model_dir`` with ``task``'s head on the train split; score validation and test."""
    started = time.perf_counter()
    task_dir = Path(task_dir)
    train_rows = task.schema.read(task_dir, "train")
    splits = {split: eval_subset(task.schema.read(task_dir, split), config.max_eval_examples)
              for split in ("validation", "test")}
    names = task.label_names(task_dir, train_rows + splits["validation"] + splits["test"])
    set_seed(config.seed)
    own_head = task.own_head(config)
    tokenizer, encoder = load_encoder(model_dir, config, num_labels=len(names) if own_head else None)
    if task.check_tokenizer is not None:
        task.check_tokenizer(model_dir, tokenizer)
    # Built right after the seed and the encoder: the head's initialisation draws from the seeded RNG.
    model = OwnHeadModel(encoder) if own_head else LinearHeadModel(encoder, len(names), pooled=task.pooled)
    model = model.to(config.torch_device, config.weights_dtype)
    steps = config.steps_for(len(train_rows))

    def loss_fn(model: LinearHeadModel, rows: list[dict]) -> torch.Tensor:
        return task.loss(model, tokenizer, rows, names, config)

    losses = finetune(model, cycle_batches(train_rows, config.batch_size, config.seed), config=config,
                      total_steps=steps, loss_fn=loss_fn,
                      desc=f"{task.schema.family} lr={config.lr:g} seed={config.seed}")
    predictions = {split: task.predict(model, tokenizer, rows, names, config) for split, rows in splits.items()}
    scores = {split: task.score(rows, predictions[split]) for split, rows in splits.items()}
    per_example = {split: dict(zip([row["id"] for row in rows], task.example_scores(rows, predictions[split]),
                                   strict=True)) for split, rows in splits.items()}
    return RunResult(
        metric=task.metric, validation=scores["validation"][task.metric], test=scores["test"][task.metric],
        steps=steps, losses=losses, seconds=time.perf_counter() - started, per_example=per_example,
        extra={f"{split}_{key}": value for split, split_scores in scores.items()
               for key, value in split_scores.items() if key != task.metric},
    )
