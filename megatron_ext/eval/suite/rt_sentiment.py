"""SC: ``rt_sentiment``, Rotten Tomatoes snippets with mean human sentiment, binarised like SST-2."""

from __future__ import annotations

import tarfile

from megatron_ext import assets
from megatron_ext.eval.families import FAMILIES
from megatron_ext.eval.suite.base import TaskData, TaskSpec
from megatron_ext.eval.suite.common import VADER_MEMBER, VADER_MOVIES

SST_NEUTRAL_BAND = 0.8
"""SST-2 drops phrases whose sentiment is in (0.4, 0.6] on SST's [0, 1] scale; mapped linearly
onto VADER's [-4, 4] mean ratings that band is (-0.8, 0.8]."""


def _build_rt_sentiment() -> TaskData:
    archive = assets.member("vader-sdist", VADER_MEMBER)
    with tarfile.open(archive) as tf, tf.extractfile(VADER_MOVIES) as f:
        raw = f.read().decode("utf-8")
    kept: dict[str, tuple[str, dict]] = {}
    conflicting: set[str] = set()
    neutral = duplicates = 0
    for line_no, line in enumerate(raw.splitlines(), start=1):
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(f"{VADER_MOVIES} line {line_no}: expected 3 tab-separated fields")
        snippet_id, score, text = fields[0], float(fields[1]), " ".join(fields[2].split())
        if -SST_NEUTRAL_BAND < score <= SST_NEUTRAL_BAND:
            neutral += 1
            continue
        label = int(score > SST_NEUTRAL_BAND)
        key = FAMILIES["sc"].leak_key({"text": text})  # duplicates as the leak check sees them
        if key in kept:
            duplicates += 1
            if kept[key][1]["label"] != label:
                conflicting.add(key)
            continue
        kept[key] = (f"rt:{snippet_id}", {
            "id": f"rt:{snippet_id}", "doc": f"rt:{snippet_id}", "text": text, "label": label,
            "score": score,
        })
    examples = [example for key, example in kept.items() if key not in conflicting]

    def stats(rows: list[dict]) -> dict:
        positive = sum(r["label"] for r in rows)
        return {"negative": len(rows) - positive, "positive": positive,
                "positive_share": round(positive / len(rows), 4) if rows else 0.0}

    return TaskData(documents=[doc for doc, _ in kept.values()], examples=examples, stats=stats, notes={
        "snippets": len(raw.splitlines()), "dropped_neutral": neutral, "dropped_duplicates": duplicates,
        "dropped_conflicting_duplicates": len(conflicting),
    })


TASKS = (
    TaskSpec(
        name="rt_sentiment", family="sc", metric="accuracy", labels=("negative", "positive"),
        description="Rotten Tomatoes snippets, binary sentiment from mean human ratings (SST-2-like)",
        sources=(("vader-sdist", f"{VADER_MEMBER}/{VADER_MOVIES}"),),
        license="MIT (vaderSentiment 3.3.2 package, Hutto & Gilbert 2014 ratings); snippets from "
                "Pang & Lee's rottentomatoes.com sentence polarity data (research use)",
        construction=(
            "10,605 review snippets (Pang & Lee's sentence polarity data, the source of SST) with the "
            "mean of >= 20 human ratings in [-4, 4]. Binarised like SST-2, which keeps sentences "
            "whose sentiment falls in [0, 0.4] (negative) or (0.6, 1] (positive) on SST's scale and "
            "drops the neutral band: mapped linearly onto [-4, 4], negative <= -0.8 < neutral <= 0.8 "
            "< positive. Whitespace collapsed; duplicates (same words, case-insensitive) dropped, "
            "all copies when their labels disagree. Label 0 = negative, 1 = positive, as in SST-2."
        ),
        test_fraction=0.15, split_key="rt", build=_build_rt_sentiment,
    ),
)
