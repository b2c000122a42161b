"""Zero-shot STS (``megatron_ext.eval.families.sts``): the correlations against known values with ties,
real encoders on the suite's lee_sts (a trained sentence encoder correlates, a random one does not),
the harness running STS beside an SC task (one run, no LR or seeds; summary and study report keep it
apart from the paper's families), and STS-B files converted to tasks or refused with file:line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from megatron_ext.config_loading import UserError
from megatron_ext.eval import grid, harness
from megatron_ext.eval.families import FAMILIES, sts
from megatron_ext.eval.finetuning import FinetuneConfig
from megatron_ext.eval.suite import build_task
from megatron_ext.eval.task_io import TASK_FILE, default_suite_dir, load_task
from megatron_ext.study.report_files import column_title
from megatron_ext.study.report_join import evaluated_models, family_tasks, read_summaries
from megatron_ext.study.report_scores import AVERAGE, model_scores

from eval_fixtures import TINY


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def suite() -> Path:
    root = default_suite_dir()
    for name in ("rt_sentiment", "lee_sts"):
        if not (root / name / TASK_FILE).is_file():
            build_task(name, root)
    return root


def _average_ranks(values: list[float]) -> np.ndarray:
    """1-based ranks, tied values sharing the mean of the ranks they span (written out, not scipy's)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = np.empty(len(values))
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in order[start:end + 1]:
            ranks[position] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def test_correlations_with_ties_match_known_values_and_scipy():
    # ranks of x with a tie: 1, 2.5, 2.5, 4; of y: 1, 2, 3, 4 -> covariance 4.5 / sqrt(4.5 * 5) = 3 / sqrt(10)
    assert sts.correlations([1.0, 2.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0], where="t")["spearman"] == pytest.approx(
        100 * 3 / math.sqrt(10))
    assert sts.correlations([3.0, 2.0, 1.0], [0.1, 0.5, 0.9], where="t") == pytest.approx(
        {"spearman": -100.0, "pearson": -100.0})
    rng = np.random.default_rng(0)
    predicted = rng.integers(0, 6, size=200).astype(float).tolist()  # many ties on both sides
    gold = (np.array(predicted) + rng.integers(0, 4, size=200)).tolist()
    got = sts.correlations(predicted, gold, where="t")
    by_hand = np.corrcoef(_average_ranks(predicted), _average_ranks(gold))[0, 1]
    assert got["spearman"] == pytest.approx(100 * by_hand) == pytest.approx(100 * stats.spearmanr(predicted, gold)[0])
    assert got["pearson"] == pytest.approx(100 * np.corrcoef(predicted, gold)[0, 1])
    with pytest.raises(UserError, match=r"task x: every gold score is 0.5: no correlation is defined"):
        sts.correlations([0.1, 0.2, 0.3], [0.5, 0.5, 0.5], where="task x")
    with pytest.raises(UserError, match="at least 2 pairs"):
        sts.correlations([0.1], [0.5], where="task x")


def test_a_sentence_encoder_correlates_on_lee_sts_and_a_random_one_does_not(suite, minilm_dir, tmp_path):
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    config = FinetuneConfig(lr=0.0, seed=0, device="cpu", max_length=128, batch_size=16)
    trained = sts.run(str(minilm_dir), suite / "lee_sts", config)
    assert trained.metric == "spearman" and trained.steps == 0 and trained.extra["test_pairs"] == 1225
    assert trained.test > 40.0 and trained.extra["test_pearson"] > 40.0  # 50.4 and 65.4 measured
    # all-MiniLM-L6-v2's own pooling (modules.json) is mean pooling: cosines equal the mean-pooled ones.
    assert trained.extra["own_pooling"] == 1.0
    assert trained.extra["test_spearman_mean_pooling"] == pytest.approx(trained.test, abs=1e-3)
    assert trained.validation == trained.test and trained.extra["validation_is_test"] == 1.0  # test-only task

    torch.manual_seed(0)
    random_dir = tmp_path / "random"
    AutoModel.from_config(AutoConfig.from_pretrained(minilm_dir, num_hidden_layers=2)).save_pretrained(random_dir)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(random_dir)
    untrained = sts.run(str(random_dir), suite / "lee_sts", config)
    assert untrained.extra["own_pooling"] == 0.0  # a bare HF directory: mean pooling
    assert abs(untrained.test) < 20.0 and trained.test - untrained.test > 30.0  # 5.5 measured


@pytest.fixture(scope="module")
def mixed_grid(tmp_path_factory, suite, minilm_dir):
    """An SC task over 2 LRs x 1 seed and lee_sts, on all-MiniLM-L6-v2 cut to one layer."""
    from transformers import AutoModel, AutoTokenizer

    encoder = tmp_path_factory.mktemp("minilm_l1")
    AutoModel.from_pretrained(minilm_dir, num_hidden_layers=1).save_pretrained(encoder)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(encoder)
    out = tmp_path_factory.mktemp("grid")
    evaluation = harness.evaluate_models([f"minilm={encoder}"], ["rt_sentiment", "lee_sts"], output_dir=out,
                                         lrs=(2e-5, 1e-4), seeds=(0,), overrides=TINY, suite_dir=suite)
    return evaluation, out, encoder


def test_the_harness_runs_sts_once_beside_an_sc_grid(mixed_grid, suite):
    evaluation, out, encoder = mixed_grid
    assert FAMILIES["sts"].grid((1e-5, 1e-4), (0, 1, 2)) == ((0.0,), (0,))
    assert (evaluation.executed, evaluation.reused) == (3, 0)  # 2 SC runs, 1 STS run
    assert sorted(p.name for p in (out / "runs" / "minilm" / "lee_sts").iterdir()) == ["lr0_seed0.json"]
    record = json.loads((out / "runs" / "minilm" / "lee_sts" / "lr0_seed0.json").read_text())
    assert record["family"] == "sts" and record["steps"] == 0 and record["config"]["lr"] == 0.0
    assert record["extra"]["test_pairs"] == TINY["max_eval_examples"]

    summary = json.loads((out / "summary.json").read_text())
    rows = {row["task"]: row for row in summary["results"]}
    assert [row["runs"] for row in rows.values()] == [2, 1]
    similarity = rows["lee_sts"]
    assert (similarity["family"], similarity["metric"], similarity["best_lr"]) == ("sts", "spearman", 0.0)
    assert similarity["test_mean"] == record["test"] and similarity["test_ci95"] is None
    assert "lee_sts" not in summary["rankings"]  # no per-example scores to rank on
    markdown = (out / "summary.md").read_text()
    assert f"| minilm | lee_sts | spearman | zero-shot | {record['test']:.2f} |" in markdown
    assert "Zero-shot tasks (lee_sts; not the paper's)" in markdown
    assert "## rt_sentiment: score vs learning rate" in markdown
    assert "## lee_sts: score vs learning rate" not in markdown
    assert (out / "plots" / "rt_sentiment.png").is_file() and not (out / "plots" / "lee_sts.png").exists()

    again = harness.evaluate_models([f"minilm={encoder}"], ["rt_sentiment", "lee_sts"], output_dir=out,
                                    lrs=(2e-5, 1e-4), seeds=(0,), overrides=TINY, suite_dir=suite)
    assert (again.executed, again.reused) == (0, 3)

    # The study report: a family column of its own, marked, and out of the paper's average.
    models = evaluated_models(read_summaries([out], log=lambda line: None))
    tasks = family_tasks(models)
    assert tasks == {"sc": ("rt_sentiment",), "sts": ("lee_sts",)}
    scores = model_scores(models[0], tasks)
    assert scores["sts"].mean == pytest.approx(record["test"])
    assert scores[AVERAGE].mean == pytest.approx(scores["sc"].mean)
    assert column_title("sts") == "similarity (extra, not the paper's)"
    assert column_title("sc") == "sequence classification"


def test_fine_tuning_families_refuse_lr_0():
    assert FAMILIES["sts"].zero_shot and not FAMILIES["sc"].zero_shot
    with pytest.raises(UserError, match="fine-tuning LRs must be > 0, got 0"):
        grid.finetune_config("sc", 0.0, 0, {})
    with pytest.raises(UserError, match="lr must be > 0"):
        FinetuneConfig(lr=-1e-5, seed=0)


def test_an_sts_file_becomes_a_task_and_malformed_ones_name_file_and_line(tmp_path, capsys):
    glue = tmp_path / "sts-test.tsv"  # GLUE's STS-B layout: extra columns, quotes left as they are
    glue.write_text("index\tgenre\tsentence1\tsentence2\tscore\n"
                    "0\tmain-captions\tA plane is taking off.\tAn air plane is taking off.\t5.000\n"
                    '1\tmain-captions\tA man says "hi.\tA man plays a flute.\t0.8\n\n', encoding="utf-8")
    assert sts.main([str(glue), "--output-dir", str(tmp_path / "tasks")]) == 0
    task_dir = tmp_path / "tasks" / "stsb"
    assert str(task_dir) in capsys.readouterr().out
    assert json.loads((task_dir / TASK_FILE).read_text())["family"] == "sts"
    assert load_task(task_dir, "test") == [
        {"id": "sts-test:2", "text": "A plane is taking off.", "text_pair": "An air plane is taking off.", "score": 5.0},
        {"id": "sts-test:3", "text": 'A man says "hi.', "text_pair": "A man plays a flute.", "score": 0.8}]
    assert sts.convert_sts_file(glue, tmp_path / "tasks") == task_dir  # identical outputs: left alone

    csv_file = tmp_path / "pairs.csv"
    csv_file.write_text('sentence1,sentence2,score\n"One, two",Three,1\nFour,Five,2.5\n', encoding="utf-8")
    assert sts.read_sts_file(csv_file)[0]["text"] == "One, two"
    for content, error in (
        ("sentence1\tsentence2\tlabel\na\tb\t1\n", r"bad.tsv:1: header lacks column\(s\) score"),
        ("sentence1\tsentence2\tscore\na\tb\t1\nc\td\thigh\n", r"bad.tsv:3: score 'high' is not a finite number"),
        ("sentence1\tsentence2\tscore\na\tb\t1\nc\td\n", r"bad.tsv:3: 2 fields, the header has 3"),
        ("sentence1\tsentence2\tscore\na\tb\t1\n\tb\t2\n", r"bad.tsv:3: sentence1 and sentence2 must be non-empty"),
    ):
        bad = tmp_path / "bad.tsv"
        bad.write_text(content, encoding="utf-8")
        with pytest.raises(UserError, match=error):
            sts.read_sts_file(bad)
    assert sts.main([str(bad), "--output-dir", str(tmp_path / "tasks"), "--name", "bad"]) == 2
    assert "bad.tsv:3: sentence1 and sentence2 must be non-empty" in capsys.readouterr().err
