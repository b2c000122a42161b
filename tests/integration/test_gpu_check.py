"""``benchmarks/gpu_check.py`` on CPU: its pytest run (whole log, no torch.distributed.checkpoint
DEBUG records, a time limit), its report (JUnit XML -> per-test outcome and first error line;
collection errors apart; the -v log when pytest was killed) and which files it collects, on real
pytest subprocesses over throwaway test files."""

from __future__ import annotations

import textwrap

import pytest

from benchmarks import gpu_check

THROWAWAY = textwrap.dedent('''
    import logging

    import pytest
    import torch
    import torch.distributed.checkpoint as dcp  # at import, as tests/integration/test_gpu.py: pytest then captures its logger


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
    tests, collection_errors = gpu_check.parse_junit(junit)
    assert collection_errors == []
    return {"root": root, "code": code, "log": log.read_text(), "tests": tests}


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
    from megatron_ext import hardware

    if hardware.on_gpu():
        pytest.skip("this machine has a GPU")
    assert gpu_check.main(["--output-dir", str(tmp_path)]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# The marker is spelt in two halves here so that this file, which has no GPU test, is not itself
# selected by gpu_check.gpu_test_files (it reads files for the marker's text).
GPU_MARK = "pytest.mark." + "gpu"
GPU_TESTS_DIR = {
    "test_on_gpu.py": f"""
import pytest

pytestmark = {GPU_MARK}


def test_runs():
    pass
""",
    "test_param_on_gpu.py": f"""
import pytest


@pytest.mark.parametrize("x", [1, pytest.param(2, marks={GPU_MARK})])
def test_one_param_on_gpu(x):
    pass
""",
    "test_broken_gpu.py": f"""
import pytest
import not_installed_anywhere  # missing on this image


@{GPU_MARK}
def test_never_collected():
    pass
""",
    "test_cpu_only.py": """
import pytest
import not_installed_here_either  # a CPU module's import missing on the GPU image: not collected at all


def test_gpu_in_the_name_only():  # a name is not the marker
    pass
""",
}


@pytest.fixture
def gpu_tree(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    (tmp_path / "tests").mkdir()
    for name, text in GPU_TESTS_DIR.items():
        (tmp_path / "tests" / name).write_text(text)
    return tmp_path


def test_only_files_with_gpu_marked_tests_are_collected(gpu_tree):
    assert gpu_check.gpu_test_files(gpu_tree / "tests", gpu_tree) == [
        "tests/test_broken_gpu.py", "tests/test_on_gpu.py", "tests/test_param_on_gpu.py"]
    # This repository's: the modules holding gpu tests, not this one nor the other CPU modules.
    found = gpu_check.gpu_test_files()
    assert {"tests/integration/test_gpu.py", "tests/integration/test_checkpoint.py",
            "tests/integration/test_hf_interop.py", "tests/integration/test_processes.py"} <= set(found)
    assert "tests/integration/test_gpu_check.py" not in found and "tests/unit/test_gpu_path_guards.py" not in found


def test_a_collection_error_is_reported_apart_and_the_other_modules_run(gpu_tree):
    targets = gpu_check.gpu_test_files(gpu_tree / "tests", gpu_tree)
    log, junit = gpu_tree / "out" / "gpu_check_x.log", gpu_tree / "junit.xml"
    code = gpu_check.run_pytest(targets, log_path=log, junit_path=junit, cwd=gpu_tree)
    assert code == 1, log.read_text()[-3000:]  # pytest's "errors", with the other modules run
    tests, collection_errors = gpu_check.parse_junit(junit)
    assert {t["test"]: t["outcome"] for t in tests} == {
        "tests/test_on_gpu.py::test_runs": "passed",
        "tests/test_param_on_gpu.py::test_one_param_on_gpu[2]": "passed"}  # -m gpu: the gpu param only
    assert collection_errors == [{"module": "tests/test_broken_gpu.py",
                                  "error": "ModuleNotFoundError: No module named 'not_installed_anywhere'"}]
    assert "not_installed_here_either" not in log.read_text()  # the CPU-only module was never imported
    lines = gpu_check.summary_lines(tests, collection_errors)
    assert ("COLLECTION ERROR tests/test_broken_gpu.py: ModuleNotFoundError: No module named "
            "'not_installed_anywhere'") in lines
    assert lines[-1] == "2 passed, 1 collection error"
    # The -v log gives the same outcomes and collection error (what a killed run is read from).
    from_log = gpu_check.parse_log(log.read_text())
    assert {t["test"]: t["outcome"] for t in from_log[0]} == {t["test"]: t["outcome"] for t in tests}
    assert from_log[1] == collection_errors


def test_the_time_limit_kills_pytest_and_the_log_says_what_finished(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(120)\n\n"
        "def test_never_reached():\n    pass\n")
    log, junit = tmp_path / "gpu_check_x.log", tmp_path / "junit.xml"
    code = gpu_check.run_pytest(["test_slow.py"], log_path=log, junit_path=junit, marker=None, cwd=tmp_path,
                                extra_args=["-k", "quick or slow or never"], timeout_s=10)
    assert code == gpu_check.TIMED_OUT and not junit.exists()
    text = log.read_text()
    assert "-k 'quick or slow or never'" in text.splitlines()[0] and "pytest killed after the time limit of 10 s" in text
    tests, collection_errors = gpu_check.parse_log(text)
    assert [(t["test"], t["outcome"]) for t in tests] == [("test_slow.py::test_quick", "passed"),
                                                          ("test_slow.py::test_slow", "unfinished")]
    assert collection_errors == [] and all(t["seconds"] is None for t in tests)
    assert gpu_check.summary_lines(tests)[-1] == "1 passed, 1 unfinished"
    assert gpu_check.collected_count(text) == 3  # one never reached: the rest of what was collected
    assert gpu_check.collected_count("created: 6/6 workers\n6 workers [29 items]\n") == 29


def test_the_log_parser_reads_serial_and_xdist_lines():
    log = """$ python -m pytest -v -n 2
[gw1] [ 25%] PASSED tests/test_a.py::test_one
[gw0] [ 50%] FAILED tests/test_a.py::test_two[bf16]
[gw0] [ 75%] ERROR tests/test_a.py::test_two[bf16]
[gw1] [100%] SKIPPED tests/test_b.py::TestGroup::test_three
tests/test_c.py::test_serial PASSED                                      [ 50%]
tests/test_c.py::test_param[a b] FAILED                                  [100%]
___________________ ERROR collecting tests/test_d.py ___________________
ImportError while importing test module '/x/tests/test_d.py'.
E   ModuleNotFoundError: No module named 'apex'
=========================== short test summary info ============================
FAILED tests/test_a.py::test_two[bf16] - AssertionError: no
"""
    tests, collection_errors = gpu_check.parse_log(log)
    assert {t["test"]: t["outcome"] for t in tests} == {
        "tests/test_a.py::test_one": "passed", "tests/test_a.py::test_two[bf16]": "failed",
        "tests/test_b.py::TestGroup::test_three": "skipped", "tests/test_c.py::test_serial": "passed",
        "tests/test_c.py::test_param[a b]": "failed"}
    assert collection_errors == [{"module": "tests/test_d.py", "error": "ModuleNotFoundError: No module named 'apex'"}]


def test_main_refuses_a_time_limit_that_is_not_positive(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--timeout-s", "0"])
    assert "--timeout-s must be > 0" in capsys.readouterr().err
