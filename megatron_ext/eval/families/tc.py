"""Token classification (TC): a linear head over every token state, scored by entity-level F1.

Rows hold words with word-level BIO tags (CoNLL-2003 style). The words are joined with spaces
and tokenized as running text (so byte-level BPE sees the same leading spaces as in
pretraining); sub-tokens are mapped back to words through the tokenizer's character offsets.
The first sub-token of each word carries its tag, the others are ignored (-100), and a word's
prediction is its first sub-token's; a word cut off by truncation is predicted ``O``. The score
is seqeval's micro F1 over entities (conlleval rules), as reported for CoNLL-2003.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from seqeval.metrics import f1_score, precision_score, recall_score
from seqeval.metrics.sequence_labeling import get_entities

from megatron_ext.config_loading import UserError
from megatron_ext.eval.families.linear_head import LinearHeadTask, run_linear_head
from megatron_ext.eval.finetuning import FinetuneConfig, LinearHeadModel, RunResult, autocast, by_length
from megatron_ext.eval.family import TASK_FILE, Family, TaskSchema

SCHEMA = TaskSchema(family="tc", columns=("id", "tokens", "tags"))
"""Rows of words and their BIO tags (names, or indices into ``task.json``'s labels)."""
METRIC = "f1"
IGNORE_INDEX = -100
"""Label of the sub-tokens that are not the first of a word (cross-entropy skips them)."""


def encode(tokenizer: Any, rows: list[dict], device: torch.device) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Model inputs of ``rows`` and, per row, the position of each word's first sub-token (-1: none)."""
    texts = [" ".join(row["tokens"]) for row in rows]
    char_words = []  # per row: the word index of each character of its text, -1 for the spaces
    for row in rows:
        char_words.append([w for index, word in enumerate(row["tokens"]) for w in [index] * len(word) + [-1]])
    batch = tokenizer(texts, padding=True, truncation=True, return_offsets_mapping=True, return_tensors="pt")
    firsts = []
    for row, owner, offsets in zip(rows, char_words, batch.pop("offset_mapping").tolist()):
        first = [-1] * len(row["tokens"])
        for position, (start, end) in enumerate(offsets):
            # A byte-level BPE token may include the space before its word: take the word it overlaps.
            words = [w for w in owner[start:end] if w >= 0]
            if words and first[words[0]] < 0:
                first[words[0]] = position
        firsts.append(first)
    return {key: value.to(device) for key, value in batch.items()}, firsts


def tag_names(task_dir: Path, rows: list[dict]) -> list[str]:
    """The tag set (``task.json`` labels, else the tags seen), after converting integer tags to names.

    Rows whose ``tags`` are integers (a hub dataset's ``ner_tags``) are rewritten in place with the
    names in ``task.json``; every tag must belong to the tag set.
    """
    meta_path = task_dir / TASK_FILE
    names = json.loads(meta_path.read_text(encoding="utf-8")).get("labels") if meta_path.exists() else None
    for row in rows:
        if len(row["tags"]) != len(row["tokens"]):
            raise UserError(f"{task_dir}: row {row['id']!r} has {len(row['tokens'])} tokens but "
                            f"{len(row['tags'])} tags")
        if names and all(type(tag) is int and 0 <= tag < len(names) for tag in row["tags"]):
            row["tags"] = [names[tag] for tag in row["tags"]]
    names = names or sorted({tag for row in rows for tag in row["tags"]})
    known = set(names)
    for row in rows:
        unknown = [tag for tag in row["tags"] if tag not in known]
        if unknown:
            raise UserError(f"{task_dir}: row {row['id']!r} has tag(s) {unknown} outside the tag set {names}")
    return names


@torch.no_grad()
def predict(model: LinearHeadModel, tokenizer: Any, rows: list[dict], names: list[str],
            config: FinetuneConfig) -> list[list[str]]:
    """Predicted tag of every word of every row: batches of similar length (:func:`by_length`, by
    characters), each batch's best tags read once all are queued."""
    scored = []
    for positions, batch in by_length(rows, lambda row: sum(len(word) + 1 for word in row["tokens"]),
                                      config.batch_size):
        inputs, firsts = encode(tokenizer, batch, config.torch_device)
        with autocast(config):
            scored.append((positions, firsts, model(inputs).argmax(-1)))
    predictions: list[list[str]] = [[] for _ in rows]
    for positions, firsts, best in scored:
        for position, tokens, first in zip(positions, best.tolist(), firsts, strict=True):
            predictions[position] = [names[tokens[p]] if p >= 0 else "O" for p in first]
    return predictions


def entity_scores(gold: list[list[str]], predicted: list[list[str]]) -> dict[str, float]:
    """Entity-level micro precision, recall and F1 (0-100) with seqeval's conlleval rules."""
    return {METRIC: 100.0 * f1_score(gold, predicted), "precision": 100.0 * precision_score(gold, predicted),
            "recall": 100.0 * recall_score(gold, predicted)}


def sentence_f1(gold: list[str], predicted: list[str]) -> float:
    """Entity F1 (0-100) of one sentence, by seqeval's entity rules (conlleval); a sentence with
    no entity in either scores 100, as nothing was missed or invented."""
    gold_entities, predicted_entities = set(get_entities(gold)), set(get_entities(predicted))
    if not gold_entities and not predicted_entities:
        return 100.0
    return 200.0 * len(gold_entities & predicted_entities) / (len(gold_entities) + len(predicted_entities))


def loss(model: LinearHeadModel, tokenizer: Any, rows: list[dict], names: list[str],
         config: FinetuneConfig) -> torch.Tensor:
    """Cross-entropy of the words' tags at their first sub-tokens."""
    index = {name: i for i, name in enumerate(names)}
    inputs, firsts = encode(tokenizer, rows, config.torch_device)
    labels = torch.full(inputs["input_ids"].shape, IGNORE_INDEX, dtype=torch.long)
    for i, (row, first) in enumerate(zip(rows, firsts)):
        for tag, position in zip(row["tags"], first):
            if position >= 0:
                labels[i, position] = index[tag]
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                             labels.flatten().to(logits.device), ignore_index=IGNORE_INDEX)


def _require_fast_tokenizer(model_dir: str, tokenizer: Any) -> None:
    if not tokenizer.is_fast:
        raise UserError(f"{model_dir}: token classification needs a fast tokenizer (tokenizer.json) for "
                        "character offsets")


HEAD = LinearHeadTask(
    schema=SCHEMA, pooled=False, metric=METRIC, label_names=tag_names, loss=loss, predict=predict,
    score=lambda rows, predicted: entity_scores([row["tags"] for row in rows], predicted),
    example_scores=lambda rows, predicted: [sentence_f1(row["tags"], p) for row, p in zip(rows, predicted, strict=True)],
    check_tokenizer=_require_fast_tokenizer,
)
"""Token classification for :func:`~megatron_ext.eval.families.linear_head.run_linear_head`."""


def run(model_dir: str, task_dir: Path, config: FinetuneConfig) -> RunResult:
    """Fine-tune ``model_dir`` on the task's train split; entity F1 on validation and test."""
    return run_linear_head(HEAD, model_dir, task_dir, config)


FAMILY = Family(schema=SCHEMA, title="token classification", paper=True, metric=METRIC, run=run,
                defaults={"epochs": 1.0}, leak_key=lambda row: " ".join(row["tokens"]))
"""The paper trains token classification for one epoch (``defaults``), the other families for ``max_steps``."""
