"""Plot training and validation loss curves of one or more runs to a PNG.

    python tools/plot_loss.py runs/demo [runs/other ...] --output runs/demo/loss.png

Reads each run's ``metrics.jsonl`` (written by ``pretrain_encoder.py`` into ``logging.log_dir``).
Left panel: training loss per step, drawn per phase (the objectives' losses are different
quantities, so a phase change shows as a jump, not as progress). Right panel: the validation
losses (CLM, and MLM at ``training.eval_mask_ratio``) at every evaluation. A third panel, when the
validation blend has several sources: each source's validation loss.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_ext.cli.entry import ArgumentParser, entry_point
from megatron_ext.config_loading import UserError
from megatron_ext.objectives import OBJECTIVES


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise UserError(f"{path}: no metrics.jsonl (is {run} a logging.log_dir of pretrain_encoder.py?)")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
    # A resumed run appends; keep the last record per (kind, step).
    latest = {(r["kind"], r["step"]): r for r in records}
    return sorted(latest.values(), key=lambda r: r["step"])


def _line_style(tag: str, run: Path) -> str:
    if tag not in OBJECTIVES:
        raise UserError(f"{run}: metrics.jsonl names objective {tag!r}, which this version does not know "
                        f"(known: {sorted(OBJECTIVES)})")
    return "--" if OBJECTIVES[tag].causal else "-"


def _plot_sources(ax, runs: list[Path], all_records: list[list[dict]]) -> None:
    """Third panel, when validation reads several sources: each source's validation loss (the
    bidirectional objective's, MLM where measured) at every evaluation, one line per run and source."""
    styles = ["-", "--", ":", "-."]
    for i, (run, records) in enumerate(zip(runs, all_records)):
        valid = [r for r in records if r["kind"] == "valid" and "by_source" in r]
        names = list(dict.fromkeys(name for r in valid for name in r["by_source"]))
        for name in names:
            points = [(r["step"], losses.get("mlm", next(iter(losses.values()))))
                      for r in valid if (losses := r["by_source"].get(name))]
            ax.plot(*zip(*points), linestyle=styles[i % len(styles)], marker="o", markersize=3,
                    label=f"{run.name} {name}" if len(runs) > 1 else name)
    ax.set(title="validation loss per source (MLM)", xlabel="step", ylabel="cross-entropy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot(runs: list[Path], output: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_records = [read_metrics(run) for run in runs]
    by_source = any("by_source" in r for records in all_records for r in records)
    fig, axes = plt.subplots(1, 3 if by_source else 2, figsize=(18 if by_source else 12, 4.5))
    ax_train, ax_valid = axes[:2]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if by_source:
        _plot_sources(axes[2], runs, all_records)
    for i, (run, records) in enumerate(zip(runs, all_records)):
        color = colors[i % len(colors)]
        train = [r for r in records if r["kind"] == "train" and not r.get("skipped")]
        segments: list[tuple[str, str, list, list]] = []
        for r in train:
            if not segments or segments[-1][0] != r["phase"]:
                segments.append((r["phase"], r["objective"], [], []))
            segments[-1][2].append(r["step"])
            segments[-1][3].append(r["loss"])
        for phase, tag, steps, losses in segments:
            ax_train.plot(steps, losses, color=color, linestyle=_line_style(tag, run), label=f"{run.name} {phase}")
        valid = [r for r in records if r["kind"] == "valid"]
        for key in sorted(OBJECTIVES):
            points = [(r["step"], r[key]) for r in valid if key in r]
            if points:
                ax_valid.plot(*zip(*points), color=color, linestyle=_line_style(key, run), marker="o", markersize=3,
                              label=f"{run.name} {key}")
    ax_train.set(title="training loss (dashed: causal objectives, solid: bidirectional)", xlabel="step",
                 ylabel="cross-entropy")
    ax_valid.set(title="validation loss, every validation objective", xlabel="step", ylabel="cross-entropy")
    for ax in (ax_train, ax_valid):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


@entry_point("plot_loss.py")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="log dirs (or metrics.jsonl files)")
    parser.add_argument("--output", type=Path, default=None, help="PNG path (default: <first run>/loss.png)")
    args = parser.parse_args(argv)
    output = args.output or (args.runs[0] if args.runs[0].is_dir() else args.runs[0].parent) / "loss.png"
    print(f"wrote {plot(args.runs, output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
