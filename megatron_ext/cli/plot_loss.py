"""Plot training and validation loss curves of one or more runs to a PNG.

    python tools/plot_loss.py runs/demo [runs/other ...] --output runs/demo/loss.png

Reads each run's ``metrics.jsonl`` (written by ``pretrain_encoder.py`` into ``logging.log_dir``).
Left panel: training loss per step, drawn per phase (CLM and MLM losses are different quantities,
so a phase change shows as a jump, not as progress). Right panel: validation loss of both
objectives at every evaluation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_ext.cli.entry import ArgumentParser, entry_point
from megatron_ext.config_loading import UserError


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


def plot(runs: list[Path], output: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        records = read_metrics(run)
        color = colors[i % len(colors)]
        train = [r for r in records if r["kind"] == "train" and not r.get("skipped")]
        segments: list[tuple[str, list, list]] = []
        for r in train:
            if not segments or segments[-1][0] != r["objective"]:
                segments.append((r["objective"], [], []))
            segments[-1][1].append(r["step"])
            segments[-1][2].append(r["loss"])
        for objective, steps, losses in segments:
            ax_train.plot(steps, losses, color=color, linestyle="-" if objective == "mlm" else "--",
                          label=f"{run.name} {objective}")
        valid = [r for r in records if r["kind"] == "valid"]
        for objective, style in (("clm", "--"), ("mlm", "-")):
            points = [(r["step"], r[objective]) for r in valid if objective in r]
            if points:
                ax_valid.plot(*zip(*points), color=color, linestyle=style, marker="o", markersize=3,
                              label=f"{run.name} {objective}")
    ax_train.set(title="training loss (dashed: CLM, solid: MLM)", xlabel="step", ylabel="cross-entropy")
    ax_valid.set(title="validation loss, both objectives", xlabel="step", ylabel="cross-entropy")
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
