"""Evaluation harness: SC/TC fine-tuning on a real encoder, the LR x seed grid, resumability,
aggregation (best LR, Student-t CI, diverged runs), reports, checkpoint export and user errors."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ext.config_loading import UserError
from megatron_ext.eval import aggregation, grid, harness, render
from megatron_ext.eval.families import FAMILIES, PAPER_FAMILIES, sc, tc
from megatron_ext.eval.finetuning import FinetuneConfig, eval_subset, load_encoder
from megatron_ext.eval.task_io import TASK_FILE, default_suite_dir, load_task
from megatron_ext.eval.suite import build_task
from megatron_ext.cli import evaluate
from eval_fixtures import TINY, encoder, suite  # noqa: F401 (fixtures)

LRS, SEEDS = (2e-5, 1e-4), (0, 1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sc_tc_grid(tmp_path_factory, suite, encoder):
    out = tmp_path_factory.mktemp("grid")
    evaluation = harness.evaluate_models([f"minilm={encoder}"], ["rt_sentiment", "wiki_mentions"], output_dir=out,
                                         lrs=LRS, seeds=SEEDS, overrides=TINY, suite_dir=suite)
    return evaluation, out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, news_texts) -> dict[str, Path]:
    """A Megatron save directory after 2 MLM steps of a tiny encoder, and its byte-level BPE tokenizer."""
    from megatron_ext.data.preprocess import PreprocessConfig, preprocess
    from megatron_ext.tokenizer import TokenizerConfig
    from megatron_ext.training.recipe import run_config_from_dict
    from megatron_ext.training.loop import pretrain
    from megatron_ext.cli import train_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    jsonl = root / "news.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in news_texts[:100]))
    assert train_tokenizer.main(["--input", str(jsonl), "--output-dir", str(root / "tok"),
                                 "--vocab-size", "1024", "--no-progress"]) == 0
    preprocess(PreprocessConfig(inputs=(str(jsonl),), output_prefix=str(root / "news"), append_eod=True,
                                tokenizer=TokenizerConfig(tokenizer_model=str(root / "tok")), progress=False))
    pretrain(run_config_from_dict({
        "model": {"preset": "tiny", "vocab_size": 1024, "num_layers": 2, "hidden_size": 64,
                  "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2},
        "tokenizer": {"tokenizer_model": str(root / "tok")},
        "data": {"data_path": [str(root / "news_text_document")], "split": "90,10,0", "seq_length": 64,
                 "micro_batch_size": 4, "global_batch_size": 4, "eval_iters": 1,
                 "data_cache_path": str(root / "cache")},
        "schedule": {"lr": 1e-3, "lr_decay_style": "constant"},
        "phases": [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}],
        "training": {"train_iters": 2, "eval_interval": 0, "log_interval": 1},
        "checkpoint": {"save": str(root / "mlm" / "ckpt")},
        "logging": {"log_dir": str(root / "log"), "wandb_mode": "disabled"},
    }))
    return {"save_dir": root / "mlm" / "ckpt", "tokenizer": root / "tok"}


def _runs(out: Path, task: str) -> dict[tuple[float, int], dict]:
    return {(lr, seed): json.loads(grid.run_path(out, "minilm", task, lr, seed).read_text())
            for lr in LRS for seed in SEEDS}


def test_grid_runs_sc_and_tc_and_writes_reports(sc_tc_grid):
    evaluation, out = sc_tc_grid
    assert (evaluation.executed, evaluation.reused) == (8, 0)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lrs"] == list(LRS) and summary["seeds"] == list(SEEDS)
    by_task = {r["task"]: r for r in summary["results"]}
    assert by_task["rt_sentiment"]["metric"] == "accuracy" and by_task["wiki_mentions"]["metric"] == "f1"
    for task, result in by_task.items():
        runs = _runs(out, task)
        for record in runs.values():
            assert record["status"] == "ok" and record["steps"] == 3 and record["config"]["max_steps"] == 3
            assert 0.0 <= record["validation"] <= 100.0 and 0.0 <= record["test"] <= 100.0
            assert math.isfinite(record["losses"]["first"]) and record["losses"]["min"] <= record["losses"]["last"]
            # Each scored example keeps its own score, and they average to the run's metric.
            for split in ("validation", "test"):
                examples = record["per_example"][split]
                scored = eval_subset(load_task(record["task_dir"], split), TINY["max_eval_examples"])
                assert list(examples) == [row["id"] for row in scored]
                assert all(0.0 <= value <= 100.0 for value in examples.values())
                if task == "rt_sentiment":  # accuracy is the mean of the examples' 0 or 100
                    assert set(examples.values()) <= {0.0, 100.0}
                    assert sum(examples.values()) / len(examples) == pytest.approx(record[split])
        # The best LR is the argmax of the mean validation score; test is averaged at that LR.
        val_means = {lr: (runs[lr, 0]["validation"] + runs[lr, 1]["validation"]) / 2 for lr in LRS}
        best = max(LRS, key=lambda lr: val_means[lr])
        assert result["best_lr"] == best
        tests = [runs[best, s]["test"] for s in SEEDS]
        assert result["test_mean"] == pytest.approx(sum(tests) / 2)
        # n = 2: t(0.975, 1) = 12.7062, std = |a - b| / sqrt(2), half-width = t * std / sqrt(2).
        assert result["test_ci95"] == pytest.approx(12.7062047 * abs(tests[0] - tests[1]) / 2)
        assert [p["lr"] for p in result["lr_curve"]] == list(LRS) and result["diverged_runs"] == 0
    tc_run = _runs(out, "wiki_mentions")[LRS[0], 0]
    assert {"validation_precision", "validation_recall", "test_precision", "test_recall"} <= set(tc_run["extra"])

    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [(r["model"], r["task"]) for r in rows] == [("minilm", "rt_sentiment"), ("minilm", "wiki_mentions")]
    assert float(rows[0]["best_lr"]) == by_task["rt_sentiment"]["best_lr"]
    assert float(rows[0]["test_mean"]) == pytest.approx(by_task["rt_sentiment"]["test_mean"])
    markdown = (out / "summary.md").read_text()
    assert "| minilm | rt_sentiment | accuracy |" in markdown and "0 of 8 runs" in markdown
    assert "![wiki_mentions](plots/wiki_mentions.png)" in markdown
    for task in by_task:
        png = (out / "plots" / f"{task}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_rerun_reuses_finished_runs_and_refuses_other_settings(sc_tc_grid, suite, encoder):
    evaluation, out = sc_tc_grid
    paths = sorted((out / "runs").rglob("*.json"))
    stamps = {p: p.stat().st_mtime_ns for p in paths}
    again = harness.evaluate_models([f"minilm={encoder}"], ["rt_sentiment", "wiki_mentions"], output_dir=out,
                                    lrs=LRS, seeds=SEEDS, overrides=TINY, suite_dir=suite)
    assert (again.executed, again.reused) == (0, 8) and again.results == evaluation.results
    assert {p: p.stat().st_mtime_ns for p in paths} == stamps

    with pytest.raises(ValueError, match=r"different config \(max_steps\)"):
        harness.evaluate_models([f"minilm={encoder}"], ["rt_sentiment"], output_dir=out, lrs=LRS, seeds=SEEDS,
                                overrides={**TINY, "max_steps": 5}, suite_dir=suite)
    other = shutil.copytree(encoder, out.parent / "other_minilm")
    with pytest.raises(ValueError, match="was made with model .* not .*other_minilm"):
        harness.evaluate_models([f"minilm={other}"], ["rt_sentiment"], output_dir=out, lrs=LRS, seeds=SEEDS,
                                overrides=TINY, suite_dir=suite)

    # An interrupted grid: only the missing run is fine-tuned.
    missing = grid.run_path(out, "minilm", "rt_sentiment", LRS[1], 1)
    missing.unlink()
    resumed = harness.evaluate_models([f"minilm={encoder}"], ["rt_sentiment"], output_dir=out, lrs=LRS,
                                      seeds=SEEDS, overrides=TINY, suite_dir=suite)
    assert (resumed.executed, resumed.reused) == (1, 3) and missing.is_file()


def test_diverged_run_is_recorded_and_scored_zero(tmp_path, suite, encoder):
    evaluation = harness.evaluate_models([f"minilm={encoder}"], ["rt_sentiment"], output_dir=tmp_path,
                                         lrs=(1e6,), seeds=(0,), overrides=TINY, suite_dir=suite)
    record = json.loads(grid.run_path(tmp_path, "minilm", "rt_sentiment", 1e6, 0).read_text())
    assert record["status"] == "diverged" and "non-finite loss" in record["error"]
    assert record["validation"] == record["test"] == 0.0 and record["losses"] is None
    (result,) = evaluation.results
    assert result.diverged_runs == 1 and result.test_mean == 0.0 and result.test_ci95 is None
    assert "1 of 1 runs" in (tmp_path / "summary.md").read_text()


TASK = grid.TaskRef(name="t", task_dir=Path("."), family="sc", metric="accuracy")


def _record(lr: float, seed: int, validation: float, test: float, status: str = "ok",
            per_example: dict | None = None) -> grid.RunRecord:
    spec = grid.RunSpec(model=grid.ModelRef(name="m", hf_dir=Path("m"), source="m", base_model="m",
                                                  checkpoint_step=None, pretrain_tokens=None), task=TASK,
                           config=FinetuneConfig(lr=lr, seed=seed), path=Path("run.json"))
    return grid.RunRecord(spec=spec, status=status, metric="accuracy" if status == "ok" else None,
                             validation=validation, test=test, steps=None, seconds=0.0, extra={},
                             per_example=per_example, losses=None)


def test_aggregate_best_lr_ci_and_diverged_zeros():
    task = TASK
    records = [
        _record(1e-5, 0, 80, 88), _record(1e-5, 1, 82, 90), _record(1e-5, 2, 84, 92),  # best test, not val
        _record(1e-4, 0, 85, 78), _record(1e-4, 1, 86, 80), _record(1e-4, 2, 90, 85),
        _record(1e-3, 0, 95, 95), _record(1e-3, 1, 0, 0, "diverged"), _record(1e-3, 2, 0, 0, "diverged"),
    ]
    result = aggregation.aggregate(records, (1e-5, 1e-4, 1e-3), task)
    # 1e-3 has the best single seed but two diverged seeds count as 0: mean validation 31.67 < 87.
    assert result.best_lr == 1e-4 and result.validation_mean == pytest.approx(87.0)
    # Test at 1e-4: 78, 80, 85 -> mean 81, sample variance 26 / 2 = 13; t(0.975, 2) = 4.302653.
    assert result.test_mean == pytest.approx(81.0) and result.test_std == pytest.approx(math.sqrt(13))
    assert result.test_ci95 == pytest.approx(4.302653 * math.sqrt(13) / math.sqrt(3), rel=1e-6)
    assert result.diverged_runs == 2 and result.lr_curve[2].test_mean == pytest.approx(95 / 3)
    assert result.best_lr_scores.test == (78, 80, 85)
    tie = aggregation.aggregate([_record(1e-5, 0, 50, 1), _record(1e-4, 0, 50, 2)], (1e-5, 1e-4), task)
    assert tie.best_lr == 1e-5 and tie.test_ci95 is None  # ties: smaller LR; one seed: no CI


def test_bf16_weights_by_default_with_bf16_as_the_paper_trains(suite, encoder):
    """With bf16 the model is held and updated in bfloat16 (EncodEval's dtype: bfloat16); a run
    trains and scores that way on CPU too. bf16_weights=False keeps float32 weights."""
    small = {key: value for key, value in TINY.items() if key != "max_steps"}
    paper = FinetuneConfig(lr=1e-4, seed=0, bf16=True, max_steps=2, **small)
    assert load_encoder(encoder, paper)[1].dtype == torch.bfloat16 == paper.weights_dtype
    assert load_encoder(encoder, dataclasses.replace(paper, bf16_weights=False))[1].dtype == torch.float32
    assert FinetuneConfig(lr=1e-4, seed=0, device="cpu").weights_dtype == torch.float32  # CPU: no bf16 unless asked
    result = sc.run(encoder, suite / "rt_sentiment", paper)
    assert result.steps == 2 and all(math.isfinite(loss) for loss in result.losses)
    assert 0.0 <= result.test <= 100.0


def test_sc_fine_tunes_the_models_own_head_by_default(suite, encoder):
    """The paper's protocol fine-tunes AutoModelForSequenceClassification; sc_head: mean_linear is
    a linear layer on mean-pooled states. Both train; they are different heads."""
    small = {key: value for key, value in TINY.items() if key != "max_steps"}
    config = FinetuneConfig(lr=1e-4, seed=0, max_steps=2, **small)
    assert type(load_encoder(encoder, config, num_labels=2)[1]).__name__ == "BertForSequenceClassification"
    own = sc.run(encoder, suite / "rt_sentiment", config)
    linear = sc.run(encoder, suite / "rt_sentiment", dataclasses.replace(config, sc_head="mean_linear"))
    assert own.steps == linear.steps == 2 and own.losses != linear.losses
    assert all(math.isfinite(loss) for loss in own.losses + linear.losses)
    with pytest.raises(ValueError, match="sc_head must be 'model' or 'mean_linear'"):
        FinetuneConfig(lr=1e-4, seed=0, sc_head="cls")


def test_input_length_is_99_percent_of_the_models_by_default():
    from megatron_ext.eval.finetuning import input_length

    paper = FinetuneConfig(lr=1e-5, seed=0)
    assert input_length(paper, 2048, where="m") == 2028 and input_length(paper, 512, where="m") == 507
    assert input_length(FinetuneConfig(lr=1e-5, seed=0, max_length=256), 2048, where="m") == 256
    assert input_length(FinetuneConfig(lr=1e-5, seed=0, max_length=4096), 2048, where="m") == 2048
    with pytest.raises(ValueError, match="m: config.json has no max_position_embeddings.*--max-length"):
        input_length(paper, None, where="m")
    with pytest.raises(ValueError, match="max_length must be >= 8"):
        FinetuneConfig(lr=1e-5, seed=0, max_length=4)


def test_models_are_ranked_on_their_test_examples():
    """Per task, models that no paired test separates share a rank; one model alone is not ranked.
    A diverged seed scores every example 0, as it scores the split."""
    ok = _record(1e-5, 0, 100, 100, per_example={"test": {str(i): 100.0 for i in range(40)}})
    assert aggregation._mean_examples([ok, _record(1e-5, 1, 0, 0, "diverged")], "test") == {
        str(i): 50.0 for i in range(40)}
    best = {str(i): 100.0 for i in range(40)}
    half = {str(i): 100.0 * (i % 2) for i in range(40)}

    def result(model: str, task: str, test_examples: dict) -> aggregation.TaskResult:
        return aggregation.TaskResult(
            model=model, base_model=model, checkpoint_step=None, pretrain_tokens=None, task=task, family="sc",
            metric="accuracy", best_lr=1e-5, test_mean=1.0, test_ci95=None,
            test_std=None, validation_mean=1.0, validation_std=None, seeds=1, diverged_runs=0, runs=1,
            best_lr_scores=aggregation.BestLRScores(seeds=(0,), validation=(1.0,), test=(1.0,)), lr_curve=(),
            test_examples=test_examples)

    results = [result("a", "t", best), result("b", "t", half), result("c", "t", dict(best)), result("a", "u", best)]
    ranked, rankings = aggregation.rank_models(results)
    assert [(ranked.system, ranked.rank) for ranked in rankings["t"]] == [("a", 1), ("c", 1), ("b", 2)]
    assert [r.rank for r in ranked] == [1, 2, 1, None] and "u" not in rankings
    assert [r.rank for r in results] == [None] * 4  # the results themselves are left as they were
    markdown = render.summary_markdown(ranked, [1e-5], [0], rankings)
    assert "## t: ranking" in markdown and "## u: ranking" not in markdown


def test_metrics_and_tags_on_known_values(suite):
    gold = [["B-ENT", "I-ENT", "O", "B-ENT"], ["O", "B-ENT", "I-ENT"]]
    pred = [["B-ENT", "I-ENT", "O", "O"], ["O", "B-ENT", "O"]]  # 1 of 3 gold entities right, 2 predicted
    assert tc.entity_scores(gold, pred) == pytest.approx({"f1": 40.0, "precision": 50.0, "recall": 100 / 3})
    # Per sentence: 1 of 2 gold right with 1 predicted -> F1 2/3; 0 of 1 right with 1 predicted -> 0.
    assert [tc.sentence_f1(g, p) for g, p in zip(gold, pred)] == pytest.approx([200 / 3, 0.0])
    assert tc.sentence_f1(["O", "O"], ["O", "O"]) == 100.0 and tc.sentence_f1(["O"], ["B-ENT"]) == 0.0
    assert tc.entity_scores(gold, gold)["f1"] == 100.0
    # Integer tags (a hub dataset's ner_tags) become the task's tag names; foreign tags are refused.
    rows = [{"id": "a", "tokens": ["Ned", "Kelly"], "tags": [1, 2]}, {"id": "b", "tokens": ["x"], "tags": ["O"]}]
    assert tc.tag_names(suite / "wiki_mentions", rows) == ["O", "B-ENT", "I-ENT"]
    assert rows[0]["tags"] == ["B-ENT", "I-ENT"]
    with pytest.raises(ValueError, match=r"row 'c' has tag\(s\) \['B-PER'\] outside the tag set"):
        tc.tag_names(suite / "wiki_mentions", [{"id": "c", "tokens": ["Ned"], "tags": ["B-PER"]}])
    rows = list(range(100))
    subset = eval_subset(rows, 10)
    assert len(subset) == 10 and subset == sorted(subset) and subset != rows[:10] and eval_subset(rows, 10) == subset


WORDS = ["Robespierre", "denounced", "the", "Hébertists", "(", "U.S.", ")", "in", "1793", "."]


@pytest.mark.parametrize("kind", ["wordpiece", "byte_level_bpe"])
def test_token_alignment_labels_first_sub_token_of_each_word(kind, encoder, tiny_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(encoder if kind == "wordpiece" else tiny_checkpoint["tokenizer"])
    inputs, (first,) = tc.encode(tokenizer, [{"tokens": WORDS}], torch.device("cpu"))
    ids = inputs["input_ids"][0].tolist()
    assert all(p >= 0 for p in first) and first == sorted(first) and len(set(first)) == len(WORDS)
    for word, position, end in zip(WORDS, first, first[1:] + [len(ids) - 1]):  # the last id is </s> / [SEP]
        # The word's sub-tokens (byte-level BPE: a trailing space token may follow), decoded.
        decoded = tokenizer.decode(ids[position:end]).replace(" ", "")
        assert decoded == (word.lower().replace("é", "e") if kind == "wordpiece" else word)


def test_sentence_pairs(tmp_path, suite, encoder):
    """An MNLI/QQP-shaped task (text + text_pair) from real snippets: same sentiment or not."""
    rows = {split: load_task("rt_sentiment", split, suite_dir=suite)[:40] for split in ("train", "validation", "test")}
    task_dir = tmp_path / "rt_pairs"
    task_dir.mkdir()
    for split, split_rows in rows.items():
        pairs = [{"id": f"{a['id']}+{b['id']}", "text": a["text"], "text_pair": b["text"],
                  "label": int(a["label"] == b["label"])} for a, b in zip(split_rows[::2], split_rows[1::2])]
        (task_dir / f"{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (task_dir / "task.json").write_text(json.dumps({"family": "sc", "metric": "accuracy",
                                                    "labels": ["different", "same"]}))
    tokenizer, _ = load_encoder(encoder, FinetuneConfig(lr=1e-4, seed=0, device="cpu"))
    batch = sc.encode(tokenizer, load_task(task_dir, "train")[:3], torch.device("cpu"))
    assert (batch["token_type_ids"] == 1).any(dim=1).all()  # the second segment is marked
    assert ((batch["input_ids"] == tokenizer.sep_token_id).sum(dim=1) == 2).all()
    result = sc.run(encoder, task_dir, FinetuneConfig(lr=1e-4, seed=0, **{**TINY, "max_steps": 2}))
    assert result.metric == "accuracy" and result.steps == 2 and 0 <= result.test <= 100 and len(result.losses) == 2


def test_family_registry_and_defaults(tmp_path):
    # One module per family, in the reports' order; each says what the rest of the package asks.
    assert list(FAMILIES) == ["sc", "tc", "qa", "ir", "sts"] and PAPER_FAMILIES == ("sc", "tc", "qa", "ir")
    assert [FAMILIES[name].metric for name in FAMILIES] == ["accuracy", "f1", "f1", "ndcg@10", "spearman"]
    assert all(family.leak_key is not None for family in FAMILIES.values() if family.paper)
    assert [name for name, family in FAMILIES.items() if family.training_key] == ["ir"]
    assert FAMILIES["ir"].schema.required("train") == ("id", "query", "positive")
    assert FAMILIES["ir"].schema.splits(test_only=True) == ("test", "corpus")
    (tmp_path / "train.jsonl").write_text('{"id": "q1", "query": "a"}\n')
    with pytest.raises(UserError, match=r"line 1: missing column\(s\) \['positive'\] required for family 'ir'"):
        FAMILIES["ir"].schema.read(tmp_path, "train")
    with pytest.raises(ValueError, match="training_key and run_shared come together"):
        dataclasses.replace(FAMILIES["sc"], training_key=lambda task_dir: "same")
    assert grid.finetune_config("tc", 1e-4, 0, {}).steps_for(2294) == round(2294 / 32)  # one epoch
    assert grid.finetune_config("tc", 1e-4, 0, {"max_steps": 7}).steps_for(2294) == 7
    assert grid.finetune_config("sc", 1e-4, 0, {}).steps_for(7745) == 1000
    with pytest.raises(ValueError, match=r"unknown FinetuneConfig override\(s\) \['max_step'\]"):
        grid.finetune_config("sc", 1e-4, 0, {"max_step": 3})
    assert {"rt_sentiment", "lee_sts"} <= set(evaluate.default_tasks())  # lee_sts: zero-shot STS


def test_user_errors_name_the_culprit(tmp_path, suite, encoder):
    def evaluate_models(models, tasks):
        return harness.evaluate_models(models, tasks, output_dir=tmp_path / "out", lrs=(1e-4,), seeds=(0,),
                                       overrides=TINY, suite_dir=suite)

    # sst2 is one of the paper's benchmarks now (tests/unit/test_eval_benchmarks.py); "sst" is no task.
    with pytest.raises(ValueError, match=r"unknown task 'sst': expected one of \[.*'rt_sentiment'.*'sst2'"):
        evaluate_models([encoder], ["sst"])
    # A local task without its validation split, one whose label column is named otherwise, an STS
    # task without its test split, one of a family the harness does not know.
    source = suite / "rt_sentiment"
    no_validation, renamed, sts = tmp_path / "no_validation", tmp_path / "renamed", tmp_path / "sts"
    shutil.copytree(source, no_validation)
    (no_validation / "validation.jsonl").unlink()
    with pytest.raises(ValueError, match=r"split 'validation' not found in .*no_validation"):
        evaluate_models([encoder], [str(no_validation)])
    shutil.copytree(source, renamed)
    text = (renamed / "train.jsonl").read_text().replace('"label":', '"sentiment":')
    (renamed / "train.jsonl").write_text(text)
    with pytest.raises(ValueError, match=r"train.jsonl line 1: missing column\(s\) \['label'\]"):
        evaluate_models([encoder], [str(renamed)])
    sts.mkdir()
    (sts / "task.json").write_text(json.dumps({"family": "sts"}))
    with pytest.raises(ValueError, match=r"sts: an STS task needs a test.jsonl"):
        evaluate_models([encoder], [str(sts)])
    (sts / "task.json").write_text(json.dumps({"family": "summarization"}))
    with pytest.raises(ValueError, match="family 'summarization', which the harness cannot fine-tune"):
        evaluate_models([encoder], [str(sts)])

    with pytest.raises(ValueError, match=r"neither a Hugging Face model directory .* nor a Megatron checkpoint"):
        evaluate_models([str(tmp_path / "sts")], ["rt_sentiment"])
    with pytest.raises(ValueError, match="is not a directory"):
        evaluate_models([str(tmp_path / "absent")], ["rt_sentiment"])
    with pytest.raises(ValueError, match="two models are named 'a'"):
        evaluate_models([f"a={encoder}", f"a={encoder}"], ["rt_sentiment"])

    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="causal LM .*LlamaForCausalLM"):
        load_encoder(str(tmp_path / "llama"), FinetuneConfig(lr=1e-4, seed=0))
    with pytest.raises(ValueError, match=r"row 'x' has label 2; expected an int index"):
        sc.label_names(source, [{"id": "x", "label": 2}])


def test_checkpoint_is_exported_once_through_the_cli(tmp_path, suite, encoder, tiny_checkpoint, capsys):
    """A Megatron checkpoint is exported to EuroBERT on the fly and fine-tuned next to an HF model."""
    out = tmp_path / "eval"
    argv = ["--models", f"tiny_mlm={tiny_checkpoint['save_dir']}", f"minilm={encoder}",
            "--tasks", "rt_sentiment", "wiki_mentions", "--lrs", "1e-3", "--seeds", "0", "--max-steps", "3",
            "--batch-size", "8", "--max-eval-examples", "16", "--device", "cpu", "--output-dir", str(out),
            "--suite-dir", str(suite)]
    assert evaluate.main(argv) == 0
    printed = capsys.readouterr().out
    assert "tiny_mlm | rt_sentiment | sc | accuracy | 0.001 |" in printed and "4 run(s) fine-tuned" in printed
    assert "minilm | wiki_mentions | tc | f1 | 0.001 |" in printed
    exported = out / "exported" / "tiny_mlm"
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["EuroBertForMaskedLM"]
    record = json.loads(grid.run_path(out, "tiny_mlm", "wiki_mentions", 1e-3, 0).read_text())
    assert record["status"] == "ok" and record["steps"] == 3
    assert record["model_source"].endswith("iter_0000002") and record["model_dir"] == str(exported)
    assert len(list(csv.DictReader((out / "summary.csv").open()))) == 4
    stamp = (exported / "model.safetensors").stat().st_mtime_ns
    assert evaluate.main(argv) == 0  # neither re-exported nor re-run
    assert "0 run(s) fine-tuned, 4 reused" in capsys.readouterr().out
    assert (exported / "model.safetensors").stat().st_mtime_ns == stamp

    assert evaluate.main(["--models", str(tmp_path), "--tasks", "squad_v3", "--output-dir", str(out)]) == 2
    assert "evaluate.py: error: unknown task 'squad_v3'" in capsys.readouterr().err


def test_load_report_only_when_encoder_weights_are_missing(tmp_path, encoder):
    """transformers' weight-loading report (a table per fine-tuning run) is held back while only the
    new task head is missing, and printed when a weight of the encoder itself is."""
    import logging

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from megatron_ext.eval.finetuning import load_pretrained

    reports: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: reports.append(record.getMessage())
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addHandler(handler)
    bar = hf_logging.is_progress_bar_enabled()
    try:
        load_pretrained(AutoModelForSequenceClassification, encoder, num_labels=2)  # classifier.*: new
        assert reports == []
        broken = tmp_path / "broken"
        shutil.copytree(encoder, broken)
        state = load_file(broken / "model.safetensors")
        dropped = next(key for key in state if "layer.0." in key)
        del state[dropped]
        save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
        load_pretrained(AutoModelForSequenceClassification, str(broken), num_labels=2)
        assert len(reports) == 1 and "LOAD REPORT" in reports[0] and dropped in reports[0], reports
    finally:
        logger.removeHandler(handler)
    assert hf_logging.is_progress_bar_enabled() == bar
