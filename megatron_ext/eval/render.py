"""The one renderer of evaluation results: ``summary.{md,csv,json}`` and plots of the harness, and
the cells, token counts and figures of the study's report (:mod:`megatron_ext.study.report_files`).

Numbers print the same way everywhere (:func:`pm`: ``mean ± CI``; :func:`tokens_label`: ``2.15B``),
and every figure is drawn by :func:`plot_panels`: a panel per task or family, a line per model or
run, its :data:`~megatron_ext.eval.aggregation.CONFIDENCE` interval as error bars, one legend below
the panels.

Layout of the harness's ``output_dir`` (:func:`write_summary`)::

    summary.json, summary.md, summary.csv       one row per model x task, plus the LR curves and rankings
    plots/<task>.png                            score vs LR, one line per model, CI bars
    plots/tokens/<task>.png                     score vs pretraining tokens, for models with several checkpoints
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_ext.eval.aggregation import CONFIDENCE, TaskResult, checkpoint_series
from megatron_ext.eval.families import FAMILIES
from megatron_ext.eval.grid import DIVERGED_SCORE, RunSpec
from megatron_ext.eval.ranking import RankedSystem, format_ranking
from megatron_ext.fileio import write_atomic

CSV_COLUMNS = ("model", "base_model", "checkpoint_step", "pretrain_tokens", "task", "family", "metric", "best_lr",
               "test_mean", "test_ci95", "validation_mean", "validation_std", "test_std", "seeds", "diverged_runs",
               "runs", "rank")


# ----------------------------------------------------------------------------- numbers


def pm(mean: float, ci: float | None) -> str:
    """A score and its confidence half-width, ``71.25 ± 3.10`` (the mean alone without one)."""
    return f"{mean:.2f} ± {ci:.2f}" if ci is not None else f"{mean:.2f}"


def std(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def tokens_label(count: float | None) -> str:
    """``2.15B``, ``86M``: a token count at a glance ("" when unknown)."""
    if count is None:
        return ""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return f"{count:g}"


def best_lr_label(result: TaskResult) -> str:
    """The best LR as reports print it: ``zero-shot`` for a family that trains nothing."""
    return "zero-shot" if FAMILIES[result.family].zero_shot else f"{result.best_lr:g}"


# ----------------------------------------------------------------------------- summary.md


def _tokens_section(results: Sequence[TaskResult]) -> list[str]:
    """``summary.md``'s score against pretraining tokens: a table per base model (a row per
    checkpoint, a column per task), and per task a plot of the base models with several checkpoints."""
    series = checkpoint_series(results)
    if not series:
        return []
    tasks = list(dict.fromkeys(r.task for r in results))
    lines = ["", "## Score vs pretraining tokens", "",
             "Test mean ± CI at each checkpoint's best LR; pretraining tokens = step x global batch size x "
             "sequence length of the checkpoint's run config."]
    for base, rows in series.items():
        by_model: dict[str, dict[str, TaskResult]] = {}
        for r in rows:
            by_model.setdefault(r.model, {})[r.task] = r
        lines += ["", f"### {base}", "", "| step | pretraining tokens | " + " | ".join(tasks) + " |",
                  "|---|---|" + "---|" * len(tasks)]
        for cells in by_model.values():
            first = next(iter(cells.values()))
            lines.append(f"| {first.checkpoint_step} | {tokens_label(first.pretrain_tokens)} | " + " | ".join(
                pm(cells[t].test_mean, cells[t].test_ci95) if t in cells else "" for t in tasks) + " |")
    lines.append("")
    lines += [f"![{task} vs pretraining tokens](plots/tokens/{task}.png)" for task in _tokens_plot_tasks(results)]
    return lines


def _tokens_plot_tasks(results: Sequence[TaskResult]) -> list[str]:
    """Tasks with a base model scored at two checkpoints or more (a score-vs-tokens line)."""
    series = checkpoint_series(results)
    return [task for task in dict.fromkeys(r.task for r in results)
            if any(len([r for r in rows if r.task == task and r.pretrain_tokens is not None]) >= 2
                   for rows in series.values())]


def _zero_shot_note(results: Sequence[TaskResult]) -> list[str]:
    tasks = list(dict.fromkeys(r.task for r in results if FAMILIES[r.family].zero_shot))
    if not tasks:
        return []
    notes = " ".join(dict.fromkeys(FAMILIES[r.family].score_note for r in results if r.task in tasks))
    return [f"Zero-shot tasks ({', '.join(tasks)}; not the paper's): nothing is fine-tuned, so each model has one "
            f"run, without LR or seeds, and no confidence interval; {notes}", ""]


def _missing_note(missing: Sequence[RunSpec], total: int) -> list[str]:
    if not missing:
        return []
    listed = [f"{spec.model.name} {spec.task.name} lr={spec.lr:g} seed={spec.seed}" for spec in missing[:20]]
    return [f"**Incomplete:** {len(missing)} of {total} runs have no record yet (written with --summary-only); "
            f"the scores are over the runs present. Missing: {'; '.join(listed)}"
            + (" ..." if len(missing) > len(listed) else "") + ".", ""]


def summary_markdown(results: Sequence[TaskResult], lrs: Sequence[float], seeds: Sequence[int],
                     rankings: Mapping[str, Sequence[RankedSystem]] | None = None,
                     missing: Sequence[RunSpec] = ()) -> str:
    """``summary.md``: the model x task table, the scores against pretraining tokens (several
    checkpoints of a model), then each task's ranking, score-vs-LR table and plot."""
    rankings = rankings or {}
    diverged, runs = sum(r.diverged_runs for r in results), sum(r.runs for r in results)
    lines = [
        "# Fine-tuning evaluation", "",
        f"LR grid {', '.join(f'{lr:g}' for lr in lrs)}; seeds {', '.join(map(str, seeds))}. The best LR maximises "
        f"the mean validation score; test is the mean ± {CONFIDENCE:.0%} confidence half-width over seeds at that LR "
        f"(Student t). Diverged runs (non-finite training loss) count as score {DIVERGED_SCORE:g}: "
        f"{diverged} of {runs} runs.", "",
        *_zero_shot_note(results),
        *_missing_note(missing, runs + len(missing)),
        "| model | task | metric | best LR | test (mean ± CI) | validation mean | seed std (validation / test) "
        "| diverged runs | rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.model} | {r.task} | {r.metric} | {best_lr_label(r)} | {pm(r.test_mean, r.test_ci95)} | "
                     f"{r.validation_mean:.2f} | {std(r.validation_std)} / {std(r.test_std)} | "
                     f"{r.diverged_runs} | {'' if r.rank is None else r.rank} |")
    lines += _tokens_section(results)
    for task in dict.fromkeys(r.task for r in results):
        if task in rankings:
            lines += ["", f"## {task}: ranking", "",
                      "On the test examples' scores at each model's best LR (mean over seeds); paired "
                      "permutation tests, p < 0.05 opens a new rank.", "", format_ranking(rankings[task]).rstrip()]
        if all(FAMILIES[r.family].zero_shot for r in results if r.task == task):
            continue  # one zero-shot run per model: no LR to plot against
        lines += ["", f"## {task}: score vs learning rate", "",
                  "Test mean ± CI (validation mean); a † marks diverged seeds.", "",
                  "| model | " + " | ".join(f"{lr:g}" for lr in lrs) + " |", "|---|" + "---|" * len(lrs)]
        for r in (r for r in results if r.task == task):
            points = {p.lr: p for p in r.lr_curve}
            cells = [f"{pm(p.test_mean, p.test_ci95)} ({p.validation_mean:.2f})" + " †" * p.diverged
                     if (p := points.get(lr)) else "" for lr in lrs]
            lines.append(f"| {r.model} | " + " | ".join(cells) + " |")
        lines += ["", f"![{task}](plots/{task}.png)"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- figures


@dataclass(frozen=True, kw_only=True)
class Line:
    """One line of a panel: scores with their confidence half-widths, and an optional starred point."""

    label: str
    points: tuple[tuple[float, float, float | None], ...]
    """``(x, mean, CI half-width or None)``, by x."""
    color: str
    """Lines with the same key share a colour across the panels of a figure."""
    dashed: bool = False
    star: tuple[float, float] | None = None
    """A point drawn as a star (the best LR)."""


@dataclass(frozen=True, kw_only=True)
class Panel:
    """One subplot: its title, axes and lines."""

    title: str
    xlabel: str
    ylabel: str
    x_axis: Literal["steps", "percent", "tokens", "lr"]
    """How x is drawn: counts, a share in %, token counts (:func:`tokens_label`), learning rates (log
    scale, a tick at each)."""
    lines: tuple[Line, ...]


def plot_panels(panels: Sequence[Panel], *, title: str) -> bytes:
    """PNG of ``panels`` (two columns at most) under ``title``: each line with its CI as error bars,
    one legend below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    if not panels:
        raise ValueError(f"figure {title!r} has no panel to draw")
    columns = min(2, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 4.4 * rows), squeeze=False, layout="constrained")
    keys = list(dict.fromkeys(line.color for panel in panels for line in panel.lines))
    palette = plt.get_cmap("tab10" if len(keys) <= 10 else "tab20")
    colors = {key: palette(i % palette.N) for i, key in enumerate(keys)}
    for ax, panel in zip(axes.flat, panels):
        for line in panel.lines:
            xs = [x for x, _, _ in line.points]
            means = [mean for _, mean, _ in line.points]
            halves = [half or 0.0 for _, _, half in line.points]
            color = colors[line.color]
            # Bars within the scores' range (few seeds give wide intervals): 0-100, or down to the
            # mean for a negative one (a correlation, -100 to 100).
            errors = [[m - max(min(0.0, m), m - h) for m, h in zip(means, halves)],
                      [min(100.0, m + h) - m for m, h in zip(means, halves)]]
            ax.errorbar(xs, means, yerr=errors if any(halves) else None, marker="x" if line.dashed else "o",
                        linestyle="--" if line.dashed else "-", capsize=3, color=color, label=line.label)
            if line.star is not None:
                ax.plot(*line.star, marker="*", markersize=14, color=color)
        if panel.x_axis == "lr":
            ax.set_xscale("log")
            lrs = sorted({x for line in panel.lines for x, _, _ in line.points})
            ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
            ax.minorticks_off()
        elif panel.x_axis == "tokens":
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: tokens_label(x)))
        elif panel.x_axis == "steps":
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.set_title(panel.title)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    # One legend below the panels: a line keeps its colour in every panel.
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=min(3, len(handles)),
               fontsize="small")
    fig.suptitle(title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def plot_task(results: Sequence[TaskResult], task: str) -> bytes:
    """PNG of test score vs LR (log x) for one task: a line per model, its CI, the best LR starred."""
    lines = tuple(Line(label=r.model, color=r.model, star=(r.best_lr, r.test_mean),
                       points=tuple((p.lr, p.test_mean, p.test_ci95) for p in r.lr_curve)) for r in results)
    panel = Panel(title=task, xlabel="fine-tuning learning rate", ylabel=f"test {results[0].metric}", x_axis="lr",
                  lines=lines)
    return plot_panels([panel], title=f"test mean ± {CONFIDENCE:.0%} CI over seeds (★ best validation LR)")


def plot_tokens(results: Sequence[TaskResult], task: str) -> bytes:
    """PNG of test score (at the best LR) vs pretraining tokens for one task: a line per base model
    with two checkpoints or more, its CI."""
    lines = []
    for base, rows in checkpoint_series(results).items():
        points = [r for r in rows if r.task == task and r.pretrain_tokens is not None]
        if len(points) >= 2:
            lines.append(Line(label=base, color=base,
                              points=tuple((r.pretrain_tokens, r.test_mean, r.test_ci95) for r in points)))
    metric = next(r.metric for r in results if r.task == task)
    panel = Panel(title=task, xlabel="pretraining tokens", ylabel=f"test {metric}", x_axis="tokens",
                  lines=tuple(lines))
    return plot_panels([panel], title=f"test mean ± {CONFIDENCE:.0%} CI at the best LR, by checkpoint")


# ----------------------------------------------------------------------------- the summary's files


def summary_files(output_dir: Path, results: Sequence[TaskResult], lrs: Sequence[float], seeds: Sequence[int],
                  rankings: Mapping[str, Sequence[RankedSystem]], missing: Sequence[RunSpec] = ()) -> dict[str, str]:
    """File name -> text of ``summary.{json,md,csv}`` for ``results`` ranked by
    :func:`~megatron_ext.eval.aggregation.rank_models`; ``missing``: runs without a record (a
    summary written on demand before the grid is complete), listed relative to ``output_dir``."""
    rows = [r.to_json() for r in results]
    summary = {"lrs": list(lrs), "seeds": list(seeds), "confidence": CONFIDENCE, "diverged_score": DIVERGED_SCORE,
               "selection": "best LR = argmax of the mean validation score over seeds; test at that LR",
               "missing_runs": [str(spec.path.relative_to(output_dir)) for spec in missing],
               "results": rows,
               "rankings": {task: [dataclasses.asdict(ranked) for ranked in ranked_systems]
                            for task, ranked_systems in rankings.items()}}
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return {"summary.json": json.dumps(summary, indent=2) + "\n",
            "summary.md": summary_markdown(results, lrs, seeds, rankings, missing),
            "summary.csv": table.getvalue()}


def write_summary(output_dir: Path, results: Sequence[TaskResult], lrs: Sequence[float], seeds: Sequence[int],
                  rankings: Mapping[str, Sequence[RankedSystem]], missing: Sequence[RunSpec] = ()) -> None:
    """:func:`summary_files`, ``plots/<task>.png`` and, for models with several checkpoints,
    ``plots/tokens/<task>.png``."""
    for name, text in summary_files(output_dir, results, lrs, seeds, rankings, missing).items():
        write_atomic(output_dir / name, text)
    for task in dict.fromkeys(r.task for r in results if not FAMILIES[r.family].zero_shot):
        write_atomic(output_dir / "plots" / f"{task}.png", plot_task([r for r in results if r.task == task], task))
    for task in _tokens_plot_tasks(results):
        write_atomic(output_dir / "plots" / "tokens" / f"{task}.png", plot_tokens(results, task))
