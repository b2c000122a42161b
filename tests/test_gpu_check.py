"""``benchmarks/gpu_check.py`` on CPU: its pytest run (whole log, no torch.distributed.checkpoint
DEBUG records) and its report (JUnit XML -> per-test outcome and first error line), on a real pytest
subprocess over a throwaway test file."""

from __future__ import annotations

import textwrap

import pytest

from benchmarks import gpu_check

THROWAWAY = textwrap.dedent('''
    import logging

    import pytest
    import torch
    import torch.distributed.checkpoint as dcp  # at import, as tests/test_gpu.py: pytest then captures its logger


    @pytest.fixture
    def broken():
        raise RuntimeError("fixture exploded")


    def test_passes():
        print("x" * 30_000)  # more than the 20,000 characters the old log kept


    def test_fails():
        assert 1 + 1 == 3, "arithmetic is off\\nsecond line of the message"


    def test_errors(broken):
        pass


    @pytest.mark.skip(reason="not on this machine")
    def test_skipped():
        pass


    class TestGroup:
        def test_in_class(self):
            raise ValueError("from a class")


    def test_checkpoint_logs(tmp_path):
        dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "ckpt"))
        logging.getLogger("throwaway").warning("a warning that must stay")
''')


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """gpu_check's pytest run over the throwaway file: exit code, log text, parsed tests."""
    root = tmp_path_factory.mktemp("throwaway")
    (root / "test_throwaway.py").write_text(THROWAWAY)
    log, junit = root / "out" / "gpu_check_x.log", root / "junit.xml"
    code = gpu_check.run_pytest(["test_throwaway.py"], log_path=log, junit_path=junit, marker=None, cwd=root)
    return {"root": root, "code": code, "log": log.read_text(), "tests": gpu_check.parse_junit(junit)}


def test_each_test_gets_its_outcome_and_first_error_line(report):
    assert report["code"] == 1  # pytest's "some tests failed"
    by_id = {t["test"]: t for t in report["tests"]}
    assert set(by_id) == {f"test_throwaway.py::{name}" for name in (
        "test_passes", "test_fails", "test_errors", "test_skipped", "TestGroup::test_in_class",
        "test_checkpoint_logs")}
    outcome = {test_id.split("::", 1)[1]: (t["outcome"], t["error"]) for test_id, t in by_id.items()}
    assert outcome["test_passes"] == ("passed", None)
    assert outcome["test_checkpoint_logs"] == ("passed", None)
    # The exception line only: the message's second line and pytest's assertion rewriting stay out.
    assert outcome["test_fails"] == ("failed", "AssertionError: arithmetic is off")
    assert outcome["test_errors"][0] == "error" and "RuntimeError: fixture exploded" in outcome["test_errors"][1]
    assert outcome["test_skipped"] == ("skipped", "not on this machine")
    assert outcome["TestGroup::test_in_class"] == ("failed", "ValueError: from a class")
    assert all(t["seconds"] >= 0 for t in report["tests"])


def test_summary_names_each_failure_with_its_error(report):
    lines = gpu_check.summary_lines(report["tests"])
    assert "FAILED  test_throwaway.py::test_fails" in "\n".join(lines)
    (fails,) = [line for line in lines if "::test_fails" in line]
    assert fails.startswith("FAILED") and fails.endswith(": AssertionError: arithmetic is off")
    (passes,) = [line for line in lines if "::test_passes" in line]
    assert passes.startswith("PASSED") and passes.endswith("s)")
    assert lines[-1] == "1 error, 2 failed, 2 passed, 1 skipped"


def test_the_log_is_whole_and_has_no_checkpoint_debug_records(report):
    log = report["log"]
    assert log.startswith("$ ") and "-o log_level=WARNING" in log.splitlines()[0]
    assert "x" * 30_000 in log  # nothing cut
    assert "a warning that must stay" in log  # captured records at WARNING and above are kept
    assert "dcp_logger" not in log and "DEBUG" not in log


def test_without_the_log_level_torch_checkpoint_fills_the_log(report):
    """The control: the same test under plain pytest logs torch.distributed.checkpoint's start/end
    DEBUG records (pytest 9 captures non-propagating loggers too), the records the option drops."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                          "test_throwaway.py::test_checkpoint_logs"], cwd=report["root"], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "DEBUG    c10d-NullHandler-dcp_logger" in run.stdout


def test_main_refuses_without_a_gpu(tmp_path, capsys):
    from megatron_ext import platform

    if platform.on_gpu():
        pytest.skip("this machine has a GPU")
    assert gpu_check.main(["--output-dir", str(tmp_path)]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
