"""Run the GPU tests and record their outcome, so the state of the GPU path is visible without a GPU.

    .venv/bin/python benchmarks/gpu_check.py                      # on a CUDA machine
    .venv/bin/python benchmarks/gpu_check.py --output-dir $OUT    # e.g. on a lent GPU machine

Runs ``pytest -m gpu tests`` (every ``gpu``-marked test: tests/test_gpu.py and those next to their
CPU counterparts, e.g. in test_checkpoint.py, test_hf_interop.py, test_processes.py) and writes, into
``--output-dir`` (default ``benchmarks/results``):

- ``gpu_check_<device>.log``: pytest's whole output (stdout and stderr, written as it runs, so a
  run killed by a time limit still leaves what it printed). torch.distributed.checkpoint's DEBUG
  records (its ``c10d-NullHandler-dcp_logger`` logs a start and an end record of every save, load
  and planning step, and pytest 9 captures non-propagating loggers too) are dropped: pytest runs
  with ``log_level=WARNING``.
- ``gpu_check_<device>.json``: per test its outcome (passed, failed, error, skipped), seconds and
  first error line (read from pytest's JUnit XML, not from the console text), device name and
  compute capability, driver, torch / CUDA / Transformer Engine / megatron-core versions, and,
  when the bf16 and FP8 biphasic runs both passed, the FP8-vs-bf16 training-loss gap over the last
  20 steps of each phase.

The summary printed at the end gives one line per test, with the first error line of each
failure. Exits with pytest's code. Without CUDA it says so and exits 2 (nothing is written).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))

from megatron_ext import platform  # noqa: E402

PYTEST_OPTIONS = (
    "-v", "-rA", "-p", "no:cacheprovider",
    # Captured log records at WARNING and above only: torch.distributed.checkpoint's logger is set
    # to DEBUG by torch itself (c10d_logger._get_or_create_logger) and would fill the log with a
    # start/end record per checkpoint operation.
    "-o", "log_level=WARNING",
    # xunit1 keeps each test's file (and line) in the XML, so a test is named as pytest names it.
    "-o", "junit_family=xunit1",
)


def run_pytest(targets: list[str], *, log_path: Path, junit_path: Path, marker: str | None = "gpu",
               env: dict | None = None, cwd: Path = REPO) -> int:
    """Run pytest on ``targets`` (only ``marker`` tests when given) with pytest's whole output going
    to ``log_path`` and a JUnit XML report to ``junit_path``; returns pytest's exit code."""
    command = [sys.executable, "-m", "pytest", *PYTEST_OPTIONS, f"--junitxml={junit_path}"]
    if marker:
        command += ["-m", marker]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(command + targets) + "\n\n")
        log.flush()
        return subprocess.run(command + targets, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def _first_line(text: str | None) -> str | None:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0] if lines else None


def _test_id(case: ET.Element) -> str:
    """pytest's node id (``tests/test_gpu.py::test_x[None]``) from an xunit1 ``testcase``."""
    name, classname, file = case.get("name", "?"), case.get("classname", ""), case.get("file")
    if not file:  # xunit2 has no file: the dotted module path is the best there is
        return f"{classname}::{name}" if classname else name
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    inner = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
    return "::".join([file, *inner.split("."), name] if inner else [file, name])


def parse_junit(path: Path) -> list[dict]:
    """One record per test of a pytest JUnit XML report: ``test`` (node id), ``outcome`` (passed,
    failed, error, skipped), ``seconds`` and ``error``: the first line of pytest's message for a
    failure or an error (the exception line, e.g. ``AssertionError: ...``), the reason of a skip,
    else None. A test that failed and then errored in teardown is ``failed`` with the failure's line."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        problem = failure if failure is not None else error
        if problem is not None:
            outcome = "failed" if failure is not None else "error"
            # The message attribute is pytest's crash line; the element's text (the traceback) is
            # the fallback: its first "E   " line is where pytest printed the exception.
            line = _first_line(problem.get("message"))
            if line is None:
                e_lines = [ln[1:].strip() for ln in (problem.text or "").splitlines() if ln.startswith("E ")]
                line = e_lines[0] if e_lines else _first_line(problem.text)
        elif skipped is not None:
            outcome, line = "skipped", _first_line(skipped.get("message") or skipped.text)
        else:
            outcome, line = "passed", None
        tests.append({"test": _test_id(case), "outcome": outcome, "seconds": float(case.get("time", 0) or 0),
                      "error": line})
    return tests


def summary_lines(tests: list[dict]) -> list[str]:
    """One line per test: outcome, node id, seconds, and for failures and errors the first error
    line; then the counts."""
    lines = []
    for t in tests:
        line = f"{t['outcome'].upper():7} {t['test']} ({t['seconds']:.1f} s)"
        if t["outcome"] in ("failed", "error", "skipped") and t["error"]:
            line += f": {t['error']}"
        lines.append(line)
    counts = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    lines.append(", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no tests ran")
    return lines


def loss_gap(out: Path, recipe: str) -> dict | None:
    """Mean |FP8 - bf16| training loss per phase window (last 20 steps of CLM and of MLM)."""
    bf16, fp8 = out / "biphasic_bf16.json", out / f"biphasic_{recipe}.json"
    if not (bf16.is_file() and fp8.is_file()):
        return None
    a = {int(k): v for k, v in json.loads(bf16.read_text())["losses"].items()}
    b = {int(k): v for k, v in json.loads(fp8.read_text())["losses"].items()}
    windows = {"clm_steps_81_100": range(81, 101), "mlm_steps_181_200": range(181, 201)}
    return {name: {"bf16": sum(a[s] for s in w) / len(w), "fp8": sum(b[s] for s in w) / len(w),
                   "mean_abs_gap": sum(abs(a[s] - b[s]) for s in w) / len(w)} for name, w in windows.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=RESULTS,
                        help="where gpu_check_<device>.json and .log go (default: benchmarks/results)")
    args = parser.parse_args(argv)
    if not platform.on_gpu():
        print("gpu_check.py: no CUDA device here; the GPU tests only run on a GPU machine", file=sys.stderr)
        return 2
    import torch

    name = platform.device_name()
    stem = f"gpu_check_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_').lower()}"
    log_path, json_path = args.output_dir / f"{stem}.log", args.output_dir / f"{stem}.json"
    print(f"running the GPU tests; pytest's output goes to {log_path}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        code = run_pytest(["tests"], log_path=log_path, junit_path=junit,
                          env={**os.environ, "GPU_CHECK_OUT": tmp})
        # No XML when pytest could not even start (usage error, crash while collecting).
        tests = parse_junit(junit) if junit.is_file() else []
        gaps = {recipe: loss_gap(Path(tmp), recipe) for recipe in ("delayed", "tensorwise")}
    record = {"device": name, "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())),
              **platform.software_versions(), "pytest_exit_code": code, "log": log_path.name, "tests": tests,
              "fp8_vs_bf16_loss": gaps}
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    print("\n".join(summary_lines(tests)) if tests else f"pytest wrote no report (exit {code}); see {log_path}")
    print(f"wrote {json_path} and {log_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
