"""Sequence classification (SC): the model's own classification head, scored by accuracy.

The paper's SC tasks are SST-2 (single sentences), MNLI and QQP (sentence pairs): rows with a
``text_pair`` column are encoded as pairs (the tokenizer's own pair template, e.g. BERT's
``[SEP]`` and token types). The head is the model's ``AutoModelForSequenceClassification`` one, as
in the paper's protocol, or with ``sc_head: mean_linear`` a linear layer on the mean of the last
hidden states over real tokens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from sklearn.metrics import accuracy_score

from megatron_ext.config_loading import UserError
from megatron_ext.eval.families.linear_head import LinearHeadTask, run_linear_head
from megatron_ext.eval.finetuning import FinetuneConfig, LinearHeadModel, OwnHeadModel, RunResult, autocast, by_length
from megatron_ext.eval.family import TASK_FILE, Family, TaskSchema


SCHEMA = TaskSchema(family="sc", columns=("id", "text", "label"))
"""Rows of a text (and, for pairs, ``text_pair``) and the index of its class in ``task.json``'s labels."""
METRIC = "accuracy"


def encode(tokenizer: Any, rows: list[dict], device: torch.device) -> dict[str, torch.Tensor]:
    """Padded, truncated model inputs of ``rows`` (pairs when they carry ``text_pair``)."""
    pairs = [row["text_pair"] for row in rows] if "text_pair" in rows[0] else None
    batch = tokenizer([row["text"] for row in rows], pairs, padding=True, truncation=True,
                      return_tensors="pt")
    return {key: value.to(device) for key, value in batch.items()}


def label_names(task_dir: Path, rows: list[dict]) -> list[str]:
    """Class names from ``task.json`` (or ``0..max label`` without one); labels must index them."""
    meta_path = task_dir / TASK_FILE
    names = json.loads(meta_path.read_text(encoding="utf-8")).get("labels") if meta_path.exists() else None
    if not names:
        names = [str(i) for i in range(max((r["label"] for r in rows if type(r["label"]) is int), default=-1) + 1)]
    for row in rows:
        if type(row["label"]) is not int or not 0 <= row["label"] < len(names):
            raise UserError(f"{task_dir}: row {row['id']!r} has label {row['label']!r}; expected an int "
                            f"index into the task's labels {names}")
    return names


def _characters(row: dict) -> int:
    return len(row["text"]) + len(row.get("text_pair") or "")


@torch.no_grad()
def predict(model: LinearHeadModel | OwnHeadModel, tokenizer: Any, rows: list[dict],
            config: FinetuneConfig) -> list[int]:
    """Predicted class index of every row: batches of similar length (:func:`by_length`, by
    characters), the predictions gathered on the device and read once."""
    device = config.torch_device
    predicted = torch.empty(len(rows), dtype=torch.long, device=device)
    for positions, batch in by_length(rows, _characters, config.batch_size):
        with autocast(config):
            logits = model(encode(tokenizer, batch, device))
        predicted[torch.tensor(positions, device=device)] = logits.argmax(-1)
    return predicted.tolist()


def scores(rows: list[dict], predictions: list[int]) -> dict[str, float]:
    """Accuracy (0-100) of ``predictions`` for ``rows``."""
    return {METRIC: 100.0 * accuracy_score([row["label"] for row in rows], predictions)}


def example_scores(rows: list[dict], predictions: list[int]) -> list[float]:
    """100 for each correctly classified row, 0 otherwise."""
    return [100.0 if prediction == row["label"] else 0.0 for row, prediction in zip(rows, predictions, strict=True)]


def accuracy(model: LinearHeadModel | OwnHeadModel, tokenizer: Any, rows: list[dict], config: FinetuneConfig) -> float:
    """Accuracy (0-100) of ``model`` on ``rows``."""
    return scores(rows, predict(model, tokenizer, rows, config))[METRIC]


def loss(model: LinearHeadModel | OwnHeadModel, tokenizer: Any, rows: list[dict], names: list[str],
         config: FinetuneConfig) -> torch.Tensor:
    """Cross-entropy of the rows' labels."""
    logits = model(encode(tokenizer, rows, config.torch_device))
    labels = torch.tensor([row["label"] for row in rows], device=logits.device)
    return torch.nn.functional.cross_entropy(logits.float(), labels)


HEAD = LinearHeadTask(
    schema=SCHEMA, pooled=True, metric=METRIC, label_names=label_names, loss=loss,
    predict=lambda model, tokenizer, rows, names, config: predict(model, tokenizer, rows, config),
    score=scores, example_scores=example_scores, own_head=lambda config: config.sc_head == "model",
)
"""Sequence classification for :func:`~megatron_ext.eval.families.linear_head.run_linear_head`."""


def run(model_dir: str, task_dir: Path, config: FinetuneConfig) -> RunResult:
    """Fine-tune ``model_dir`` on the task's train split; accuracy on validation and test."""
    return run_linear_head(HEAD, model_dir, task_dir, config)


def _leak_key(row: dict) -> str:
    # The same sentence up to case and punctuation is the same example.
    return " ".join(re.findall(r"\w+", row["text"].lower()))


FAMILY = Family(schema=SCHEMA, title="sequence classification", paper=True, metric=METRIC, run=run,
                leak_key=_leak_key)
