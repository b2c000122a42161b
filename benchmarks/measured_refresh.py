"""Rewrite (or check) the measured speeds the package ships, ``megatron_ext/measured/measurements.json``,
from a checkout's benchmark results, each file's provenance from git (the commit that added it):

    python -m benchmarks.measured_refresh --refresh benchmarks/results   # after a GPU visit is committed
    python -m benchmarks.measured_refresh --check benchmarks/results     # exit 1 when it is out of date

The records are read by the package's own reader (``megatron_ext.performance.measured_speeds``, which
asks no git); ``tests/unit/test_measured_refresh.py`` checks the packaged file is current.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from megatron_ext.performance.measured_speeds import packaged_path, read_results, to_json


def _git_added(results_dir: Path) -> dict[str, tuple[str, str]]:
    """``{path relative to results_dir: (commit, date)}`` of the commit that added each file."""
    try:
        top = subprocess.run(["git", "-C", str(results_dir), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.strip()
        log = subprocess.run(["git", "-C", top, "log", "--diff-filter=A", "--name-only", "--format=@%h %cs", "--",
                              str(results_dir.resolve())], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, tuple[str, str]] = {}
    commit = date = ""
    for line in log.splitlines():
        if line.startswith("@"):
            commit, date = line[1:].split(" ", 1)
        elif line.strip():
            path = (Path(top) / line.strip()).resolve()
            try:
                found.setdefault(str(path.relative_to(results_dir.resolve())), (commit, date))
            except ValueError:
                continue
    return found


def refreshed(results_dir: Path) -> str:
    """What the packaged file holds when refreshed from ``results_dir`` (a checkout's
    ``benchmarks/results``)."""
    return to_json(read_results(results_dir, added=_git_added(results_dir)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Refresh or check the measurements shipped with the package.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--refresh", type=Path, metavar="RESULTS_DIR",
                      help="rewrite the packaged measurements from a checkout's benchmarks/results")
    mode.add_argument("--check", type=Path, metavar="RESULTS_DIR",
                      help="exit 1 when the packaged measurements are not what RESULTS_DIR gives")
    args = parser.parse_args(argv)
    results_dir = args.refresh or args.check
    if not results_dir.is_dir():
        parser.error(f"{results_dir}: no such directory (expected a checkout's benchmarks/results)")
    text = refreshed(results_dir)
    if args.refresh:
        packaged_path().write_text(text)
        counts = json.loads(text)
        print(f"wrote {packaged_path()}: {len(counts['throughput'])} throughput rows, "
              f"{len(counts['finetune'])} fine-tuning speeds")
        return 0
    if packaged_path().read_text() != text:
        print(f"{packaged_path()} is not what {results_dir} gives: run python -m benchmarks.measured_refresh "
              f"--refresh {results_dir}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
