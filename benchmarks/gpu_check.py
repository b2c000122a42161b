"""Run the GPU tests and record their outcome, so the state of the GPU path is visible without a GPU.

    .venv/bin/python -m benchmarks.gpu_check                      # on a CUDA machine
    .venv/bin/python -m benchmarks.gpu_check --output-dir $OUT    # e.g. on a lent GPU machine
    .venv/bin/python -m benchmarks.gpu_check --tests tests/integration/test_gpu.py::test_kill_and_resume
    .venv/bin/python -m benchmarks.gpu_check -k "biphasic" --pytest-args "-n 4 --dist load" --timeout-s 540

Runs ``pytest -m gpu`` over the test files that hold ``gpu``-marked tests, and only those (found by
reading the files for the marker, ``mark.gpu``, without importing them: tests/integration/test_gpu.py and those
next to their CPU counterparts, e.g. test_checkpoint.py, test_hf_interop.py, test_processes.py). A
module without GPU tests is not collected, so an import it lacks on a GPU image is not counted
against the GPU path; a GPU test module that fails to import is reported as a collection error, apart
from the tests' outcomes, and the other modules still run (``--continue-on-collection-errors``).
``--tests`` runs the given files or node ids instead, ``-k`` selects by pytest's expression,
``--pytest-args`` passes more pytest options (e.g. pytest-xdist's ``-n 4 --dist load``), and
``--timeout-s`` kills pytest after that many seconds and records what finished. Writes, into
``--output-dir`` (default ``benchmarks/results``):

- ``gpu_check_<device>.log``: pytest's whole output (stdout and stderr, written as it runs, so a
  run killed by a time limit still leaves what it printed). torch.distributed.checkpoint's DEBUG
  records (its ``c10d-NullHandler-dcp_logger`` logs a start and an end record of every save, load
  and planning step, and pytest 9 captures non-propagating loggers too) are dropped: pytest runs
  with ``log_level=WARNING``.
- ``gpu_check_<device>.json``: per test its outcome (passed, failed, error, skipped; ``unfinished``
  for the test a time limit interrupted), seconds and first error line (read from pytest's JUnit
  XML, not from the console text; from the ``-v`` log lines, without seconds or error lines, when
  pytest was killed before writing the XML), the collection errors (module and exception line),
  whether the time limit struck, the files run, device name and compute capability, driver, torch /
  CUDA / Transformer Engine / megatron-core versions, and, when the bf16 and FP8 biphasic runs both
  passed, the FP8-vs-bf16 training-loss gap over the last 20 steps of each phase.

The summary printed at the end gives one line per test, with the first error line of each
failure, then one per collection error. Exits with pytest's code (124 when the time limit killed
it). Without CUDA it says so and exits 2 (nothing is written).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from megatron_ext import hardware

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

PYTEST_OPTIONS = (
    "-v", "-rA", "-p", "no:cacheprovider",
    # Captured log records at WARNING and above only: torch.distributed.checkpoint's logger is set
    # to DEBUG by torch itself (c10d_logger._get_or_create_logger) and would fill the log with a
    # start/end record per checkpoint operation.
    "-o", "log_level=WARNING",
    # xunit1 keeps each test's file (and line) in the XML, so a test is named as pytest names it.
    "-o", "junit_family=xunit1",
    # A GPU test module that fails to import is reported; the others still run (pytest's default
    # is to run nothing at all after a collection error).
    "--continue-on-collection-errors",
)
TIMED_OUT = 124
"""Exit code when ``--timeout-s`` killed pytest (as coreutils' ``timeout``)."""
GPU_MARKER = re.compile(r"\bmark\.gpu\b")
"""How a test file marks GPU tests: ``@pytest.mark.gpu``, ``pytestmark = pytest.mark.gpu``,
``pytest.param(..., marks=pytest.mark.gpu)``."""


def gpu_test_files(tests_dir: Path = REPO / "tests", root: Path = REPO) -> list[str]:
    """The test files (``test_*.py`` under ``tests_dir``, relative to ``root``) that hold
    ``gpu``-marked tests, read as text: a module is not imported to find out, so one whose imports
    are missing here (and that has no GPU test) is never collected."""
    return sorted(str(path.relative_to(root)) for path in tests_dir.rglob("test_*.py")
                  if GPU_MARKER.search(path.read_text(encoding="utf-8")))


def run_pytest(targets: list[str], *, log_path: Path, junit_path: Path, marker: str | None = "gpu",
               env: dict | None = None, cwd: Path = REPO, extra_args: list[str] = (),
               timeout_s: float | None = None) -> int:
    """Run pytest on ``targets`` (only ``marker`` tests when given; ``extra_args`` after the fixed
    options) with pytest's whole output going to ``log_path`` and a JUnit XML report to
    ``junit_path``; returns pytest's exit code, or ``TIMED_OUT`` when it ran past ``timeout_s``
    (then pytest and every process it started, xdist workers included, are killed)."""
    command = [sys.executable, "-m", "pytest", *PYTEST_OPTIONS, f"--junitxml={junit_path}"]
    if marker:
        command += ["-m", marker]
    command += list(extra_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(command + targets) + "\n\n")
        log.flush()
        # A session of its own: the time limit kills pytest's whole process group (xdist workers,
        # the training processes tests start), not this script.
        # Unbuffered: the -v lines of a run the time limit kills are in the log up to its last test.
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        run = subprocess.Popen(command + targets, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            return run.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            log.write(f"\n[gpu_check] pytest killed after the time limit of {timeout_s:g} s\n")
            return TIMED_OUT


def _first_line(text: str | None) -> str | None:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0] if lines else None


def _test_id(case: ET.Element) -> str:
    """pytest's node id (``tests/integration/test_gpu.py::test_x[None]``) from an xunit1 ``testcase``."""
    name, classname, file = case.get("name", "?"), case.get("classname", ""), case.get("file")
    if not file:  # xunit2 has no file: the dotted module path is the best there is
        return f"{classname}::{name}" if classname else name
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    inner = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
    return "::".join([file, *inner.split("."), name] if inner else [file, name])


def _exception_line(text: str | None) -> str | None:
    """The exception pytest printed in a traceback: its last ``E   `` line (else the first line)."""
    e_lines = [line[1:].strip() for line in (text or "").splitlines() if line.startswith("E ")]
    return e_lines[-1] if e_lines else _first_line(text)


def parse_junit(path: Path) -> tuple[list[dict], list[dict]]:
    """The tests and the collection errors of a pytest JUnit XML report.

    Tests: one record per test, ``test`` (node id), ``outcome`` (passed, failed, error, skipped),
    ``seconds`` and ``error``: the first line of pytest's message for a failure or an error (the
    exception line, e.g. ``AssertionError: ...``), the reason of a skip, else None. A test that
    failed and then errored in teardown is ``failed`` with the failure's line.

    Collection errors: one record per module pytest could not collect (its ``collection failure``
    error), ``module`` (the file) and ``error`` (the exception, e.g. ``ModuleNotFoundError: No
    module named 'x'``); no test of that module ran."""
    tests, collection_errors = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        if error is not None and error.get("message") == "collection failure":
            module = case.get("file") or ".".join(filter(None, (case.get("classname"), case.get("name"))))
            collection_errors.append({"module": module, "error": _exception_line(error.text)})
            continue
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
    return tests, collection_errors


_LOG_OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
                 "XFAIL": "skipped", "XPASS": "passed"}
# pytest -v: "tests/test_x.py::test_y PASSED   [ 50%]" (the node id is printed when the test starts,
# the outcome when it ends); pytest-xdist -v: "[gw0] [ 50%] PASSED tests/test_x.py::test_y".
_SERIAL_LINE = re.compile(r"^(?P<test>\S+::\S.*?) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_XDIST_LINE = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?P<test>\S+::\S+)")
_STARTED_LINE = re.compile(r"^(?P<test>\S+\.py::\S+) *$")
_COLLECTING = re.compile(r"^_+ ERROR collecting (?P<module>\S+) _+$")


_COLLECTED = re.compile(r"^(?:\d+ workers \[(?P<xdist>\d+) items?\]|(?:collecting \.\.\. )?collected (?P<serial>\d+) items?)", re.M)


def collected_count(text: str) -> int | None:
    """How many tests pytest collected, from its output (``collected N items``, or pytest-xdist's
    ``K workers [N items]``): what a run cut by its time limit did not finish is the rest."""
    found = _COLLECTED.search(text)
    return None if found is None else int(found["xdist"] or found["serial"])


def parse_log(text: str) -> tuple[list[dict], list[dict]]:
    """The tests and the collection errors read from pytest's ``-v`` output, for a run killed
    before it wrote its JUnit XML: each test's outcome (``unfinished`` for one that started and
    never ended: the one the time limit interrupted), no seconds and no error line (None); each
    module pytest failed to collect with the exception it printed. Same records as
    :func:`parse_junit`."""
    outcomes: dict[str, str] = {}
    collection_errors: list[dict] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        found = _XDIST_LINE.match(line) or _SERIAL_LINE.match(line)
        if found:
            test = found["test"].strip()
            # A test that failed and then errored in teardown prints FAILED then ERROR: keep the failure.
            if outcomes.get(test) != "failed":
                outcomes[test] = _LOG_OUTCOMES[found["outcome"]]
        elif (started := _STARTED_LINE.match(line)) and started["test"] not in outcomes:
            outcomes[started["test"]] = "unfinished"
        elif collecting := _COLLECTING.match(line):
            block = []
            for following in lines[i + 1:]:
                if following.startswith("___") or following.startswith("==="):
                    break
                block.append(following)
            collection_errors.append({"module": collecting["module"], "error": _exception_line("\n".join(block))})
    tests = [{"test": test, "outcome": outcome, "seconds": None, "error": None} for test, outcome in outcomes.items()]
    return tests, collection_errors


def summary_lines(tests: list[dict], collection_errors: list[dict] = ()) -> list[str]:
    """One line per test: outcome, node id, seconds (when known), and for failures and errors the
    first error line; one per collection error (module and exception); then the counts."""
    lines = []
    for t in tests:
        seconds = f" ({t['seconds']:.1f} s)" if t["seconds"] is not None else ""
        line = f"{t['outcome'].upper():7} {t['test']}{seconds}"
        if t["outcome"] in ("failed", "error", "skipped") and t["error"]:
            line += f": {t['error']}"
        lines.append(line)
    for c in collection_errors:
        lines.append(f"COLLECTION ERROR {c['module']}: {c['error']}")
    counts = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    parts = [f"{n} {outcome}" for outcome, n in sorted(counts.items())]
    if collection_errors:
        parts.append(f"{len(collection_errors)} collection error{'s' if len(collection_errors) > 1 else ''}")
    lines.append(", ".join(parts) or "no tests ran")
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
    parser.add_argument("--tests", nargs="+", metavar="FILE_OR_NODE_ID",
                        help="run these test files or node ids (their gpu-marked tests) instead of every file "
                             "holding gpu tests, e.g. tests/integration/test_gpu.py::test_kill_and_resume")
    parser.add_argument("-k", dest="keyword", metavar="EXPRESSION",
                        help="only the gpu tests matching this pytest -k expression")
    parser.add_argument("--pytest-args", default="", metavar="ARGS",
                        help='more pytest options, one shell-quoted string, e.g. "-n 4 --dist load" (pytest-xdist)')
    parser.add_argument("--timeout-s", type=float, metavar="SECONDS",
                        help="kill pytest after this many seconds and record what finished (exit code 124)")
    args = parser.parse_args(argv)
    if args.timeout_s is not None and args.timeout_s <= 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s:g}")
    if not hardware.on_gpu():
        print("gpu_check.py: no CUDA device here; the GPU tests only run on a GPU machine", file=sys.stderr)
        return 2
    import torch

    targets = args.tests or gpu_test_files()
    extra = shlex.split(args.pytest_args) + (["-k", args.keyword] if args.keyword else [])
    name = hardware.device_name()
    stem = f"gpu_check_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_').lower()}"
    log_path, json_path = args.output_dir / f"{stem}.log", args.output_dir / f"{stem}.json"
    print(f"running the GPU tests of {', '.join(targets)}; pytest's output goes to {log_path}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        code = run_pytest(targets, log_path=log_path, junit_path=junit, extra_args=extra, timeout_s=args.timeout_s,
                          env={**os.environ, "GPU_CHECK_OUT": tmp})
        # No XML when pytest was killed or could not even start (usage error): the -v log instead.
        report = "junit" if junit.is_file() else "log"
        tests, collection_errors = (parse_junit(junit) if report == "junit"
                                    else parse_log(log_path.read_text(encoding="utf-8", errors="replace")))
        gaps = {recipe: loss_gap(Path(tmp), recipe) for recipe in ("delayed", "tensorwise")}
    record = {"device": name, "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())),
              **hardware.software_versions(), "pytest_exit_code": code, "timed_out": code == TIMED_OUT,
              "files": targets, "report_from": report, "log": log_path.name,
              "collected": collected_count(log_path.read_text(encoding="utf-8", errors="replace")), "tests": tests,
              "collection_errors": collection_errors, "fp8_vs_bf16_loss": gaps}
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    if tests or collection_errors:
        print("\n".join(summary_lines(tests, collection_errors)))
    else:
        print(f"pytest reported no tests (exit {code}); see {log_path}")
    if code == TIMED_OUT:
        print(f"pytest was killed after --timeout-s {args.timeout_s:g}; the record holds what finished")
    print(f"wrote {json_path} and {log_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
