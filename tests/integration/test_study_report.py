"""The study's report (``tools/study_report.py``): a real tiny evaluation of encoders named as the runs
of a small study, joined to its plan; the per-family table equals what summary.json says with the CI
computed as stated, rankings reused or ranked again from the run files, the figures drawn or named as
skipped, missing evaluations listed; the aggregation and the join (``RUN@STEP``, pretraining seeds)
on results built here."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
import yaml
from scipy import stats

from megatron_ext.cli import study_report as cli
from megatron_ext.config_loading import UserError
from megatron_ext.eval import aggregation, grid, harness
from megatron_ext.eval.task_io import TASK_FILE, default_suite_dir
from megatron_ext.eval.suite import build_task
from megatron_ext.study.report import build_report
from megatron_ext.study.report_scores import AVERAGE, Score, pool, seed_score
from megatron_ext.study.plan import plan_study
from megatron_ext.study.report_files import report_json, report_markdown, write_report
from megatron_ext.study.spec import read_study

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "examples" / "recipes" / "base" / "210m.yaml"
TOKENS_PER_STEP = 1152 * 2048
TINY = {"max_steps": 3, "batch_size": 8, "max_eval_examples": 16, "max_length": 32, "device": "cpu"}
LRS, SEEDS = (2e-5, 1e-4), (0, 1)
TASKS = ("rt_sentiment", "wiki_mentions")  # one sequence and one token classification task
CPT = {"sources": ["clm"], "continuations": [
    {"steps": 2000, "overrides": {"schedule": {"lr_warmup_iters": 200, "lr_wsd_decay_iters": 200}}}]}
STUDY = {"name": "tiny_report", "sizes": [{"name": "210m", "base": str(BASE)}], "budgets": [12000, 22000],
         "objectives": [{"objective": "mlm", "mask_ratio": 0.4}, {"objective": "clm"}],
         "biphasic": {"clm_shares": [0.5]}, "cpt": CPT}
"""Seven runs: MLM-40, CLM and biphasic 50/50 at 12K and 22K steps, and +2K CPT from CLM-22K."""
EVALUATED = ("210m_mlm_40_12k", "210m_mlm_40_22k", "210m_clm_12k", "210m_clm_22k", "210m_biphasic_50_50_12k",
             "210m_clm_22k_cpt_mlm_40_2k")
"""All but 210m_biphasic_50_50_22k, whose missing evaluation the report must list."""
REFERENCE = "minilm_ref"


def _write_study(path: Path, study: dict) -> Path:
    path.write_text(yaml.safe_dump(study))
    return path


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory, minilm_dir):
    """The harness on seven distinct real encoders (all-MiniLM-L6-v2 cut to one layer, its layer's
    weights moved by seeded noise so that each scores differently): six named as runs of STUDY in
    one evaluation folder, a reference in another."""
    from transformers import AutoModel, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small CPU ops run ~10x slower with 2 intra-op threads on a shared 2-core machine
    suite = default_suite_dir()
    for task in TASKS:
        if not (suite / task / TASK_FILE).is_file():
            build_task(task, suite)
    root = tmp_path_factory.mktemp("report")
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    base = AutoModel.from_pretrained(minilm_dir, num_hidden_layers=1)
    models = {}
    for index, name in enumerate((*EVALUATED, REFERENCE)):
        model = AutoModel.from_pretrained(minilm_dir, num_hidden_layers=1)
        noise = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for param, original in zip(model.encoder.parameters(), base.encoder.parameters()):
                param.copy_(original + 0.05 * index * torch.randn(param.shape, generator=noise))
        model.save_pretrained(root / "models" / name)
        tokenizer.save_pretrained(root / "models" / name)
        models[name] = root / "models" / name
    study_eval, reference_eval = root / "eval_study", root / "eval_reference"
    for out, names in ((study_eval, EVALUATED), (reference_eval, (REFERENCE,))):
        harness.evaluate_models([f"{name}={models[name]}" for name in names], list(TASKS), output_dir=out, lrs=LRS,
                                seeds=SEEDS, overrides=TINY, suite_dir=suite)
    torch.set_num_threads(threads)
    study = _write_study(root / "study.yaml", STUDY)
    return {"root": root, "study": study, "study_eval": study_eval, "reference_eval": reference_eval}


def _rows(eval_dir: Path) -> dict[tuple[str, str], dict]:
    return {(r["model"], r["task"]): r for r in json.loads((eval_dir / "summary.json").read_text())["results"]}


def _t_half_width(values: list[float]) -> float:
    return stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def test_the_report_of_a_real_evaluation(evaluations, capsys):
    out = evaluations["root"] / "report"
    argv = [str(evaluations["study"]), "--eval-dir", str(evaluations["study_eval"]),
            "--eval-dir", str(evaluations["reference_eval"]), "--output-dir", str(out)]
    assert cli.main(argv) == 0
    log = capsys.readouterr().out
    assert "joined 7 evaluated model(s) to the study's 7 runs: 6 final checkpoint(s)" in log
    assert "drew figure 4/4: figures/lr_sensitivity.png" in log
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    rows = {**_rows(evaluations["study_eval"]), **_rows(evaluations["reference_eval"])}

    # Per-family table: one task per family, so a family's score is the task's best-LR test mean and
    # its CI the task's own (the per-seed averages are the seeds' scores); the average pools both
    # tasks per fine-tuning seed, then takes the Student-t half-width over the seeds.
    assert report["families"] == {"sc": {"title": "sequence classification", "paper": True, "tasks": ["rt_sentiment"]},
                                  "tc": {"title": "token classification", "paper": True, "tasks": ["wiki_mentions"]}}
    table = {row["label"]: row for row in report["study_models"]}
    assert list(table) == list(EVALUATED)  # in study order
    assert [row["label"] for row in report["other_models"]] == [REFERENCE]
    for name, row in [*table.items(), (REFERENCE, report["other_models"][0])]:
        sc, tc = rows[name, "rt_sentiment"], rows[name, "wiki_mentions"]
        for family, result in (("sc", sc), ("tc", tc)):
            score = row["scores"][family]
            assert score["mean"] == pytest.approx(result["test_mean"])
            assert score["ci95"] == pytest.approx(result["test_ci95"])
            assert (score["n"], score["over"]) == (2, "fine-tuning seeds")
        tests = {task: dict(zip(r["best_lr_scores"]["seeds"], r["best_lr_scores"]["test"]))
                 for task, r in (("sc", sc), ("tc", tc))}
        per_seed = [(tests["sc"][seed] + tests["tc"][seed]) / 2 for seed in SEEDS]
        assert row["scores"]["average"]["mean"] == pytest.approx((sc["test_mean"] + tc["test_mean"]) / 2)
        assert row["scores"]["average"]["ci95"] == pytest.approx(_t_half_width(per_seed))
        cell = f"{row['scores']['sc']['mean']:.2f} ± {row['scores']['sc']['ci95']:.2f}"
        assert cell in markdown
    clm_12k = table["210m_clm_12k"]
    assert (clm_12k["kind"], clm_12k["train_iters"], clm_12k["pretrain_tokens"]) == ("clm", 12000,
                                                                                    12000 * TOKENS_PER_STEP)
    assert table["210m_clm_22k_cpt_mlm_40_2k"]["source"] == "210m_clm_22k"
    assert len({row["scores"]["tc"]["mean"] for row in table.values()}) > 1  # distinct models, distinct scores

    # Per-task: the summary's numbers; models in two folders are ranked again from the run files.
    for task in TASKS:
        assert report["tasks"][task][REFERENCE]["test_mean"] == rows[REFERENCE, task]["test_mean"]
        ranking = report["rankings"][task]
        assert ranking["source"].startswith("ranked again from the run files")
        assert {entry["system"] for entry in ranking["ranking"]} == {*EVALUATED, REFERENCE}
        for entry in ranking["ranking"]:  # the mean of each test example's score over the best LR's seeds
            result = rows[entry["system"], task]
            eval_dir = evaluations["reference_eval" if entry["system"] == REFERENCE else "study_eval"]
            runs = [json.loads(grid.run_path(eval_dir, entry["system"], task, result["best_lr"], seed).read_text())
                    for seed in SEEDS]
            examples = [statistics.fmean(run["per_example"]["test"][i] for run in runs)
                        for i in runs[0]["per_example"]["test"]]
            assert entry["mean"] == pytest.approx(statistics.fmean(examples))
        assert f"### {task}" in markdown

    # Figures: every one drawn, from the study runs only.
    figures = report["figures"]
    for name in ("clm_share", "tokens", "cpt", "lr_sensitivity"):
        png = out / figures[name]["file"]
        assert png.read_bytes().startswith(b"\x89PNG") and f"]({figures[name]['file']})" in markdown
        from PIL import Image

        with Image.open(png) as image:
            image.verify()
        for lines in figures[name]["series"].values():
            assert not any(REFERENCE in line["label"] for line in lines)
    by_label = {line["label"]: line["points"] for line in figures["clm_share"]["series"]["tc"]}
    score = {name: row["scores"]["tc"]["mean"] for name, row in table.items()}
    assert [(p["x"], p["mean"]) for p in by_label["12k steps"]] == [
        (0.0, score["210m_mlm_40_12k"]), (50.0, score["210m_biphasic_50_50_12k"]), (100.0, score["210m_clm_12k"])]
    assert [p["x"] for p in by_label["22k steps"]] == [0.0, 100.0]  # the 22K biphasic run is not evaluated
    tokens = {line["label"]: line["points"] for line in figures["tokens"]["series"]["sc"]}
    assert [p["x"] for p in tokens["clm (final checkpoints)"]] == [12000 * TOKENS_PER_STEP, 22000 * TOKENS_PER_STEP]
    cpt = figures["cpt"]["series"]["sc"]
    assert [(p["x"], p["mean"]) for p in cpt[0]["points"]] == [
        (0.0, table["210m_clm_22k"]["scores"]["sc"]["mean"]),
        (2000.0, table["210m_clm_22k_cpt_mlm_40_2k"]["scores"]["sc"]["mean"])]
    lr_lines = {line["label"]: line["points"] for line in figures["lr_sensitivity"]["series"]["sc"]}
    assert set(lr_lines) == {"210m_mlm_40_22k", "210m_clm_22k", "210m_biphasic_50_50_12k",
                             "210m_clm_22k_cpt_mlm_40_2k"}  # each kind at its longest evaluated run
    curve = {p["lr"]: p["test_mean"] for p in rows["210m_clm_22k", "rt_sentiment"]["lr_curve"]}
    assert [(p["x"], p["mean"]) for p in lr_lines["210m_clm_22k"]] == sorted(curve.items())

    # The missing evaluation is listed; nothing is skipped.
    assert report["missing"] == ["210m_biphasic_50_50_22k: final checkpoint (step 22,000) not evaluated"]
    assert "- 210m_biphasic_50_50_22k: final checkpoint (step 22,000) not evaluated" in markdown
    assert "Skipped figures" not in markdown

    # The same folder again: replaced whole (an earlier report); a folder holding something else is refused.
    assert cli.main(argv) == 0
    other = evaluations["root"] / "not_a_report"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert cli.main(argv[:-1] + [str(other)]) == 2
    assert "is not empty and holds no earlier report" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "mine"


def test_a_study_without_the_runs_a_figure_needs(evaluations, tmp_path):
    """Without CPT in the study the CPT figure is named as skipped and the CPT-named model is another
    model; with one folder holding every model, its summary's rankings are used as they are."""
    study = _write_study(tmp_path / "study.yaml", {**{k: v for k, v in STUDY.items() if k != "cpt"}})
    plan = plan_study(read_study(study), study)
    report = build_report(plan, [evaluations["study_eval"]])
    write_report(report, tmp_path / "report")
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert data["figures"]["cpt"] == {"skipped": "no CPT runs in this study"}
    assert "(`cpt`): no CPT runs in this study." in markdown
    assert not (tmp_path / "report" / "figures" / "cpt.png").exists()
    assert sorted(p.name for p in (tmp_path / "report" / "figures").iterdir()) == [
        "clm_share.png", "lr_sensitivity.png", "tokens.png"]
    assert [row["label"] for row in data["other_models"]] == ["210m_clm_22k_cpt_mlm_40_2k"]
    summary_path = evaluations["study_eval"] / "summary.json"
    summary = json.loads(summary_path.read_text())
    for task in TASKS:
        assert data["rankings"][task] == {"source": f"the harness's ranking in {summary_path}",
                                          "ranking": summary["rankings"][task]}


# ----------------------------------------------------------------------------- built results


def _result(model: str, task: str, family: str, tests: dict[int, float], lrs: dict[float, float] | None = None,
            **row) -> dict:
    """A summary.json row (as the harness writes it before several checkpoints per model: ``row``
    adds those keys) whose best-LR test scores are ``tests`` (by seed)."""
    lr_curve = [{"lr": lr, "validation_mean": mean, "validation_std": None, "test_mean": mean, "test_std": None,
                 "test_ci95": None, "diverged": 0, "seeds": len(tests)} for lr, mean in (lrs or {1e-4: 0.0}).items()]
    return {"model": model, "task": task, "family": family, "metric": "accuracy", "best_lr": 1e-4,
            "test_mean": statistics.fmean(tests.values()), "test_ci95": None, "test_std": None, "validation_mean": 0.0,
            "validation_std": None, "seeds": len(tests), "diverged_runs": 0, "runs": len(tests),
            "best_lr_scores": {"seeds": list(tests), "validation": [0.0] * len(tests), "test": list(tests.values())},
            "lr_curve": lr_curve, **row}


def test_family_scores_average_tasks_per_seed_then_over_seeds():
    a = aggregation.TaskResult.from_json(_result("m", "a", "sc", {0: 60.0, 1: 70.0, 2: 80.0}))
    b = aggregation.TaskResult.from_json(_result("m", "b", "sc", {0: 40.0, 1: 30.0, 2: 50.0}))
    c = aggregation.TaskResult.from_json(_result("m", "c", "tc", {0: 10.0, 1: 20.0, 2: 60.0}))
    family = seed_score([[a, b]])
    assert family.mean == pytest.approx(55.0) and family.n == 3 and family.over == "fine-tuning seeds"
    assert family.ci95 == pytest.approx(_t_half_width([50.0, 50.0, 65.0]))
    average = seed_score([[a, b], [c]])  # families weigh equally, not tasks
    assert average.mean == pytest.approx((55.0 + 30.0) / 2)
    assert average.ci95 == pytest.approx(_t_half_width([30.0, 35.0, 62.5]))
    runs = [Score(mean=m, ci95=1.0, n=3, over="fine-tuning seeds") for m in (50.0, 54.0, 61.0)]
    pooled = pool(runs)
    assert (pooled.mean, pooled.n, pooled.over) == (pytest.approx(55.0), 3, "pretraining seeds")
    assert pooled.ci95 == pytest.approx(_t_half_width([50.0, 54.0, 61.0]))
    assert pool(runs[:1]) is runs[0]


def test_checkpoints_and_pretraining_seeds_join_to_the_plan(tmp_path):
    """``RUN@STEP`` names (parsed, or the harness's own keys) are checkpoints of a run; runs that differ
    by ``_s<seed>`` are one row; a task only some models have leaves the others' family blank and is listed."""
    study = _write_study(tmp_path / "study.yaml", {**STUDY, "budgets": [12000], "biphasic": None, "cpt": None,
                                                   "seeds": [1234, 7]})
    plan = plan_study(read_study(study), study)
    assert [run.name for run in plan.runs] == ["210m_mlm_40_12k", "210m_clm_12k", "210m_mlm_40_12k_s7",
                                               "210m_clm_12k_s7"]
    rows = []
    for name, base in (("210m_clm_12k", 50.0), ("210m_clm_12k_s7", 60.0), ("210m_mlm_40_12k", 40.0),
                       ("210m_mlm_40_12k_s7", 46.0)):
        rows.append(_result(name, "a", "sc", {0: base, 1: base + 2.0}, lrs={1e-5: base - 10, 1e-4: base}))
    rows.append(_result("210m_clm_12k@6000", "a", "sc", {0: 30.0, 1: 32.0}))  # an older harness: parsed
    rows.append(_result("clm_half", "a", "sc", {0: 35.0, 1: 37.0}, base_model="210m_clm_12k_s7",
                        checkpoint_step=3000, pretrain_tokens=123))  # the harness's keys win over the name
    rows.append(_result("210m_clm_12k", "q", "qa", {0: 5.0, 1: 7.0}))
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    missing_runs = [f"runs/210m_clm_12k/b/lr0.0001_seed{seed}.json" for seed in range(6)]
    (eval_dir / "summary.json").write_text(json.dumps({"results": rows, "missing_runs": missing_runs}))
    report = build_report(plan, [eval_dir])

    groups = {row.label: row for row in report.rows}
    assert list(groups) == ["210m_mlm_40_12k", "210m_clm_12k"]
    clm = groups["210m_clm_12k"]
    assert clm.models == ("210m_clm_12k", "210m_clm_12k_s7")
    assert (clm.scores["sc"].mean, clm.scores["sc"].over) == (pytest.approx(56.0), "pretraining seeds")
    assert clm.scores["sc"].ci95 == pytest.approx(_t_half_width([51.0, 61.0]))
    assert "qa" in clm.scores and "qa" not in groups["210m_mlm_40_12k"].scores  # only one clm run has q
    assert clm.scores["qa"].over == "fine-tuning seeds"
    assert "210m_mlm_40_12k: not evaluated on q" in report.missing
    assert report.missing[-1] == (  # a summary written before its grid was complete (--summary-only)
        f"{eval_dir / 'summary.json'}: written with 6 fine-tuning run(s) not done yet ({', '.join(missing_runs[:5])} "
        "...); its scores are over the runs done")
    checkpoints = {(c.model.name, c.run.name, c.step, c.tokens) for c in report.checkpoints}
    assert ("210m_clm_12k@6000", "210m_clm_12k", 6000, 6000 * TOKENS_PER_STEP) in checkpoints
    assert ("clm_half", "210m_clm_12k_s7", 3000, 123) in checkpoints
    figures = {figure.name: figure for figure in report.figures}
    lines = {s.label: s for s in figures["tokens"].series["sc"]}
    assert [(x, s.mean) for x, s in lines["210m_clm_12k checkpoints"].points] == [
        (123, 36.0), (6000 * TOKENS_PER_STEP, 31.0), (12000 * TOKENS_PER_STEP, pytest.approx(56.0))]
    assert lines["210m_clm_12k checkpoints"].dashed
    assert figures["clm_share"].skipped is None and figures["cpt"].skipped == "no CPT runs in this study"
    lr = {s.label: [(x, p.mean) for x, p in s.points] for s in figures["lr_sensitivity"].series["sc"]}
    assert lr["210m_clm_12k"] == [(1e-5, pytest.approx(45.0)), (1e-4, pytest.approx(55.0))]


def test_each_figure_names_why_it_is_skipped_and_bad_folders_are_refused(tmp_path):
    study = _write_study(tmp_path / "study.yaml", {**STUDY, "budgets": [12000], "objectives": [{"objective": "clm"}],
                                                   "biphasic": None, "cpt": None})
    plan = plan_study(read_study(study), study)
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "summary.json").write_text(json.dumps({"results": [_result("210m_clm_12k", "a", "sc", {0: 50.0})]}))
    report = build_report(plan, [eval_dir])
    assert {figure.name: figure.skipped for figure in report.figures} == {
        "clm_share": "the study has fewer than two of the runs it compares (mlm_40, clm); it has clm",
        "tokens": "no MLM or CLM run is evaluated at two or more token counts (budgets' final checkpoints or "
                  "RUN@STEP checkpoints)",
        "cpt": "no CPT runs in this study",
        "lr_sensitivity": "the evaluations have one fine-tuning LR"}
    assert report.rows[0].scores["sc"].ci95 is None and report.rows[0].scores["sc"].n == 1  # one seed: no interval
    assert report.rankings["a"].skipped == "fewer than two models evaluated on it"

    with pytest.raises(UserError, match=f"--eval-dir {tmp_path}: no summary.json"):
        build_report(plan, [tmp_path])
    again = tmp_path / "again"
    again.mkdir()
    (again / "summary.json").write_text((eval_dir / "summary.json").read_text())
    with pytest.raises(UserError, match=r"model 210m_clm_12k on task a is in .*eval/summary.json and in "
                                                     r".*again/summary.json: give each evaluation once"):
        build_report(plan, [eval_dir, again])
    (again / "summary.json").write_text(json.dumps({"results": [{"model": "x"}]}))
    with pytest.raises(UserError, match=r"again/summary.json: results\[0\]: not a row"):
        build_report(plan, [again])


def test_zero_shot_sts_is_an_extra_column_out_of_the_average(tmp_path):
    """An STS task (one zero-shot run at lr 0, seed 0) is a family column of its own, marked as not
    the paper's, left out of the average and of the score-vs-LR figure."""
    study = _write_study(tmp_path / "study.yaml", {**STUDY, "budgets": [12000], "biphasic": None, "cpt": None})
    plan = plan_study(read_study(study), study)
    rows = []
    for name, base in (("210m_mlm_40_12k", 40.0), ("210m_clm_12k", 50.0)):
        rows.append(_result(name, "a", "sc", {0: base, 1: base + 2.0}, lrs={1e-5: base - 10, 1e-4: base}))
        rows.append({**_result(name, "lee_sts", "sts", {0: base / 2}, lrs={0.0: base / 2}), "best_lr": 0.0,
                     "metric": "spearman"})
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "summary.json").write_text(json.dumps({"results": rows}))
    report = build_report(plan, [eval_dir])
    clm = {row.label: row for row in report.rows}["210m_clm_12k"]
    assert clm.scores["sts"].mean == 25.0 and clm.scores["sc"].mean == 51.0
    assert clm.scores[AVERAGE].mean == 51.0  # the paper's families only
    markdown = report_markdown(report)
    assert "| sequence classification | similarity (extra, not the paper's) | average |" in markdown
    # sc, sts, average; the intervals are over the 2 fine-tuning seeds (the STS run has neither)
    assert f"| 51.00 ± {clm.scores['sc'].ci95:.2f} | 25.00 | 51.00 ± {clm.scores['sc'].ci95:.2f} | 2 fine-tuning seeds |" \
        in markdown
    assert report_json(report)["families"]["sts"]["paper"] is False
    figures = {figure.name: figure for figure in report.figures}
    assert "sts" not in figures["lr_sensitivity"].series and "sts" in figures["clm_share"].series
