"""STS (an extra zero-shot check): ``lee_sts``, human document-similarity ratings of news."""

from __future__ import annotations

import statistics

from megatron_ext import assets
from megatron_ext.eval.suite.base import TaskData, TaskSpec
from megatron_ext.eval.suite.common import LEE_LICENSE, LEE_MEMBER, LEE_SIMILARITIES_MEMBER

def _build_lee_sts() -> TaskData:
    raw = assets.member("gensim", LEE_MEMBER).read_bytes().decode("latin-1")
    docs = [" ".join(line.split()) for line in raw.splitlines()]
    lines = assets.member("gensim", LEE_SIMILARITIES_MEMBER).read_text(encoding="utf-8").splitlines()
    matrix = [[float(v) for v in line.split()] for line in lines]
    if len(docs) != 50 or len(matrix) != 50 or any(len(row) != 50 for row in matrix):
        raise ValueError(f"{LEE_SIMILARITIES_MEMBER}: expected 50 documents and a 50x50 matrix")
    examples = []
    for i in range(50):
        for j in range(i + 1, 50):  # the file holds the upper triangle
            pair = f"lee:{i + 1:02d}-{j + 1:02d}"
            examples.append((pair, {"id": pair, "doc": pair, "text": docs[i], "text_pair": docs[j],
                                    "score": matrix[i][j]}))

    def stats(rows: list[dict]) -> dict:
        scores = [r["score"] for r in rows]
        return {"score_mean": round(statistics.mean(scores), 4), "score_min": min(scores),
                "score_max": max(scores)}

    return TaskData(documents=[doc for doc, _ in examples], examples=examples, stats=stats)


TASKS = (
    TaskSpec(
        name="lee_sts", family="sts", metric="Spearman correlation (zero-shot, cosine of embeddings)",
        labels=(),
        description="50 news documents, 1,225 pairs with mean human similarity ratings (Lee et al. 2005)",
        sources=(("gensim", LEE_MEMBER), ("gensim", LEE_SIMILARITIES_MEMBER)), license=LEE_LICENSE,
        construction=(
            "An extra zero-shot check of the IR embeddings, not one of the paper's families: every "
            "pair of the 50 Lee documents with its similarity rating in [0, 1] (upper triangle of "
            "the 50x50 matrix). Test split only."
        ),
        test_fraction=0.0, split_key="lee_sts", build=_build_lee_sts,
    ),
)
