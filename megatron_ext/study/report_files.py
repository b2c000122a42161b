"""The study report's folder (:func:`write_report`): ``report.md``, ``report.json`` and the figures
as PNG (matplotlib, Agg: a subplot per family, a line per series, the confidence interval as error
bars where it is known)."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.eval.harness import CONFIDENCE
from megatron_ext.fileio import is_empty_dir_or_absent, publish_dir, staged_dir
from megatron_ext.study.report import (
    FIGURES_DIR,
    REPORT_FILE,
    Figure,
    StudyReport,
    column_title,
    report_json,
    report_markdown,
    tokens_label,
)


def plot_figure(figure: Figure) -> bytes:
    """PNG of ``figure`` (not skipped): one subplot per family, the series' colours shared across them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    if figure.skipped or not figure.series:
        raise ValueError(f"figure {figure.name} has nothing to draw ({figure.skipped})")
    families = list(figure.series)
    columns = min(2, len(families))
    rows = math.ceil(len(families) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 4.4 * rows), squeeze=False, layout="constrained")
    keys = list(dict.fromkeys(s.color for lines in figure.series.values() for s in lines))
    palette = plt.get_cmap("tab10" if len(keys) <= 10 else "tab20")
    colors = {key: palette(i % palette.N) for i, key in enumerate(keys)}
    for ax, family in zip(axes.flat, families):
        for series in figure.series[family]:
            xs = [x for x, _ in series.points]
            means = [score.mean for _, score in series.points]
            halves = [score.ci95 or 0.0 for _, score in series.points]
            # Drawn within the scores' 0-100 range, as the harness's score-vs-LR plots: few seeds give wide intervals.
            errors = [[m - max(0.0, m - h) for m, h in zip(means, halves)],
                      [min(100.0, m + h) - m for m, h in zip(means, halves)]]
            ax.errorbar(xs, means, yerr=errors if any(halves) else None, marker="x" if series.dashed else "o",
                        linestyle="--" if series.dashed else "-", capsize=3, color=colors[series.color],
                        label=series.label)
        if figure.x_axis == "lr":
            ax.set_xscale("log")
            lrs = sorted({x for series in figure.series[family] for x, _ in series.points})
            ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
            ax.minorticks_off()
        elif figure.x_axis == "tokens":
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: tokens_label(x)))
        elif figure.x_axis == "steps":
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
        ax.set_xlabel(figure.xlabel)
        ax.set_ylabel("test score (0-100)")
        ax.set_title(column_title(family))
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(families):]:
        ax.set_visible(False)
    # One legend below the subplots: a series keeps its colour in every family.
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=min(3, len(handles)),
               fontsize="small")
    bars = any(score.ci95 for lines in figure.series.values() for s in lines for _, score in s.points)
    fig.suptitle(figure.title + (f"; bars: {CONFIDENCE:.0%} CI" if bars else ""))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


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
