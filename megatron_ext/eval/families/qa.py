"""Extractive question answering (SQuAD, SQuAD v2, ReCoRD; the suite's ``news_cloze`` tasks).

The encoder (``AutoModel``, bidirectional) gets a linear start/end head over its token states.
Each (question, context) pair is tokenized with the fast tokenizer's ``only_second`` truncation
and ``return_overflowing_tokens``: a context longer than ``max_length`` becomes several
overlapping windows (features), and ``offset_mapping`` ties every context token to its
characters. A window that does not contain the answer, and every window of an unanswerable
question, is trained to point at position 0 (the ``[CLS]``/BOS token): the null answer.

Decoding takes, over all windows of a question, the highest ``start + end`` logit sum among spans
of context tokens at most :data:`MAX_ANSWER_TOKENS` long; the answer is the context's characters
from the start token's first to the end token's last character. For SQuAD v2-style tasks (any
training question unanswerable), the prediction is empty when the null score (position 0's start
+ end logits, lowest over the windows) beats the best span: a null-score threshold of 0, not tuned
on validation (as in Hugging Face's ``run_qa.py`` default).

Scores are SQuAD F1 (primary) and exact match from ``torchmetrics``' implementation of the
official SQuAD v1.1 script.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from megatron_ext.config_loading import UserError
from megatron_ext.eval import finetuning
from megatron_ext.eval.finetuning import FinetuneConfig, RunResult, eval_subset
from megatron_ext.eval.family import Family, TaskSchema

SCHEMA = TaskSchema(family="qa", columns=("id", "context", "question", "answers"))
"""SQuAD's rows: ``answers`` is ``{"text": [...], "answer_start": [...]}``, empty for an unanswerable question."""
METRIC = "f1"
MAX_QUESTION_TOKENS = 64
"""Longer questions are cut to their first 64 tokens (BERT's ``max_query_length``), so the
context always keeps at least ``max_length - 64 - special tokens`` positions per window."""
DOC_STRIDE_FRACTION = 1 / 3
"""Overlap between consecutive windows of a long context, as a share of ``max_length``
(``run_qa.py``: 128 of 384 tokens)."""
MAX_ANSWER_TOKENS = 30
"""Longest span the decoder considers, in tokens (``run_qa.py``'s ``max_answer_length``)."""
N_BEST = 20
"""Start and end candidates per window: the spans searched are the best 20 x best 20."""
_INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


class Answer(NamedTuple):
    """A decoded answer: ``text == context[start:end]``; empty text and -1 offsets for no answer."""

    text: str
    start: int
    end: int
    score: float


@dataclass(kw_only=True)
class Feature:
    """One window of one (question, context) pair."""

    example: int
    """Index of the question in the rows the features were built from."""
    inputs: dict[str, list[int]]
    """``input_ids``, ``attention_mask`` (and ``token_type_ids`` when the tokenizer makes them)."""
    offsets: list[tuple[int, int] | None]
    """Character span in the context of each context token; None for question and special tokens."""
    start: int
    """Token position of the answer's first token, 0 when the window holds no answer."""
    end: int
    """Token position of the answer's last token, 0 when the window holds no answer."""


class SpanModel(nn.Module):
    """An encoder with a linear start/end-logit head."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, 2)
        # The initialisation transformers gives its *ForQuestionAnswering heads.
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    def forward(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.encoder(**inputs).last_hidden_state
        start, end = self.head(hidden).float().unbind(-1)
        return start, end


def doc_stride(max_length: int) -> int:
    """Overlap in tokens between consecutive windows of a context."""
    return int(max_length * DOC_STRIDE_FRACTION)


def check_answers(rows: Sequence[dict], where: str) -> None:
    """Every answer must be the context's text at its ``answer_start``."""
    for row in rows:
        answers = row["answers"]
        if len(answers["text"]) != len(answers["answer_start"]):
            raise UserError(f"{where} row {row['id']!r}: answers.text and answers.answer_start "
                            "differ in length")
        for text, start in zip(answers["text"], answers["answer_start"], strict=True):
            if row["context"][start:start + len(text)] != text:
                raise UserError(f"{where} row {row['id']!r}: answer {text!r} is not at context "
                                f"offset {start}")


def prepare_features(tokenizer, rows: Sequence[dict], *, max_length: int) -> list[Feature]:
    """Tokenize (question, context) pairs into windows with answer-token labels.

    The training target is a question's first answer, as in SQuAD training.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"{type(tokenizer).__name__}: QA needs a fast tokenizer (offset mappings)")
    if max_length < 2 * MAX_QUESTION_TOKENS:
        raise UserError(f"max_length must be >= {2 * MAX_QUESTION_TOKENS} for QA (questions take up to "
                        f"{MAX_QUESTION_TOKENS} tokens), got {max_length}")
    questions = [row["question"].lstrip() for row in rows]
    question_tokens = tokenizer(questions, add_special_tokens=False, return_offsets_mapping=True)
    questions = [q if len(o) <= MAX_QUESTION_TOKENS else q[:o[MAX_QUESTION_TOKENS - 1][1]]
                 for q, o in zip(questions, question_tokens["offset_mapping"], strict=True)]
    encoded = tokenizer(
        questions, [row["context"] for row in rows], truncation="only_second", max_length=max_length,
        stride=doc_stride(max_length), return_overflowing_tokens=True, return_offsets_mapping=True,
    )
    features = []
    for i, example in enumerate(encoded["overflow_to_sample_mapping"]):
        sequence_ids = encoded.sequence_ids(i)
        offsets = [tuple(o) if s == 1 else None
                   for o, s in zip(encoded["offset_mapping"][i], sequence_ids, strict=True)]
        context_tokens = [j for j, s in enumerate(sequence_ids) if s == 1]
        if sequence_ids[0] == 1 or not context_tokens:
            raise UserError(f"{type(tokenizer).__name__} does not put the question first: "
                            "cannot build QA windows")
        first, last = context_tokens[0], context_tokens[-1]
        start = end = 0
        answers = rows[example]["answers"]
        if answers["text"]:
            a = answers["answer_start"][0]
            b = a + len(answers["text"][0])
            if offsets[first][0] <= a and offsets[last][1] >= b:
                start = first
                while start <= last and offsets[start][0] <= a:
                    start += 1
                start -= 1
                end = last
                while end >= first and offsets[end][1] >= b:
                    end -= 1
                end += 1
        features.append(Feature(
            example=example, inputs={k: encoded[k][i] for k in _INPUT_KEYS if k in encoded},
            offsets=offsets, start=start, end=end,
        ))
    return features


def decode(rows: Sequence[dict], features: Sequence[Feature], logits: Sequence[tuple[np.ndarray, np.ndarray]],
           *, allow_empty: bool) -> dict[str, Answer]:
    """Best answer per question from its windows' ``(start, end)`` logits (see the module docstring)."""
    by_example: dict[int, list[int]] = defaultdict(list)
    for i, feature in enumerate(features):
        by_example[feature.example].append(i)
    answers = {}
    for example, row in enumerate(rows):
        best, null = None, float("inf")
        for i in by_example[example]:
            offsets = features[i].offsets
            start_logits, end_logits = logits[i]
            null = min(null, float(start_logits[0] + end_logits[0]))
            starts = np.argsort(start_logits)[::-1][:N_BEST]
            ends = np.argsort(end_logits)[::-1][:N_BEST]
            for s in starts:
                for e in ends:
                    if offsets[s] is None or offsets[e] is None or not 0 <= e - s < MAX_ANSWER_TOKENS:
                        continue
                    score = float(start_logits[s] + end_logits[e])
                    if best is None or score > best.score:
                        a, b = offsets[s][0], offsets[e][1]
                        best = Answer(row["context"][a:b], a, b, score)
        if best is None or (allow_empty and null > best.score):
            best = Answer("", -1, -1, null)
        answers[row["id"]] = best
    return answers


def question_scores(predictions: Mapping[str, str], rows: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Each question's SQuAD ``f1`` and ``exact_match`` (0-100) for ``predictions`` (id -> text).

    torchmetrics implements the official v1.1 script (normalisation, token F1, max over the gold
    answers); its pairwise F1/EM already score an empty prediction against an empty gold answer as
    1 and against a non-empty one as 0. The v2 script's only other rule is applied here: an
    unanswerable question's gold answers are ``[""]``.
    """
    from torchmetrics.functional.text.squad import squad

    missing = [r["id"] for r in rows if r["id"] not in predictions]
    if missing:
        raise ValueError(f"no prediction for question(s) {missing[:5]}")
    return {r["id"]: {name: float(value) for name, value in squad(
                [{"id": r["id"], "prediction_text": predictions[r["id"]]}],
                [{"id": r["id"], "answers": {"text": list(r["answers"]["text"]) or [""]}}]).items()}
            for r in rows}


def squad_scores(predictions: Mapping[str, str], rows: Sequence[dict],
                 per_question: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, float]:
    """SQuAD F1 and exact match (0-100): the means of :func:`question_scores` (pass them as
    ``per_question`` when already computed). With unanswerable questions present,
    ``has_answer_f1`` and ``no_answer_f1`` break F1 down as the v2 script does."""
    per_question = question_scores(predictions, rows) if per_question is None else per_question

    def mean(subset: Sequence[dict], name: str) -> float:
        return sum(per_question[r["id"]][name] for r in subset) / len(subset)

    scores = {"f1": mean(rows, "f1"), "exact_match": mean(rows, "exact_match")}
    unanswerable = [r for r in rows if not r["answers"]["text"]]
    if unanswerable:
        answerable = [r for r in rows if r["answers"]["text"]]
        scores["no_answer_f1"] = mean(unanswerable, "f1")
        if answerable:
            scores["has_answer_f1"] = mean(answerable, "f1")
    return scores


def _collate(features: Sequence[Feature], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded tensors (position 0 stays the null position)."""
    length = max(len(f.inputs["input_ids"]) for f in features)
    batch = {}
    for key in features[0].inputs:
        fill = pad_id if key == "input_ids" else 0
        rows = [f.inputs[key] + [fill] * (length - len(f.inputs[key])) for f in features]
        batch[key] = torch.tensor(rows, dtype=torch.long, device=device)
    return batch


@torch.no_grad()
def _logits(model: SpanModel, features: Sequence[Feature], pad_id: int,
            config: FinetuneConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each feature's start and end logits over its own tokens: batches of similar length
    (:func:`finetuning.by_length`), each batch's logits copied to the host once all are queued."""
    model.eval()
    scored = []
    for positions, chunk in finetuning.by_length(features, lambda f: len(f.inputs["input_ids"]), config.batch_size):
        with finetuning.autocast(config):
            start, end = model(**_collate(chunk, pad_id, config.torch_device))
        scored.append((positions, chunk, start, end))
    by_position = {}
    for positions, chunk, start, end in scored:
        start, end = start.cpu().numpy(), end.cpu().numpy()
        for j, (position, feature) in enumerate(zip(positions, chunk, strict=True)):
            n = len(feature.inputs["input_ids"])
            by_position[position] = (start[j, :n], end[j, :n])
    return [by_position[position] for position in range(len(features))]


def run(model_dir: str, task_dir: Path, config: FinetuneConfig) -> RunResult:
    """Fine-tune ``model_dir`` on the task's train split; F1 on validation and test."""
    began = time.perf_counter()
    splits = {split: SCHEMA.read(task_dir, split) for split in ("train", "validation", "test")}
    for split in ("validation", "test"):
        splits[split] = eval_subset(splits[split], config.max_eval_examples)
    for split, rows in splits.items():
        check_answers(rows, f"{task_dir} {split}")
    # SQuAD v2 style when the training data teaches the null answer.
    allow_empty = any(not row["answers"]["text"] for row in splits["train"])

    finetuning.set_seed(config.seed)
    tokenizer, encoder = finetuning.load_encoder(model_dir, config)
    # Windows of the run's input length: config.max_length capped by the model's positions.
    features = {split: prepare_features(tokenizer, rows, max_length=tokenizer.model_max_length)
                for split, rows in splits.items()}
    model = SpanModel(encoder).to(config.torch_device, config.weights_dtype)
    pad_id = tokenizer.pad_token_id

    def span_loss(m: SpanModel, batch: list[Feature]) -> torch.Tensor:
        start, end = m(**_collate(batch, pad_id, config.torch_device))
        start_target = torch.tensor([f.start for f in batch], device=start.device)
        end_target = torch.tensor([f.end for f in batch], device=end.device)
        return (F.cross_entropy(start, start_target) + F.cross_entropy(end, end_target)) / 2

    steps = config.steps_for(len(features["train"]))
    losses = finetuning.finetune(model, finetuning.cycle_batches(features["train"], config.batch_size, config.seed),
                               config=config, total_steps=steps, loss_fn=span_loss,
                               desc=f"qa lr={config.lr:g} seed={config.seed}")

    scores, per_example = {}, {}
    for split in ("validation", "test"):
        logits = _logits(model, features[split], pad_id, config)
        answers = decode(splits[split], features[split], logits, allow_empty=allow_empty)
        texts = {k: a.text for k, a in answers.items()}
        per_question = question_scores(texts, splits[split])
        scores[split] = squad_scores(texts, splits[split], per_question)
        per_example[split] = {question: values[METRIC] for question, values in per_question.items()}
    extra = {f"{split}_{name}": value
             for split in scores for name, value in scores[split].items() if name != METRIC}
    extra.update({f"{split}_examples": float(len(splits[split])) for split in scores})
    return RunResult(metric=METRIC, validation=scores["validation"][METRIC], test=scores["test"][METRIC],
                     steps=steps, seconds=time.perf_counter() - began, extra=extra, losses=losses,
                     per_example=per_example)


FAMILY = Family(schema=SCHEMA, title="question answering", paper=True, metric=METRIC, run=run,
                leak_key=lambda row: row["question"])
