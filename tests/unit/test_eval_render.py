"""The evaluation summary of a real mixed-family grid, byte for byte, and the study report reading it back.

``data/mixed_grid/records.json`` holds the run records of a real grid: four models (all-MiniLM-L6-v2
cut to one layer, the same with noised weights, and a tiny Megatron MLM encoder at steps 1 and 2 of
one save directory, ``NAME@all``) on five tasks of the offline suite, one per family (rt_sentiment
SC, wiki_mentions TC, news_cloze_v2 QA, wiki_sections IR, lee_sts zero-shot STS), LRs 1e-4 and 1e6
(which diverges for the MiniLMs, 19 runs in all) x seeds 0 and 1, 3 steps of batch 8, 128 tokens, 16
scored examples: ``harness.evaluate_models`` (``tools/evaluate.py``) wrote them in 14 minutes on 2
CPU cores. Only their validation per-example scores (which nothing aggregates) and local paths were
dropped. ``data/mixed_grid/summary.*`` are the summary files the
harness wrote for that grid before it was split into grid, aggregation and renderer: the
aggregation and the renderer must give them again, byte for byte (their Monte Carlo p-values rewritten
once, when the paired test became scipy's ``permutation_test``: the same clusters, p-values within
their Monte Carlo error, tests/unit/test_eval_ranking.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.eval import aggregation, grid, render
from megatron_ext.eval.finetuning import FinetuneConfig
from megatron_ext.study.report_scores import seed_score

DATA = Path(__file__).resolve().parents[1] / "data" / "mixed_grid"


@pytest.fixture(scope="module")
def mixed_grid(tmp_path_factory) -> dict:
    """The records as the harness reads them, aggregated and ranked, and the summary files rendered."""
    stored = json.loads((DATA / "records.json").read_text(encoding="utf-8"))
    out = tmp_path_factory.mktemp("mixed_grid")
    models = {name: grid.ModelRef(name=name, hf_dir=Path(name), source=name, **fields)
              for name, fields in stored["models"].items()}
    tasks = {name: grid.TaskRef(name=name, task_dir=Path(name), **fields) for name, fields in stored["tasks"].items()}
    records = []
    for data in stored["records"]:
        spec = grid.RunSpec(model=models[data["model"]], task=tasks[data["task"]],
                            config=FinetuneConfig(**data["config"]),
                            path=grid.run_path(out, data["model"], data["task"], data["lr"], data["seed"]))
        records.append(grid.RunRecord.from_json(spec, data))
    results, rankings = aggregation.aggregate_grid(records, stored["lrs"], stored["seeds"])
    files = render.summary_files(out, results, stored["lrs"], stored["seeds"], rankings)
    return {"results": results, "rankings": rankings, "files": files, "records": records}


@pytest.mark.parametrize("name", ["summary.md", "summary.csv", "summary.json"])
def test_the_summary_of_a_mixed_grid_is_byte_identical(mixed_grid, name):
    assert mixed_grid["files"][name] == (DATA / name).read_text(encoding="utf-8")


def test_every_family_is_in_the_grid_and_the_study_report_reads_the_same_results(mixed_grid):
    results = mixed_grid["results"]
    assert {r.family for r in results} == {"sc", "tc", "qa", "ir", "sts"}
    assert any(record.status == "diverged" for record in mixed_grid["records"])
    assert {task for task in mixed_grid["rankings"]} == {"rt_sentiment", "wiki_mentions", "news_cloze_v2",
                                                           "wiki_sections"}  # STS has no per-example scores
    # The study report reads summary.json's rows back into the harness's results (without the
    # per-example scores) and prints a task's score with the same cell.
    rows = json.loads(mixed_grid["files"]["summary.json"])["results"]
    for row, result in zip(rows, results, strict=True):
        again = aggregation.TaskResult.from_json(row)
        assert again == aggregation.TaskResult(**{**result.__dict__, "test_examples": {}})
        score = seed_score([[again]])
        assert score.mean == result.test_mean
        assert score.ci95 == pytest.approx(result.test_ci95)  # one task: its own interval over seeds
        if len(result.best_lr_scores.seeds) > 1:
            assert render.pm(result.test_mean, result.test_ci95) in mixed_grid["files"]["summary.md"]
