"""Semantic textual similarity (STS), zero-shot: how well the encoder's embeddings rank pairs of texts
the way people rated them. Not one of the paper's families (EncodEval fine-tunes every task); an extra
check of the embeddings that the suite's ``lee_sts`` and a local copy of STS-B feed.

Nothing is trained, so the harness runs one evaluation per model and task, not the LR x seed grid
(its :data:`FAMILY` is ``zero_shot``). Each distinct text of a split is
encoded once by ``SentenceTransformer(model_dir)`` (:func:`~megatron_ext.eval.families.ir.load_bi_encoder`:
the run's device, dtype and input length; causal LMs refused) and every pair is scored by the cosine
similarity of its two embeddings. Two poolings:

- the model directory's own sentence-transformers pooling when it has one (a ``modules.json``:
  e.g. all-MiniLM-L6-v2's mean pooling and normalisation, or a CLS-pooled model's CLS): the
  headline score, since that is how such a model is meant to be used;
- the mean of the last hidden states over real tokens (:func:`~megatron_ext.eval.finetuning.mean_pool`),
  always, as ``<split>_spearman_mean_pooling``: the same pooling for every model (and the headline
  for a bare Hugging Face directory or an export, where sentence-transformers adds mean pooling).

Scores (:func:`correlations`): Spearman's rank correlation with the gold ratings (the metric,
``spearman``; ties get their average rank, scipy's ``spearmanr``) and Pearson's (``<split>_pearson``),
both x 100 like the other families' 0-100 metrics, so they range over [-100, 100]. The test split is
required; a ``validation`` split, when the task has one, is scored too. Nothing is selected on it,
so without one the run's validation score is the test score and ``extra`` says so
(``validation_is_test``: 1). No per-example scores are saved: a correlation is a property of the whole
split, so the harness does not rank models on STS tasks.

A local copy of STS-B (or any STS set) becomes a task directory with :func:`convert_sts_file`,
or from the command line::

    python -m megatron_ext.eval.families.sts sts-test.tsv --output-dir DIR [--name stsb]

The file is CSV (``.csv``) or tab-separated (``.tsv``, read without quote handling, as GLUE's
STS-B files need), UTF-8, with a header row naming at least the columns ``sentence1``,
``sentence2`` and ``score`` (other columns, e.g. GLUE's ``genre``, are ignored); every other row is
one pair with a finite numeric score (STS-B: 0-5). All rows form the ``test`` split.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_ext.config_loading import UserError
from megatron_ext.eval import finetuning
from megatron_ext.eval.finetuning import FinetuneConfig, RunResult, eval_subset
from megatron_ext.eval.family import TASK_FILE, Family, TaskSchema
from megatron_ext.fileio import write_files

SCHEMA = TaskSchema(family="sts", columns=("id", "text", "text_pair", "score"))
"""Pairs of texts and their gold similarity rating (any finite scale: STS-B's 0-5)."""
METRIC = "spearman"
"""The family's metric: Spearman's rank correlation x 100."""
SCORED_SPLITS = ("validation", "test")
"""Splits a run scores: ``test`` always, ``validation`` when the task has it."""
STS_FILE_COLUMNS = ("sentence1", "sentence2", "score")
"""Columns a file for :func:`convert_sts_file` must have."""


def correlations(predicted: Sequence[float], gold: Sequence[float], *, where: str) -> dict[str, float]:
    """Spearman's and Pearson's correlation (x 100) of ``predicted`` with ``gold``.

    Spearman's is Pearson's correlation of the ranks, tied values getting the mean of the ranks
    they span (``scipy.stats.spearmanr``). Fewer than two pairs, non-finite values or a constant
    side (no correlation is defined) are errors naming ``where``.
    """
    from scipy import stats

    if len(predicted) != len(gold):
        raise ValueError(f"{where}: {len(predicted)} predictions for {len(gold)} gold scores")
    if len(gold) < 2:
        raise UserError(f"{where}: a correlation needs at least 2 pairs, got {len(gold)}")
    for name, values in (("predicted", predicted), ("gold", gold)):
        if not all(math.isfinite(value) for value in values):
            raise UserError(f"{where}: {name} scores include non-finite values")
        if min(values) == max(values):
            raise UserError(f"{where}: every {name} score is {values[0]!r}: no correlation is defined")
    return {"spearman": 100.0 * float(stats.spearmanr(predicted, gold).statistic),
            "pearson": 100.0 * float(stats.pearsonr(predicted, gold).statistic)}


def has_own_pooling(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` is a sentence-transformers model (``modules.json``) with its own pooling."""
    return (Path(model_dir) / "modules.json").is_file()


@torch.no_grad()
def embed(model: Any, texts: Sequence[str], config: FinetuneConfig, *, where: str
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(own, mean)`` float32 embeddings of ``texts``, in order: the sentence-transformers model's
    own output (its pooling and any layers after it) and the mean of its token states over real
    tokens, both from one forward pass per batch (batches of similar length: :func:`finetuning.by_length`).
    ``where``: the model folder, for errors."""
    from sentence_transformers.util import batch_to_device

    model.eval()  # SentenceTransformer loads in training mode: dropout would make the scores random
    order: list[int] = []
    own, mean = [], []
    for positions, batch in finetuning.by_length(list(texts), len, config.batch_size):
        features = batch_to_device(model.preprocess(batch), config.torch_device)
        with finetuning.autocast(config):
            out = model(features)
        if "token_embeddings" not in out:
            raise UserError(f"{where}: its sentence-transformers modules output no token_embeddings "
                            "to mean-pool (STS needs a transformer encoder)")
        order += positions
        own.append(out["sentence_embedding"].float().cpu())
        mean.append(finetuning.mean_pool(out["token_embeddings"].float(), out["attention_mask"]).cpu())
    back = torch.empty(len(order), dtype=torch.long)
    back[torch.tensor(order)] = torch.arange(len(order))  # batch order -> the order of texts
    return torch.cat(own)[back], torch.cat(mean)[back]


def pair_similarities(rows: Sequence[dict], texts: Sequence[str], embeddings: torch.Tensor) -> list[float]:
    """Cosine similarity of each row's ``text`` and ``text_pair`` embeddings (rows of ``embeddings``
    are ``texts``'s)."""
    index = {text: i for i, text in enumerate(texts)}
    left = embeddings[[index[row["text"]] for row in rows]]
    right = embeddings[[index[row["text_pair"]] for row in rows]]
    return torch.nn.functional.cosine_similarity(left, right, dim=-1).tolist()


def check_rows(rows: Sequence[dict], where: str) -> None:
    """Each row has non-empty texts and a finite numeric score."""
    for row in rows:
        score = row["score"]
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            raise UserError(f"{where} row {row['id']!r}: score must be a finite number, got {score!r}")
        for column in ("text", "text_pair"):
            if not isinstance(row[column], str) or not row[column].strip():
                raise UserError(f"{where} row {row['id']!r}: {column} must be a non-empty string")


def splits_present(task_dir: Path) -> tuple[str, ...]:
    """The splits a run scores (:data:`SCORED_SPLITS` whose file exists); the test split is required."""
    if not (Path(task_dir) / "test.jsonl").is_file():
        raise UserError(f"{task_dir}: an STS task needs a test.jsonl (rows id, text, text_pair, score)")
    return tuple(split for split in SCORED_SPLITS if (Path(task_dir) / f"{split}.jsonl").is_file())


def run(model_dir: str, task_dir: Path, config: FinetuneConfig) -> RunResult:
    """Score ``model_dir``'s embeddings, untrained, on the task's pairs: Spearman x 100 (module docstring)."""
    from megatron_ext.eval.families.ir import load_bi_encoder

    began = time.perf_counter()
    rows = {}
    for split in splits_present(task_dir):
        rows[split] = eval_subset(SCHEMA.read(task_dir, split), config.max_eval_examples)
        check_rows(rows[split], f"{task_dir} {split}")
    finetuning.set_seed(config.seed)  # nothing is random in eval mode; seeded all the same
    model = load_bi_encoder(model_dir, config)
    own_pooling = has_own_pooling(model_dir)
    scores: dict[str, dict[str, float]] = {}
    extra: dict[str, float] = {"own_pooling": float(own_pooling)}
    for split, split_rows in rows.items():
        texts = list(dict.fromkeys(text for row in split_rows for text in (row["text"], row["text_pair"])))
        own, mean = embed(model, texts, config, where=model_dir)
        gold = [float(row["score"]) for row in split_rows]
        where = f"{task_dir} {split}"
        by_mean = correlations(pair_similarities(split_rows, texts, mean), gold, where=f"{where} (mean pooling)")
        scores[split] = (correlations(pair_similarities(split_rows, texts, own), gold, where=where)
                         if own_pooling else by_mean)
        extra.update({f"{split}_pearson": scores[split]["pearson"],
                      f"{split}_spearman_mean_pooling": by_mean["spearman"],
                      f"{split}_pearson_mean_pooling": by_mean["pearson"],
                      f"{split}_pairs": float(len(split_rows))})
    validation = scores.get("validation", scores["test"])
    extra["validation_is_test"] = float("validation" not in scores)
    return RunResult(metric=METRIC, validation=validation["spearman"], test=scores["test"]["spearman"], steps=0,
                     seconds=time.perf_counter() - began, extra=extra)


# ----------------------------------------------------------------------------- STS files -> task directories


def read_sts_file(path: str | Path) -> list[dict]:
    """The pairs of a CSV/TSV STS file (module docstring) as rows ``id, text, text_pair, score``;
    ids are ``<file stem>:<line>``. Errors name the file and line."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".tsv"):
        raise UserError(f"{path}: expected a .csv or .tsv file with columns {', '.join(STS_FILE_COLUMNS)}")
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    dialect = {"delimiter": ","} if suffix == ".csv" else {"delimiter": "\t", "quoting": csv.QUOTE_NONE}
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, **dialect)
        header = next(reader, None)
        if header is None:
            raise UserError(f"{path}: empty file; expected a header row with {', '.join(STS_FILE_COLUMNS)}")
        header = [name.strip() for name in header]
        missing = [name for name in STS_FILE_COLUMNS if name not in header]
        if missing:
            raise UserError(f"{path}:1: header lacks column(s) {', '.join(missing)}; it has {header}")
        position = {name: header.index(name) for name in STS_FILE_COLUMNS}
        for fields in reader:
            line = reader.line_num
            if not any(field.strip() for field in fields):
                continue  # a blank line (e.g. at the end)
            if len(fields) != len(header):
                raise UserError(f"{path}:{line}: {len(fields)} fields, the header has {len(header)}")
            text, text_pair, raw_score = (fields[position[name]] for name in STS_FILE_COLUMNS)
            try:
                score = float(raw_score)
            except ValueError:
                score = math.nan
            if not math.isfinite(score):
                raise UserError(f"{path}:{line}: score {raw_score!r} is not a finite number")
            if not text.strip() or not text_pair.strip():
                raise UserError(f"{path}:{line}: sentence1 and sentence2 must be non-empty")
            rows.append({"id": f"{path.stem}:{line}", "text": text, "text_pair": text_pair, "score": score})
    if len(rows) < 2:
        raise UserError(f"{path}: {len(rows)} pair(s); a correlation needs at least 2")
    return rows


def convert_sts_file(path: str | Path, output_dir: str | Path, *, name: str = "stsb",
                     overwrite: bool = False) -> Path:
    """Write ``output_dir/name/`` (``test.jsonl`` and ``task.json``, family ``sts``) from a CSV/TSV
    STS file (:func:`read_sts_file`); returns that directory, a task for the harness. Identical
    existing outputs are left alone; differing ones are an error unless ``overwrite``."""
    rows = read_sts_file(path)
    test = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    scores = [row["score"] for row in rows]
    meta = {
        "name": name, "family": SCHEMA.family, "metric": "Spearman correlation x 100 (zero-shot, cosine of embeddings)",
        "labels": [], "description": f"sentence pairs with gold similarity scores from {Path(path).name}",
        "splits": {"test": {"file": "test.jsonl", "rows": len(rows), "sha256": hashlib.sha256(test).hexdigest(),
                            "columns": list(SCHEMA.required("test")),
                            "score_min": min(scores), "score_max": max(scores)}},
        "sources": [{"file": str(Path(path).resolve()),
                     "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}],
        "construction": "every row of the source file (header: sentence1, sentence2, score) is one test pair; "
                        "zero-shot, so there is no train or validation split",
    }
    task_dir = Path(output_dir) / name
    write_files({task_dir / "test.jsonl": test,  # task.json last: it vouches for the split
                 task_dir / TASK_FILE: (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode("utf-8")},
                overwrite=overwrite)
    return task_dir


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_ext.eval.families.sts FILE --output-dir DIR [--name NAME]``: convert an STS file."""
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.eval.families.sts",
                                     description="Convert a CSV/TSV STS file (sentence1, sentence2, score) into a "
                                                 "task directory for tools/evaluate.py --tasks")
    parser.add_argument("file", type=Path, help=".csv or .tsv with a header naming sentence1, sentence2, score")
    parser.add_argument("--output-dir", type=Path, required=True, help="the task goes to OUTPUT_DIR/NAME")
    parser.add_argument("--name", default="stsb", help="task name (default %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace a task directory with other contents")
    args = parser.parse_args(argv)
    try:
        task_dir = convert_sts_file(args.file, args.output_dir, name=args.name, overwrite=args.overwrite)
    except UserError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr, flush=True)
        return 2
    print(f"{task_dir}: {json.loads((task_dir / TASK_FILE).read_text())['splits']['test']['rows']} pairs; "
          f"evaluate with tools/evaluate.py --tasks {task_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


FAMILY = Family(schema=SCHEMA, title="similarity", paper=False, metric=METRIC, run=run, zero_shot=True,
                splits_scored=splits_present,
                score_note="STS scores are Spearman's correlation x 100 (-100 to 100) of the embeddings' cosine "
                           "similarities with the gold ratings.")
"""Not one of the paper's families: zero-shot, so no leak to check (nothing is trained on its splits)."""
