"""Sequence classification (SC): mean-pooled encoder states and a linear head, scored by accuracy.

The paper's SC tasks are SST-2 (single sentences), MNLI and QQP (sentence pairs): rows with a
``text_pair`` column are encoded as pairs (the tokenizer's own pair template, e.g. BERT's
``[SEP]`` and token types). The head reads the mean of the last hidden states over real tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from sklearn.metrics import accuracy_score

from megatron_ext.eval.protocol import (
    FinetuneConfig,
    LinearHeadModel,
    RunResult,
    autocast,
    cycle_batches,
    eval_subset,
    load_encoder,
    set_seed,
    train,
)
from megatron_ext.eval.task_io import TASK_FILE, load_task


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
            raise ValueError(f"{task_dir}: row {row['id']!r} has label {row['label']!r}; expected an int "
                             f"index into the task's labels {names}")
    return names


@torch.no_grad()
def predict(model: LinearHeadModel, tokenizer: Any, rows: list[dict], config: FinetuneConfig) -> list[int]:
    """Predicted class index of every row."""
    predictions = []
    for start in range(0, len(rows), config.batch_size):
        with autocast(config):
            logits = model(encode(tokenizer, rows[start:start + config.batch_size], config.torch_device))
        predictions.extend(logits.argmax(-1).tolist())
    return predictions


def accuracy(model: LinearHeadModel, tokenizer: Any, rows: list[dict], config: FinetuneConfig) -> float:
    """Accuracy (0-100) of ``model`` on ``rows``."""
    return 100.0 * accuracy_score([row["label"] for row in rows], predict(model, tokenizer, rows, config))


def run(model_dir: str, task_dir: Path, config: FinetuneConfig) -> RunResult:
    """Fine-tune ``model_dir`` on the task's train split; accuracy on validation and test."""
    started = time.perf_counter()
    task_dir = Path(task_dir)
    train_rows = load_task(task_dir, "train")
    splits = {split: eval_subset(load_task(task_dir, split), config.max_eval_examples)
              for split in ("validation", "test")}
    names = label_names(task_dir, train_rows + splits["validation"] + splits["test"])
    set_seed(config.seed)
    tokenizer, encoder = load_encoder(model_dir, config)
    model = LinearHeadModel(encoder, len(names), pooled=True).to(config.torch_device)
    steps = config.steps_for(len(train_rows))

    def loss_fn(model: LinearHeadModel, rows: list[dict]) -> torch.Tensor:
        logits = model(encode(tokenizer, rows, config.torch_device))
        labels = torch.tensor([row["label"] for row in rows], device=logits.device)
        return torch.nn.functional.cross_entropy(logits.float(), labels)

    losses = train(model, cycle_batches(train_rows, config.batch_size, config.seed), config=config,
                   total_steps=steps, loss_fn=loss_fn, desc=f"sc lr={config.lr:g} seed={config.seed}")
    return RunResult(
        metric="accuracy", steps=steps, losses=losses,
        validation=accuracy(model, tokenizer, splits["validation"], config),
        test=accuracy(model, tokenizer, splits["test"], config),
        seconds=time.perf_counter() - started,
    )
