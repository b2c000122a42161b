"""The paper's benchmarks from the Hugging Face hub, converted to the harness's task directories.

The paper (arXiv 2507.00994) fine-tunes with EncodEval (github.com/hgissbkh/EncodEval, branch
``MLM_vs_CLM``): :data:`BENCHMARKS` names, for each of its tasks, the hub datasets that
EncodEval's ``encodeval/datasets.py`` loads (commit 7e03774), how their columns map onto our
per-family schema (each family's ``SCHEMA``, :mod:`megatron_ext.eval.families`), the labels, the metric and the
split. :func:`prepare_benchmarks` loads them and writes ``<suite dir>/<task>/`` (``<split>.jsonl``
and ``task.json``) so :mod:`megatron_ext.eval.harness` and the families run them unchanged.

Where the datasets come from, in order (:func:`load_source`):

1. a local copy under ``benchmarks_dir``: ``<dataset id>/<config or default>/<split>/`` written by
   ``Dataset.save_to_disk`` (what ``tools/fetch_benchmarks.py`` writes for air-gapped clusters),
   parquet files ``<split>.parquet``, ``<split>-*.parquet`` or ``<split>/*.parquet`` there, or a
   clone of the hub repository at ``<dataset id>/`` (with its ``README.md``; read with
   ``load_dataset(<that folder>, config, split=...)``);
2. the hub through ``datasets.load_dataset``: online, or from the Hugging Face cache when
   ``HF_HUB_OFFLINE=1``.

Without either, :func:`prepare_benchmarks` fails before loading anything, naming the dataset ids
and the fetch command (``datasets`` itself would retry the unreachable hub for half a minute).

Splits follow EncodEval: sequence classification and QA take 5 % of the official train split as
validation (``Dataset.train_test_split(train_size=0.95, seed=42)``, the same call, so the same
rows) and test on the official validation split (MNLI: ``validation_matched``); token
classification keeps the official train/validation/test; retrieval trains on MS MARCO pairs and
tests on each benchmark's qrels (docs/eval_suite.md, "The paper's benchmarks").
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from megatron_ext.config_loading import UserError
from megatron_ext.eval.families import FAMILIES
from megatron_ext.eval.hub_conversion import (Benchmark, Source, convert_beir, convert_mldr, convert_qa, convert_sc,
                                             convert_tc)
from megatron_ext.eval.family import TASK_FILE
from megatron_ext.fileio import publish_dir, staged_dir, write_files

CONVERSION_VERSION = 1
"""Bumped when a conversion changes; a converted task of another version is converted again."""
ENCODEVAL = "hgissbkh/EncodEval@MLM_vs_CLM (7e03774) encodeval/datasets.py"
"""Where the dataset ids and splits are taken from."""


# ----------------------------------------------------------------------------- definitions


def _glue(config: str, test_split: str, template: str, columns: Mapping[str, str], labels: tuple[str, ...],
          encodeval: str) -> Benchmark:
    return Benchmark(
        name=config, family="sc", metric="accuracy",
        sources={"train": Source(dataset="nyu-mll/glue", config=config, split="train"),
                 "test": Source(dataset="nyu-mll/glue", config=config, split=test_split)},
        columns={"id": "idx", **columns, "label": "label"}, convert=convert_sc, labels=labels,
        text_template=template, encodeval=encodeval,
        split_protocol=f"validation = 5 % of train (train_test_split(train_size=0.95, seed=42)); test = {test_split}",
    )


def _tc(name: str, dataset: str, tokens: str, tags: str, labels: tuple[str, ...], encodeval: str,
        notes: str = "") -> Benchmark:
    return Benchmark(
        name=name, family="tc", metric="f1",
        sources={split: Source(dataset=dataset, split=split) for split in ("train", "validation", "test")},
        columns={"id": "idx if present, else <split>-<row>", "tokens": tokens, "tags": tags},
        convert=convert_tc, labels=labels, encodeval=encodeval, notes=notes,
        split_protocol="the dataset's own train / validation / test (EncodEval cuts nothing for TC)",
    )


def _qa(name: str, dataset: str, encodeval: str, notes: str = "") -> Benchmark:
    return Benchmark(
        name=name, family="qa", metric="f1",
        sources={"train": Source(dataset=dataset, split="train"),
                 "test": Source(dataset=dataset, split="validation")},
        columns={"id": "id if present, else <split>-<row>", "context": "context", "question": "question",
                 "answers": "answers {text: [...], answer_start: [...]}"},
        convert=convert_qa, encodeval=encodeval, notes=notes,
        split_protocol="validation = 5 % of train (train_test_split(train_size=0.95, seed=42)); test = validation",
    )


MSMARCO_PAIRS = Source(dataset="hgissbkh/msmarco-pairs", split="train")
"""EncodEval's retrieval training set (``msmarco_pairs()``): (query, positive) pairs."""
_IR_TRAIN = f"all of {MSMARCO_PAIRS.dataset} (EncodEval's msmarco_pairs(), no validation cut)"

def _beir(name: str, qrels: Mapping[str, Source], passage_template: str, encodeval: str, splits: str) -> Benchmark:
    return Benchmark(
        name=name, family="ir", metric="ndcg@10",
        sources={"pairs": MSMARCO_PAIRS,
                 "queries": Source(dataset=f"BeIR/{name}", config="queries", split="queries"),
                 "corpus": Source(dataset=f"BeIR/{name}", config="corpus", split="corpus"), **qrels},
        columns={"query": "'Query: ' + queries.text", "relevance": "qrels corpus-id with score >= 1 -> 1",
                 "corpus text": f"'Document: ' + {passage_template!r}.format(title, text)",
                 "train": "'Query: ' + pairs.query, 'Document: ' + pairs.positive"},
        convert=convert_beir, passage_template=passage_template,
        encodeval=f"msmarco_pairs() (train), {encodeval} (evaluation)",
        split_protocol=f"train = {_IR_TRAIN}; {splits}; corpus = every passage the qrels judge",
    )


CONLL2003_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")
ONTONOTES5_LABELS = (
    "O", "B-CARDINAL", "B-DATE", "I-DATE", "B-PERSON", "I-PERSON", "B-NORP", "B-GPE", "I-GPE", "B-LAW", "I-LAW",
    "B-ORG", "I-ORG", "B-PERCENT", "I-PERCENT", "B-ORDINAL", "B-MONEY", "I-MONEY", "B-WORK_OF_ART",
    "I-WORK_OF_ART", "B-FAC", "B-TIME", "I-CARDINAL", "B-LOC", "B-QUANTITY", "I-QUANTITY", "I-NORP", "I-LOC",
    "B-PRODUCT", "I-TIME", "B-EVENT", "I-EVENT", "I-FAC", "B-LANGUAGE", "I-PRODUCT", "I-ORDINAL", "I-LANGUAGE",
)
"""OntoNotes 5 tag ids as in tner/ontonotes5's ``label.json`` (37 tags), which ``hgissbkh/ontonotes5``
stores as bare integers in ``tags``."""
UNER_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC")

BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    _glue("sst2", "validation", "{sentence}", {"text": "sentence"}, ("negative", "positive"), "sst2()"),
    _glue("qqp", "validation", "Question 1: {question1}\nQuestion 2: {question2}",
          {"text": "'Question 1: {question1}\\nQuestion 2: {question2}'"}, ("not_duplicate", "duplicate"), "qqp()"),
    _glue("mnli", "validation_matched", "Premise: {premise}\nHypothesis: {hypothesis}",
          {"text": "'Premise: {premise}\\nHypothesis: {hypothesis}'"}, ("entailment", "neutral", "contradiction"),
          "mnli_m()"),
    _tc("conll2003", "hgissbkh/conll2003-en", "words", "ner", CONLL2003_LABELS, "conll2003_en()"),
    _tc("ontonotes", "hgissbkh/ontonotes5", "tokens", "tags", ONTONOTES5_LABELS, "ontonotes()",
        notes="tags are integers; names from tner/ontonotes5's label.json unless the features carry a ClassLabel"),
    _tc("uner", "hgissbkh/uner_en", "tokens", "ner_tags", UNER_LABELS, "uner_en()",
        notes="Universal NER English (EWT); EncodEval drops idx, text, annotator; we keep idx as the row id"),
    _qa("squad", "rajpurkar/squad", "squad()"),
    _qa("squad_v2", "rajpurkar/squad_v2", "squad_v2()"),
    _qa("record", "hgissbkh/record", "record()",
        notes="EncodEval's SQuAD-format copy of SuperGLUE ReCoRD (context, question, answers)"),
    _qa("qed", "hgissbkh/qed", "qed()", notes="EncodEval runs it; the paper reports SQuAD, SQuAD v2 and ReCoRD"),
    _beir("msmarco", {"qrels_validation": Source(dataset="BeIR/msmarco-qrels", split="validation"),
                      "qrels_test": Source(dataset="BeIR/msmarco-qrels", split="test")},
          "{text}", "msmarco()", "validation = qrels validation (MS MARCO dev); test = qrels test (TREC DL 2019)"),
    _beir("nq", {"qrels": Source(dataset="BeIR/nq-qrels", split="test")},
          "{title}. {text}", "nq()", "the test qrels' queries halved into validation and test "
                                     "(random.Random(42).sample of the sorted ids)"),
    Benchmark(
        name="mldr", family="ir", metric="ndcg@10",
        sources={"pairs": MSMARCO_PAIRS,
                 "qrels_validation": Source(dataset="hgissbkh/mldr-en", config="default", split="dev"),
                 "qrels_test": Source(dataset="hgissbkh/mldr-en", config="default", split="test"),
                 "corpus": Source(dataset="hgissbkh/mldr-en", config="corpus", split="corpus")},
        columns={"query": "'Query: ' + query", "relevance": "positive_passages[].docid -> 1",
                 "corpus text": "'Document: ' + corpus.text", "train": "MS MARCO pairs, prefixed"},
        convert=convert_mldr, encodeval="msmarco_pairs() (train), mldr_en() (evaluation)",
        split_protocol=f"train = {_IR_TRAIN}; validation = dev; test = test; corpus = the positive passages "
                       "of dev and test",
    ),
)}
"""The paper's tasks and QED, by name."""

PAPER_TASKS = ("sst2", "qqp", "mnli", "conll2003", "ontonotes", "uner", "squad", "squad_v2", "record",
               "msmarco", "nq", "mldr")
"""What the paper reports (``--tasks paper``); ``qed``, which EncodEval also runs, is named alone."""
TASK_GROUPS: dict[str, tuple[str, ...]] = {"paper": PAPER_TASKS}
"""Names that stand for several tasks on the command line."""


def expand_tasks(tasks: Sequence[str]) -> list[str]:
    """``tasks`` with each group name (:data:`TASK_GROUPS`) replaced by its tasks, repeats dropped."""
    return list(dict.fromkeys(t for task in tasks for t in TASK_GROUPS.get(task, (task,))))


# ----------------------------------------------------------------------------- loading


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_offline() -> bool:
    """Whether the user asked ``datasets`` to read the Hugging Face cache only."""
    return any(os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE")
               for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub opens within ``timeout`` (False in offline mode)."""
    if hub_offline():
        return False
    url = urlparse(hub_endpoint())
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
    except OSError:
        return False
    return True


def _parquet_files(config_dir: Path, split: str) -> list[str]:
    """``<split>.parquet``, ``<split>-*.parquet`` (the hub's shard names) or ``<split>/*.parquet``."""
    patterns = (f"{split}.parquet", f"{split}-*.parquet", f"{split}/*.parquet")
    return [str(p) for pattern in patterns for p in sorted(config_dir.glob(pattern))]


def local_copy(source: Source, benchmarks_dir: Path | None) -> tuple[str, Path] | None:
    """The kind (``save_to_disk``, ``parquet``, ``repo``) and path of a local copy of ``source``."""
    if benchmarks_dir is None:
        return None
    repo = Path(benchmarks_dir) / source.dataset
    config_dir = repo / (source.config or "default")
    if (config_dir / source.split / "state.json").is_file():
        return "save_to_disk", config_dir / source.split
    if _parquet_files(config_dir, source.split):
        return "parquet", config_dir
    # A clone of the hub repository has its dataset card (or git attributes) at the top; a folder
    # that only holds other configs' copies is not one.
    if not config_dir.is_dir() and any((repo / marker).is_file() for marker in ("README.md", ".gitattributes")):
        return "repo", repo
    return None


PARQUET_REVISION = "refs/convert/parquet"
"""The hub's automatic parquet export of a dataset repository."""


def _hub_load(source: Source):
    """``datasets.load_dataset`` of one split from the hub (or its cache in offline mode).

    EncodEval loads ``hgissbkh/ontonotes5``, ``hgissbkh/mldr-en`` and the BEIR sets with
    ``trust_remote_code=True``; ``datasets`` >= 4 runs no loading scripts, so a repository that
    still has one is read from the hub's parquet export of the same data instead.
    """
    import datasets

    try:
        return datasets.load_dataset(source.dataset, source.config, split=source.split)
    except RuntimeError as err:
        if "scripts are no longer supported" not in str(err):
            raise
        return datasets.load_dataset(source.dataset, source.config, split=source.split, revision=PARQUET_REVISION)


def load_source(source: Source, benchmarks_dir: Path | None = None):
    """One split as a ``datasets.Dataset``: from ``benchmarks_dir`` when it holds a copy, else the hub."""
    import datasets

    found = local_copy(source, benchmarks_dir)
    if found is not None:
        kind, path = found
        if kind == "save_to_disk":
            return datasets.load_from_disk(str(path), keep_in_memory=False)
        if kind == "parquet":
            # The features (ClassLabel names included) come back from the parquet schema metadata.
            return datasets.Dataset.from_parquet(_parquet_files(path, source.split), keep_in_memory=False)
        return datasets.load_dataset(str(path), source.config, split=source.split)
    return _hub_load(source)


def fetch_command(names: Iterable[str]) -> str:
    return f"python tools/fetch_benchmarks.py --tasks {' '.join(names)} --output-dir DIR"


def missing_error(missing: Mapping[str, list[Source]], benchmarks_dir: Path | None, reason: str) -> UserError:
    """The error for benchmarks whose data is neither local nor on a reachable hub."""
    lines = [f"{name} needs " + "; ".join(s.describe() for s in sources) for name, sources in missing.items()]
    where = f"no copy under --benchmarks-dir {benchmarks_dir}" if benchmarks_dir else "no --benchmarks-dir given"
    return UserError(
        f"benchmark data not available ({where}; {reason}):\n  " + "\n  ".join(lines) +
        f"\nOn a machine with network access run\n  {fetch_command(missing)}\n"
        "copy DIR to this machine and pass --benchmarks-dir DIR (or set HF_HUB_OFFLINE=1 if the datasets "
        "are in this machine's Hugging Face cache)."
    )


# ----------------------------------------------------------------------------- task directories


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")


def is_converted(task_dir: Path) -> bool:
    """Whether ``task_dir`` holds a conversion of the current version."""
    meta_path = task_dir / TASK_FILE
    if not meta_path.is_file():
        return False
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    return meta.get("benchmark", {}).get("conversion_version") == CONVERSION_VERSION


def render(bench: Benchmark, loaded: Mapping[str, Any], origins: Mapping[str, str]) -> dict[str, bytes]:
    """File name -> bytes of ``bench``'s task directory (``task.json`` last)."""
    converted = bench.convert(bench, loaded)
    labels = converted.pop("labels", None) or list(bench.labels)
    notes = converted.pop("notes", {})
    empty = [split for split, rows in converted.items() if not rows]
    if empty:
        raise UserError(f"benchmark {bench.name}: split(s) {empty} came out empty")
    files = {f"{split}.jsonl": _jsonl(rows) for split, rows in converted.items()}
    meta = {
        "name": bench.name, "family": bench.family, "metric": bench.metric, "labels": labels,
        "description": f"{bench.name} from the Hugging Face hub, converted as EncodEval loads it",
        "splits": {split: {"file": f"{split}.jsonl", "rows": len(rows),
                           "sha256": hashlib.sha256(files[f"{split}.jsonl"]).hexdigest(),
                           "columns": list(FAMILIES[bench.family].schema.required(split))}
                   for split, rows in converted.items()},
        "benchmark": {
            "conversion_version": CONVERSION_VERSION, "encodeval": f"{ENCODEVAL}: {bench.encodeval}",
            "sources": {role: {"dataset": s.dataset, "config": s.config, "split": s.split,
                               "loaded_from": origins[role]} for role, s in bench.sources.items()},
            "columns": dict(bench.columns), "split_protocol": bench.split_protocol, "notes": bench.notes,
            "conversion": notes,
        },
    }
    files[TASK_FILE] = (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return files


def check_available(names: Sequence[str], benchmarks_dir: Path | None, *, reachable: bool | None = None) -> None:
    """Raise :func:`missing_error` when a source of ``names`` is neither local nor loadable from the hub."""
    missing = {}
    for name in names:
        sources = [s for s in BENCHMARKS[name].sources.values() if local_copy(s, benchmarks_dir) is None]
        if sources:
            missing[name] = sources
    if not missing or hub_offline():  # offline mode: the cache is read, and a miss is reported by load
        return
    if reachable is None:
        reachable = hub_reachable()
    if not reachable:
        raise missing_error(missing, benchmarks_dir, f"the Hugging Face hub ({hub_endpoint()}) is not reachable")


def prepare_benchmarks(names: Sequence[str], output_dir: str | Path, benchmarks_dir: str | Path | None = None,
                       *, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Convert each of ``names`` into ``output_dir/<name>`` unless a current conversion is there.

    Every source must be local (``benchmarks_dir``) or on a reachable hub, checked for all of
    ``names`` before anything is loaded. Returns the task directories.
    """
    output_dir = Path(output_dir)
    benchmarks_dir = Path(benchmarks_dir) if benchmarks_dir is not None else None
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise UserError(f"unknown benchmark(s) {unknown}; expected some of {sorted(BENCHMARKS)}")
    todo = [n for n in names if not is_converted(output_dir / n)]
    check_available(todo, benchmarks_dir)
    for name in todo:
        bench = BENCHMARKS[name]
        task_dir = output_dir / name
        if (task_dir / TASK_FILE).is_file() and "benchmark" not in json.loads((task_dir / TASK_FILE).read_text()):
            raise UserError(f"{task_dir} holds a task that is not a conversion of benchmark {name}; "
                            "move it or use another --suite-dir")
        loaded, origins = {}, {}
        for role, source in bench.sources.items():
            found = local_copy(source, benchmarks_dir)
            origins[role] = f"{found[0]}: {found[1]}" if found else f"hub: {source.dataset}"
            log(f"{name}: loading {source.describe()} from {origins[role]}")
            try:
                loaded[role] = load_source(source, benchmarks_dir)
            except (ConnectionError, FileNotFoundError, OSError) as err:
                raise missing_error({name: [source]}, benchmarks_dir, f"loading failed: {err}") from None
        files = render(bench, loaded, origins)
        # A stale conversion (older version) is ours to replace.
        write_files({task_dir / f: data for f, data in files.items()}, overwrite=True)
        sizes = {f.removesuffix(".jsonl"): data.count(b"\n") for f, data in files.items() if f != TASK_FILE}
        log(f"{name}: wrote {task_dir} ({', '.join(f'{split} {rows:,}' for split, rows in sizes.items())} rows)")
    return {name: output_dir / name for name in names}


def fetch(names: Sequence[str], output_dir: str | Path, *, log: Callable[[str], None] = print) -> list[Path]:
    """Download every source of ``names`` from the hub into ``output_dir`` (``save_to_disk``), for
    :func:`load_source` on a machine without network. Copies already there are kept."""
    output_dir = Path(output_dir)
    sources = list(dict.fromkeys(s for name in expand_tasks(names) for s in BENCHMARKS[name].sources.values()))
    written = []
    for source in sources:
        target = output_dir / source.dataset / (source.config or "default") / source.split
        if local_copy(source, output_dir) is not None:
            log(f"have {source.describe()} in {target}")
            continue
        log(f"fetching {source.describe()}")
        dataset = _hub_load(source)
        with staged_dir(target) as tmp:  # complete copies only: state.json marks a finished save
            dataset.save_to_disk(str(tmp))
            # What is at target lacks state.json (local_copy found none): an unfinished copy, ours to replace.
            publish_dir(tmp, target, overwrite=True, identical_ok=True)
        log(f"  {len(dataset):,} rows -> {target}")
        written.append(target)
    return written

