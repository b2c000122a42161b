"""``benchmarks/gpu_visits.py``: GPU visit folders are read in one date order, with each stage's sides
and gpu-test reports, and a missing or malformed file is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_visits
from megatron_ext.config_loading import UserError


def _stage(name: str, status: str = "passed", **figures) -> dict:
    return {"name": name, "status": status, "exit_code": 0 if status == "passed" else 1, "reason": None,
            "figures": figures}


def _visit(root: Path, name: str, *stages: dict, device: str = "NVIDIA H100 80GB HBM3") -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "summary.json").write_text(json.dumps(
        {"device": device, "commit": "abc1234", "budget_s": 600.0, "elapsed_s": 512.5, "stages": list(stages)}))
    return root / name


def test_visits_are_read_newest_first_by_date_then_the_same_days_suffix(tmp_path):
    for name in ("h100-2026-11-26", "h200-2026-11-26b", "h100-2026-11-27", "b200-2026-12-01", "h200-2026-11-26c"):
        _visit(tmp_path, name)
    (tmp_path / "h100-2026-11-22").mkdir()  # a visit before the suite: other files, no summary.json
    (tmp_path / "h100-2026-11-22" / "throughput_gpu.json").write_text("{}")
    visits = gpu_visits.read_visits(tmp_path)
    assert [v.name for v in visits] == ["b200-2026-12-01", "h100-2026-11-27", "h200-2026-11-26c", "h200-2026-11-26b",
                                        "h100-2026-11-26"]
    newest = visits[0]
    assert (newest.kind, newest.date, newest.suffix, newest.device, newest.commit, newest.budget_s, newest.elapsed_s) == (
        "b200", "2026-12-01", "", "NVIDIA H100 80GB HBM3", "abc1234", 600.0, 512.5)
    assert visits[2].suffix == "c"


def test_a_stage_gives_its_sides_in_todays_spelling_and_its_gpu_test_reports(tmp_path):
    visit = _visit(tmp_path, "h100-2026-11-27", _stage("throughput_1b_bf16", "timed_out", rows=[]),
                   _stage("gpu_tests"), _stage("skipped_one", "skipped"))
    sides = [{"row": "1b seq 2048 bf16", "side": "megatron_ext", "tokens_per_s": 60_000.0, "peak_mem_gb": 49.0,
              "flops_per_token": 6.2e9, "error": None,
              "settings": {"micro_batch_size": 9, "transformer_impl": "local", "cuda_graphs": "none"}},
             {"row": "1b seq 2048 bf16", "side": "cuda_graphs", "tokens_per_s": None, "error": "OOM",
              "settings": {"transformer_impl": "local", "cuda_graphs": "local"}}]  # cuda_graphs' old spelling
    (visit / "throughput_1b_bf16").mkdir()
    (visit / "throughput_1b_bf16" / "throughput.sides.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sides))
    (visit / "gpu_tests").mkdir()
    (visit / "gpu_tests" / "gpu_check_nvidia_h100.json").write_text(json.dumps({"tests": [
        {"test": "tests/integration/test_gpu.py::test_a", "outcome": "passed", "error": None},
        {"test": "tests/integration/test_gpu.py::test_b", "outcome": "failed", "error": "AssertionError"}],
        "collection_errors": [], "pytest_exit_code": 1}))
    throughput, tests, skipped = gpu_visits.read_visit(visit).stages
    assert (throughput.status, throughput.ran_out_of_time, tests.runs_gpu_tests) == ("timed_out", True, True)
    recipe, graphs = throughput.sides()
    assert (recipe.side, recipe.tokens_per_s, recipe.micro_batch_size, recipe.flops_per_token) == (
        "megatron_ext", 60_000.0, 9, 6.2e9)
    assert graphs.settings["cuda_graphs"] == "megatron" and graphs.tokens_per_s is None and graphs.error == "OOM"
    # A summary that holds the sides (the suite copies them in when the stage ends) is read from there.
    held = gpu_visits.read_visit(_visit(tmp_path / "b", "h100-2026-11-28", _stage(
        "throughput_1b_bf16", sides=[{"row": "1b seq 2048 bf16", "side": "hf", "tokens_per_s": 1.0}])))
    assert [s.side for s in held.stages[0].sides()] == ["hf"]
    (report,) = tests.gpu_test_reports()
    assert report.passed() == {"tests/integration/test_gpu.py::test_a"} and report.pytest_exit_code == 1
    assert skipped.sides() == () and skipped.gpu_test_reports() == ()
    assert gpu_visits.read_visit(visit).fingerprints() is None
    (visit / "fingerprints.json").write_text(json.dumps({"commit": "abc1234", "how": "test", "sides": {"hf": "0a1b"}}))
    assert gpu_visits.read_visit(visit).fingerprints() == {"hf": "0a1b"}


def test_a_missing_or_malformed_visit_file_is_refused_naming_it(tmp_path):
    (tmp_path / "h100-2026-11-27").mkdir()
    with pytest.raises(UserError, match=r"h100-2026-11-27/summary.json: missing \(expected the summary"):
        gpu_visits.read_visit(tmp_path / "h100-2026-11-27")
    (tmp_path / "h100-2026-11-27" / "summary.json").write_text('{"device": "x",\n  oops}')
    with pytest.raises(UserError, match=r"h100-2026-11-27/summary.json: line 2: not JSON"):
        gpu_visits.read_visits(tmp_path)
    (tmp_path / "h100-2026-11-27" / "summary.json").write_text(json.dumps({"device": "x", "commit": None, "stages": []}))
    with pytest.raises(UserError, match=r"summary.json: no 'budget_s', 'elapsed_s' \(expected the summary"):
        gpu_visits.read_visits(tmp_path)
    visit = _visit(tmp_path / "b", "h100-2026-11-27", {"name": "gpu_tests", "status": "passed"})
    with pytest.raises(UserError, match=r"summary.json: stages\[0\]: no 'exit_code', 'reason', 'figures'"):
        gpu_visits.read_visit(visit)
    _visit(tmp_path / "c", "h100-latest")
    with pytest.raises(UserError, match=r"h100-latest: a GPU visit folder is named <kind>-<YYYY-MM-DD>\[suffix\]"):
        gpu_visits.read_visits(tmp_path / "c")
    visit = _visit(tmp_path / "d", "h100-2026-11-27", _stage("throughput_1b_bf16"))
    (visit / "throughput_1b_bf16").mkdir()
    (visit / "throughput_1b_bf16" / "throughput.sides.jsonl").write_text('{"row": "1b seq 2048 bf16", "side": "hf"}\n'
                                                                         '{"row": "1b seq 2048 bf16"}\n')
    with pytest.raises(UserError, match=r"throughput.sides.jsonl:2: no 'side'"):
        gpu_visits.read_visit(visit).stages[0].sides()

