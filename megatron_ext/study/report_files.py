"""The study report's output: ``report.json`` (:func:`report_json`), ``report.md``
(:func:`report_markdown`) and the figures as PNG, drawn by the evaluation's renderer
(:func:`megatron_ext.eval.render.plot_panels`, the one that also draws the evaluation summary's
figures: a panel per family, a line per series, the confidence interval as error bars where it is
known), written as one folder (:func:`write_report`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_ext.config_loading import UserError
from megatron_ext.eval.aggregation import CONFIDENCE
from megatron_ext.eval.families import FAMILIES, PAPER_FAMILIES
from megatron_ext.eval.ranking import format_ranking
from megatron_ext.eval.render import Line, Panel, plot_panels, pm, tokens_label
from megatron_ext.fileio import is_empty_dir_or_absent, publish_dir, staged_dir
from megatron_ext.study.report import StudyReport, TableRow
from megatron_ext.study.report_figures import FIGURES_DIR, Figure
from megatron_ext.study.report_join import SUMMARY_FILE
from megatron_ext.study.report_scores import AVERAGE, Score
from megatron_ext.study.spec import steps_label

REPORT_FILE = "report.json"


def family_title(family: str) -> str:
    return FAMILIES[family].title if family in FAMILIES else family


def column_title(family: str) -> str:
    """A family's column head: its title, marked when it is not one of the paper's families."""
    return family_title(family) + ("" if family in PAPER_FAMILIES else " (extra, not the paper's)")


METHOD = (
    "Test scores are the harness's: at the LR with the best mean validation score, mean over the fine-tuning seeds. "
    "A family's score is the average over its tasks of those best-LR test means; its {confidence:.0%} interval is "
    "the Student-t half-width, over fine-tuning seeds, of the per-seed averages over the family's tasks (each task "
    "at its best LR). Where a row pools several pretraining seeds (runs named _s<seed>), it is the mean over the "
    "runs of their family scores and the interval is the Student-t half-width over those runs (column 'CI over'). "
    "A family is scored only for a model evaluated on all its tasks; the average weighs the paper's families "
    "equally and needs all of them. A column marked 'extra, not the paper's' (similarity: zero-shot STS, "
    "Spearman x 100 of the embeddings' cosine similarities, one run without LR or seeds) stays out of the average."
)


def _score_json(score: Score) -> dict[str, Any]:
    return dataclasses.asdict(score)


def _row_json(row: TableRow) -> dict[str, Any]:
    record: dict[str, Any] = {"label": row.label, "models": list(row.models),
                              "scores": {key: _score_json(score) for key, score in row.scores.items()}}
    if row.group is not None:
        first = row.group.first
        record.update(kind=first.kind, size=first.size, train_iters=first.train_iters, source=row.group.source,
                      pretrain_tokens=first.train_iters * first.tokens_per_step,
                      runs=[run.name for run in row.group.runs])
    return record


def report_json(report: StudyReport) -> dict[str, Any]:
    """``report.json``: the tables' and figures' numbers."""
    return {
        "study": report.plan.study.name, "study_file": str(report.plan.path),
        "eval_dirs": [str(d) for d in report.eval_dirs], "confidence": CONFIDENCE,
        "method": METHOD.format(confidence=CONFIDENCE),
        "families": {family: {"title": family_title(family), "paper": family in PAPER_FAMILIES, "tasks": list(names)}
                     for family, names in report.tasks.items()},
        "study_models": [_row_json(row) for row in report.rows],
        "other_models": [_row_json(row) for row in report.other_rows],
        "tasks": {task: {model.name: {key: getattr(model.results[task], key)
                                      for key in ("metric", "best_lr", "test_mean", "test_ci95", "seeds")}
                         for model in report.task_models if task in model.results}
                  for names in report.tasks.values() for task in names},
        "rankings": {task: ({"skipped": r.skipped} if r.skipped else
                            {"source": r.source, "ranking": [dataclasses.asdict(entry) for entry in r.ranking]})
                     for task, r in report.rankings.items()},
        "checkpoints": [{"model": c.model.name, "run": c.run.name, "step": c.step, "tokens": c.tokens,
                         "final": c.final} for c in report.checkpoints],
        "figures": {f.name: ({"skipped": f.skipped} if f.skipped else
                             {"file": f.file, "title": f.title, "xlabel": f.xlabel,
                              "series": {family: [{"label": s.label, "dashed": s.dashed,
                                                   "points": [{"x": x, **_score_json(score)} for x, score in s.points]}
                                                  for s in lines]
                                         for family, lines in f.series.items()}})
                    for f in report.figures},
        "missing": list(report.missing),
        "notes": list(report.notes),
    }


def report_markdown(report: StudyReport) -> str:
    """``report.md``."""
    plan, families = report.plan, list(report.tasks)
    head = [column_title(f) for f in families] + ["average"]
    lines = [
        f"# Study report: {plan.study.name}", "",
        f"Study file `{plan.path}` ({len(plan.runs)} runs); evaluations: "
        + ", ".join(f"`{d / SUMMARY_FILE}`" for d in report.eval_dirs) + ".", "",
        "Families: " + "; ".join(f"{family_title(f)}: {', '.join(names)}" for f, names in report.tasks.items())
        + ".", "",
        "## Per-family scores", "", METHOD.format(confidence=CONFIDENCE), "",
        "| model | kind | size | steps | pretraining tokens | runs | " + " | ".join(head) + " | CI over |",
        "|---|---|---|---|---|---|" + "---|" * len(head) + "---|",
    ]

    def cells(row: TableRow) -> str:
        return " | ".join(row.scores[key].cell() if key in row.scores else "–" for key in [*families, AVERAGE])

    def over(row: TableRow) -> str:
        # only the cells with an interval: a zero-shot family (STS) is one run, without seeds
        units = {(s.over, s.n) for s in row.scores.values() if s.ci95 is not None}
        return ", ".join(f"{n} {what}" for what, n in sorted(units)) or "–"

    for row in report.rows:
        first = row.group.first
        lines.append(f"| {row.label} | {first.kind}{f' from {row.group.source}' if row.group.source else ''} | "
                     f"{first.size} | {steps_label(first.train_iters)} | "
                     f"{'+' if row.group.source else ''}{tokens_label(first.train_iters * first.tokens_per_step)} | "
                     f"{len(row.models)} | {cells(row)} | "
                     f"{over(row)} |")
    if not report.rows:
        lines.append("| (no study run's final checkpoint is evaluated) |" + " |" * (len(head) + 6))
    if report.other_rows:
        lines += ["", "Other models (not runs of the study):", "",
                  "| model | " + " | ".join(head) + " | CI over |", "|---|" + "---|" * (len(head) + 1)]
        lines += [f"| {row.label} | {cells(row)} | {over(row)} |" for row in report.other_rows]

    tasks = [task for names in report.tasks.values() for task in names]
    rank_of = {(task, entry.system): entry.rank for task, r in report.rankings.items() for entry in r.ranking}
    lines += ["", "## Per-task scores and rankings", "",
              f"Test at the best validation LR, mean ± {CONFIDENCE:.0%} CI over fine-tuning seeds; [rank] among the "
              "models of the task (paired permutation tests on the test examples' scores, p < 0.05 opens a new "
              "rank; tied models share a rank). A ranking's 'Mean' is the mean of those per-example scores; where "
              "the task's metric is not a mean over examples (token classification: entity F1 over the whole "
              "test set, against each sentence's F1 there) it differs from the score in this table.", "",
              "| model | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for model in report.task_models:
        row = []
        for task in tasks:
            result = model.results.get(task)
            if result is None:
                row.append("–")
                continue
            rank = rank_of.get((task, model.name))
            row.append(pm(result.test_mean, result.test_ci95) + ("" if rank is None else f" [{rank}]"))
        lines.append(f"| {model.name} | " + " | ".join(row) + " |")
    for task, ranking in report.rankings.items():
        lines += ["", f"### {task}", ""]
        if ranking.skipped:
            lines.append(f"Not ranked: {ranking.skipped}.")
        else:
            lines += [f"Source: {ranking.source}.", "", format_ranking(ranking.ranking).rstrip()]

    lines += ["", "## Figures", ""]
    for figure in report.figures:
        if not figure.skipped:
            lines += [f"### {figure.title}", "", f"![{figure.name}]({figure.file})", ""]
    skipped = [f for f in report.figures if f.skipped]
    if skipped:
        lines += ["Skipped figures:", ""] + [f"- {f.title} (`{f.name}`): {f.skipped}." for f in skipped] + [""]
    lines += ["## Missing evaluations", ""]
    lines += ([f"- {line}" for line in report.missing] if report.missing
              else ["None: every run is evaluated on every task."])
    if report.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in report.notes]
    return "\n".join(lines) + "\n"


def plot_figure(figure: Figure) -> bytes:
    """PNG of ``figure`` (not skipped) by the evaluation's renderer: a panel per family, the series'
    colours shared across them."""
    if figure.skipped or not figure.series:
        raise ValueError(f"figure {figure.name} has nothing to draw ({figure.skipped})")
    panels = [Panel(title=column_title(family), xlabel=figure.xlabel, ylabel="test score (0-100)",
                    x_axis=figure.x_axis,
                    lines=tuple(Line(label=s.label, color=s.color, dashed=s.dashed,
                                     points=tuple((x, score.mean, score.ci95) for x, score in s.points))
                                for s in series))
              for family, series in figure.series.items()]
    bars = any(score.ci95 for lines in figure.series.values() for s in lines for _, score in s.points)
    return plot_panels(panels, title=figure.title + (f"; bars: {CONFIDENCE:.0%} CI" if bars else ""))


def write_report(report: StudyReport, output_dir: str | Path, log: Callable[[str], None] = lambda line: None) -> Path:
    """Write ``report.md``, ``report.json`` and ``figures/*.png`` into ``output_dir`` as one folder:
    staged beside it, then swapped in whole. An existing folder is replaced only when it is empty or
    an earlier report (it has ``report.json``)."""
    output_dir = Path(output_dir)
    if not is_empty_dir_or_absent(output_dir) and not (output_dir / REPORT_FILE).is_file():
        raise UserError(f"--output-dir {output_dir} is not empty and holds no earlier report ({REPORT_FILE}); "
                        "give a new or empty folder")
    with staged_dir(output_dir) as tmp:
        drawn = [figure for figure in report.figures if not figure.skipped]
        for index, figure in enumerate(drawn, start=1):
            (tmp / FIGURES_DIR).mkdir(exist_ok=True)
            (tmp / figure.file).write_bytes(plot_figure(figure))
            log(f"drew figure {index}/{len(drawn)}: {figure.file}")
        (tmp / REPORT_FILE).write_text(json.dumps(report_json(report), indent=2) + "\n", encoding="utf-8")
        (tmp / "report.md").write_text(report_markdown(report), encoding="utf-8")
        publish_dir(tmp, output_dir, overwrite=True, identical_ok=True)
    return output_dir
