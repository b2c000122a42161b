"""The study report's folder (:func:`write_report`): ``report.md``, ``report.json`` and the figures
as PNG, drawn by the evaluation's renderer (:func:`megatron_ext.eval.render.plot_panels`: a panel
per family, a line per series, the confidence interval as error bars where it is known)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.eval.aggregation import CONFIDENCE
from megatron_ext.eval.render import Line, Panel, plot_panels
from megatron_ext.fileio import is_empty_dir_or_absent, publish_dir, staged_dir
from megatron_ext.study.report import (
    FIGURES_DIR,
    REPORT_FILE,
    Figure,
    StudyReport,
    column_title,
    report_json,
    report_markdown,
)


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
