"""Retrieval (MS MARCO-style training, NQ / MLDR-style evaluation; the suite's ``wiki_sections``).

A sentence-transformers bi-encoder (``SentenceTransformer(model_dir)``: the exports' mean pooling,
or mean pooling added for a bare HF encoder) is fine-tuned with InfoNCE over in-batch negatives
(``MultipleNegativesRankingLoss``: cosine similarity x 20, cross-entropy against the other
positives of the batch) on the task's (query, positive) pairs. The steps run through
:func:`finetuning.finetune` with the loss on the sentence-transformers model's forward, so optimizer,
schedule, clipping, seeding and precision are exactly the other families'. (The
sentence-transformers trainer would bring the transformers ``Trainer``, whose optimizer grouping,
scheduler and bf16 handling differ in the details.)

Evaluation encodes the queries and the whole corpus (passage ``text``, as the training positives
are), retrieves the top 10 passages by cosine similarity (``sentence_transformers.util.semantic_search``)
and scores them with trec_eval through ``pytrec_eval``: NDCG@10 with the graded relevance as gain
(sentence-transformers' ``InformationRetrievalEvaluator`` takes binary relevance only), MRR@10
and Recall@10 (relevant = grade >= 1).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from megatron_ext.config_loading import UserError
from megatron_ext.eval import finetuning
from megatron_ext.eval.finetuning import FinetuneConfig, RunResult, eval_subset
from megatron_ext.eval.family import TASK_FILE, Family, TaskSchema

SCHEMA = TaskSchema(family="ir", columns=("id", "query", "relevance"), train_columns=("id", "query", "positive"),
                    corpus=True)
"""Training needs (query, positive passage) pairs only, like MS MARCO's; validation and test need
graded ``relevance`` (passage id -> grade) for NDCG@10, against the ``corpus`` split's passages."""
METRIC = "ndcg@10"
TOP_K = 10
"""Cut-off of every reported metric (the paper's NDCG@10)."""
_MEASURES = {"ndcg@10": "ndcg_cut.10", "mrr@10": "recip_rank", "recall@10": "recall.10"}
"""Our names -> trec_eval's. The run holds only the top 10 passages, which makes trec_eval's
uncut ``recip_rank`` MRR@10 (NDCG@10 and Recall@10 are unchanged by the cut)."""


def retrieval_metrics(qrels: Mapping[str, Mapping[str, int]],
                      run: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Mean NDCG@10, MRR@10 and Recall@10 (0-100) over the queries of ``qrels``.

    ``qrels``: query id -> {passage id: grade > 0}; ``run``: query id -> {passage id: score}.
    NDCG uses the grade as gain and 1/log2(rank + 1) as discount (trec_eval's ``ndcg_cut``).
    """
    return mean_metrics(query_metrics(qrels, run))


def mean_metrics(per_query: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The mean of each metric of :func:`query_metrics` over its queries."""
    return {name: sum(values[name] for values in per_query.values()) / len(per_query) for name in _MEASURES}


def query_metrics(qrels: Mapping[str, Mapping[str, int]],
                  run: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Each query's NDCG@10, MRR@10 and Recall@10 (0-100), as :func:`retrieval_metrics` averages them."""
    import pytrec_eval

    missing = [q for q in qrels if q not in run]
    if missing:
        raise ValueError(f"no ranking for query(ies) {missing[:5]}")
    top = {q: dict(sorted(run[q].items(), key=lambda item: -item[1])[:TOP_K]) for q in qrels}
    evaluator = pytrec_eval.RelevanceEvaluator({q: dict(g) for q, g in qrels.items()},
                                               set(_MEASURES.values()))
    per_query = evaluator.evaluate(top)
    # trec_eval reports "ndcg_cut.10" as "ndcg_cut_10".
    return {q: {name: 100.0 * per_query[q][measure.replace(".", "_")] for name, measure in _MEASURES.items()}
            for q in qrels}


def qrels_of(rows: Sequence[dict], corpus_ids: set[str], where: str) -> dict[str, dict[str, int]]:
    """The graded qrels of validation/test rows, checked against the corpus."""
    qrels = {}
    for row in rows:
        relevance = row["relevance"]
        bad = {doc: grade for doc, grade in relevance.items()
               if doc not in corpus_ids or isinstance(grade, bool) or not isinstance(grade, int | float)
               or grade != int(grade) or grade < 1}
        if not relevance or bad:
            raise UserError(f"{where} row {row['id']!r}: relevance must map corpus ids to integer "
                            f"grades >= 1, got {dict(list((bad or relevance).items())[:5])}")
        if row["id"] in qrels:
            raise UserError(f"{where}: query id {row['id']!r} occurs twice")
        qrels[row["id"]] = {doc: int(grade) for doc, grade in relevance.items()}
    return qrels


def load_bi_encoder(model_dir: str, config: FinetuneConfig):
    """``SentenceTransformer(model_dir)`` in the run's weights dtype on its device, truncating at the run's
    input length (``finetuning.input_length``, as ``finetuning.load_encoder``).
    Causal LMs are refused as there: their ``AutoModel`` would attend causally."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    causal = [name for name in hf_config.architectures or [] if name.endswith("ForCausalLM")]
    if causal:
        raise UserError(f"{model_dir} is a causal LM ({causal[0]}): its AutoModel attends causally; "
                        "retrieval needs a bidirectional encoder (e.g. an export with --format eurobert)")
    with finetuning.held_load_reports() as reports:  # an encoder export's unused LM head is expected
        model = SentenceTransformer(str(model_dir), device=str(config.torch_device),
                                    model_kwargs={"dtype": config.weights_dtype})
    if any(status in record.getMessage() for record in reports.records for status in ("MISSING", "MISMATCH")):
        reports.release()  # the bare encoder it loads lacks weights of its own
    model.max_seq_length = finetuning.input_length(config, getattr(hf_config, "max_position_embeddings", None),
                                                 where=model_dir)
    return model


def _embed(model, texts: list[str], config: FinetuneConfig) -> torch.Tensor:
    with finetuning.autocast(config):
        embeddings = model.encode(texts, batch_size=config.batch_size, convert_to_tensor=True,
                                  normalize_embeddings=True, show_progress_bar=False)
    return embeddings.float()


def run(model_dir: str, task_dir: Path, config: FinetuneConfig) -> RunResult:
    """Fine-tune ``model_dir`` on the task's (query, positive) pairs; NDCG@10 on validation and test."""
    return run_shared([task_dir], model_dir, config)[0]


def training_key(task_dir: Path) -> str:
    """The content hash of a task's training pairs: tasks with the same key train the same model.
    Built tasks record it in ``task.json`` (written with the file); MS MARCO's pairs are hundreds
    of megabytes, so they are hashed here only for a task directory without one."""
    meta = Path(task_dir) / TASK_FILE
    if meta.is_file():
        recorded = json.loads(meta.read_text(encoding="utf-8")).get("splits", {}).get("train", {}).get("sha256")
        if recorded:
            return recorded
    return hashlib.sha256((Path(task_dir) / "train.jsonl").read_bytes()).hexdigest()


def run_shared(task_dirs: Sequence[Path], model_dir: str, config: FinetuneConfig) -> list[RunResult]:
    """Fine-tune once on the (query, positive) pairs the tasks share, then score that model on each
    task's validation and test queries against its corpus, as the paper does (EncodEval trains on
    MS MARCO pairs once per LR and seed and evaluates MS MARCO, NQ and MLDR with that model). Each
    result reports the shared training's steps, losses and time plus its own evaluation time."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.util import batch_to_device

    began = time.perf_counter()
    keys = {Path(task_dir): training_key(task_dir) for task_dir in task_dirs}
    if len(set(keys.values())) != 1:
        raise UserError(f"tasks {[str(d) for d in keys]} do not share their training pairs (train.jsonl differs)")
    train_rows = SCHEMA.read(task_dirs[0], "train")

    finetuning.set_seed(config.seed)
    model = load_bi_encoder(model_dir, config)
    infonce = MultipleNegativesRankingLoss(model)

    def loss_fn(m, batch: list[dict]) -> torch.Tensor:
        columns = [[row["query"] for row in batch], [row["positive"] for row in batch]]
        features = [batch_to_device(m.preprocess(texts), config.torch_device) for texts in columns]
        return infonce(features, None)

    steps = config.steps_for(len(train_rows))
    losses = finetuning.finetune(model, finetuning.cycle_batches(train_rows, config.batch_size, config.seed),
                               config=config, total_steps=steps, loss_fn=loss_fn,
                               desc=f"ir lr={config.lr:g} seed={config.seed}")
    trained = time.perf_counter() - began
    return [_score(model, Path(task_dir), config, steps=steps, losses=losses, trained_seconds=trained)
            for task_dir in task_dirs]


def _score(model, task_dir: Path, config: FinetuneConfig, *, steps: int, losses: list[float],
           trained_seconds: float) -> RunResult:
    """NDCG@10 (and MRR@10, Recall@10 as extras; per-query NDCG@10) of the fine-tuned ``model`` on a
    task's validation and test queries against its corpus; the result carries the training's
    ``steps`` and ``losses`` and, as its time, ``trained_seconds`` plus this scoring's."""
    from sentence_transformers.util import semantic_search

    began = time.perf_counter()

    corpus = SCHEMA.read(task_dir, "corpus")
    corpus_ids = [row["id"] for row in corpus]
    if len(set(corpus_ids)) != len(corpus_ids):
        raise UserError(f"{task_dir} corpus: passage ids are not unique")
    rows = {split: eval_subset(SCHEMA.read(task_dir, split), config.max_eval_examples)
            for split in ("validation", "test")}
    qrels = {split: qrels_of(split_rows, set(corpus_ids), f"{task_dir} {split}")
             for split, split_rows in rows.items()}
    with torch.no_grad():
        passages = _embed(model, [row["text"] for row in corpus], config)
        scores, per_example = {}, {}
        for split, split_rows in rows.items():
            hits = semantic_search(_embed(model, [row["query"] for row in split_rows], config), passages,
                                   top_k=TOP_K)
            ranking = {row["id"]: {corpus_ids[hit["corpus_id"]]: float(hit["score"]) for hit in found}
                       for row, found in zip(split_rows, hits, strict=True)}
            per_query = query_metrics(qrels[split], ranking)
            scores[split] = mean_metrics(per_query)
            per_example[split] = {query: values[METRIC] for query, values in per_query.items()}
    extra = {f"{split}_{name}": value
             for split in scores for name, value in scores[split].items() if name != METRIC}
    extra.update({f"{split}_examples": float(len(qrels[split])) for split in qrels})
    return RunResult(metric=METRIC, validation=scores["validation"][METRIC], test=scores["test"][METRIC],
                     steps=steps, seconds=trained_seconds + time.perf_counter() - began, extra=extra, losses=losses,
                     per_example=per_example)


FAMILY = Family(schema=SCHEMA, title="retrieval", paper=True, metric=METRIC, run=run,
                leak_key=lambda row: row["query"], training_key=training_key, run_shared=run_shared)
