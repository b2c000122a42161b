"""The offline evaluation mini-suite: one task per EncodEval family, built from real registry text.

The paper evaluates encoders by fine-tuning on sequence classification (SC), token
classification (TC), extractive question answering (QA) and retrieval (IR) datasets from the
Hugging Face hub. The hub is out of reach here, so each family gets a small task built from
real text on package registries (fetched and sha256-verified through :mod:`megatron_ext.assets`)
the way a published benchmark of that family was built:

- ``rt_sentiment`` (SC): Rotten Tomatoes snippets with mean human sentiment, binarised like SST-2.
- ``wiki_mentions`` (TC): mention detection from Wikipedia links, like WikiNER.
- ``news_cloze`` / ``news_cloze_v2`` (QA): entity cloze over news, like CNN/Daily Mail and
  ReCoRD; v2 adds unanswerable queries, like SQuAD v2.
- ``wiki_sections`` (IR): section-heading queries against Wikipedia paragraphs, graded qrels.
- ``lee_sts`` (STS, an extra zero-shot check): human document-similarity ratings of news.

Each task directory holds one JSONL file per split and a ``task.json`` (family, metric, labels,
sizes, sources, license, construction). Splits follow the paper's protocol: a test split held out
by source document (the paper tests on the original validation sets), and 95/5 train/validation
from the rest, also by document. Outputs are byte-for-byte deterministic and written atomically.
This package builds the tasks (:data:`TASKS`, :func:`build_task`), one module per task's builder
(``rt_sentiment``, ``wiki_mentions``, ``news_cloze``, ``wiki_sections``, ``lee_sts``) as ``eval/families/``
holds one per family;
:func:`megatron_ext.eval.task_io.load_task` reads them, and local copies of the paper's datasets
converted to the same per-family schema (docs/eval_suite.md).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

from megatron_ext import assets
from megatron_ext.config_loading import UserError
from megatron_ext.eval.families import FAMILIES
from megatron_ext.eval.family import SPLITS, TASK_FILE
from megatron_ext.eval.suite import lee_sts, news_cloze, rt_sentiment, wiki_mentions, wiki_sections
from megatron_ext.eval.suite.base import VALIDATION_FRACTION, TaskData, TaskSpec
from megatron_ext.eval.suite.common import document_hash
from megatron_ext.eval.suite.news_cloze import PLACEHOLDER
from megatron_ext.fileio import write_files

__all__ = ["PLACEHOLDER", "TASKS", "TaskData", "TaskSpec", "assign_splits", "build_task"]

TASKS: dict[str, TaskSpec] = {spec.name: spec for module in (rt_sentiment, wiki_mentions, news_cloze, wiki_sections, lee_sts)
                              for spec in module.TASKS}
"""Every task of the suite by name, in the order of the families (SC, TC, QA, IR, STS)."""


def _spec(name: str) -> TaskSpec:
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    return TASKS[name]


def assign_splits(documents: Iterable[str], rows_per_document: Mapping[str, int], *, split_key: str,
                  test_fraction: float) -> dict[str, str]:
    """Split of each source document.

    Documents are ranked by a salted sha256 of their id. The first ``round(n * test_fraction)`` of
    the whole raw collection are test, so tasks over the same documents (and salt) share their test
    documents whatever rows each task draws from them. Following documents go to validation until
    it holds 5 % of the remaining rows (the paper's 95/5 split, by document); the rest is train.
    """
    ranked = sorted(set(documents), key=lambda doc: document_hash(split_key, doc))
    if test_fraction == 0:
        return dict.fromkeys(ranked, "test")
    n_test = round(len(ranked) * test_fraction)
    split_of = dict.fromkeys(ranked[:n_test], "test")
    target = VALIDATION_FRACTION * sum(rows_per_document.get(doc, 0) for doc in ranked[n_test:])
    held = 0
    for doc in ranked[n_test:]:
        if held < target and rows_per_document.get(doc, 0):
            split_of[doc] = "validation"
            held += rows_per_document[doc]
        else:
            split_of[doc] = "train"
    return split_of


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")


def _split(spec: TaskSpec, data: TaskData) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Rows per split (and the split of each document), checked for emptiness and leakage."""
    split_of = assign_splits(data.documents, Counter(doc for doc, _ in data.examples),
                             split_key=spec.split_key, test_fraction=spec.test_fraction)
    rows: dict[str, list[dict]] = {split: [] for split in spec.splits}
    for doc, row in data.examples:
        rows[split_of[doc]].append(row)
    if data.corpus is not None:
        rows["corpus"] = data.corpus
    empty = [split for split, split_rows in rows.items() if not split_rows]
    if empty:
        raise RuntimeError(f"task {spec.name!r}: splits {empty} came out empty")
    key = FAMILIES[spec.family].leak_key  # what the splits must not share beyond documents
    if key is not None and spec.test_fraction > 0:
        seen = {key(r) for split in ("train", "validation") for r in rows[split]}
        leaked = [r["id"] for r in rows["test"] if key(r) in seen]
        if leaked:
            raise RuntimeError(f"task {spec.name!r}: test rows {leaked[:5]} also occur in train/validation")
    return rows, split_of


def _render(spec: TaskSpec, data: TaskData) -> dict[str, bytes]:
    """File name -> content of the task directory, ``task.json`` last."""
    rows, split_of = _split(spec, data)
    files = {f"{split}.jsonl": _jsonl(split_rows) for split, split_rows in rows.items()}
    documents = Counter(split_of.values())
    meta = {
        "name": spec.name, "family": spec.family, "metric": spec.metric, "labels": list(spec.labels),
        "description": spec.description,
        "splits": {
            split: {
                "file": f"{split}.jsonl", "rows": len(split_rows),
                "sha256": hashlib.sha256(files[f"{split}.jsonl"]).hexdigest(),
                "columns": list(FAMILIES[spec.family].schema.required(split)),
                **({} if split == "corpus" else
                   {"documents": len({r["doc"] for r in split_rows}), **data.stats(split_rows)}),
            }
            for split, split_rows in rows.items()
        },
        "split_protocol": {
            "unit": "source document", "documents": {s: documents[s] for s in SPLITS if documents[s]},
            "test_fraction": spec.test_fraction,
            "validation_fraction": VALIDATION_FRACTION if spec.test_fraction else 0.0,
            "split_key": spec.split_key,
        },
        "build": data.notes,
        "sources": [
            {"asset": asset, "file": assets.ASSETS[asset].filename, "sha256": assets.ASSETS[asset].sha256,
             "member": member}
            for asset, member in spec.sources
        ],
        "license": spec.license, "construction": spec.construction,
    }
    files[TASK_FILE] = (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return files


def build_task(name: str, output_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Build task ``name`` into ``output_dir/name`` and return that directory.

    Identical existing outputs are left alone; differing ones are an error unless ``overwrite``.
    """
    spec = _spec(name)
    files = _render(spec, spec.build())
    task_dir = Path(output_dir) / name
    write_files({task_dir / filename: content for filename, content in files.items()},  # task.json last
                overwrite=overwrite)
    return task_dir
