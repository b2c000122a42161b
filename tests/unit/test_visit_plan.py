"""``benchmarks/visit_plan.py`` and the GPU suite's plan: a known side is re-measured only when no
visit on this device kind timed it or its own code changed since (docstrings and comments are not
code), the gpu tests already passed on a kind are deselected, FP8 at 1B waits for its GEMMs to pay,
and ``--stages`` runs a stage whatever the plan says."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu_suite, visit_plan
from benchmarks.gpu_suite import Budget, Machine, Stage, StageContext, StageResult, VisitPlan

GPU = Machine(gpu=True, transformer_engine=True, fp8=True, device="NVIDIA H100 80GB HBM3", gpu_count=1, xdist=True)
SIDE = visit_plan.KnownSide(name="local_spec", settings={"transformer_impl": "local", "cuda_graphs": "none"},
                            sources=("pkg/attention.py", "bench.py::hf_model", "requirements.txt"))


def _tree(tmp_path: Path, attention: str, bench: str = "def hf_model():\n    return 1\n") -> Path:
    (tmp_path / "pkg").mkdir(parents=True, exist_ok=True)
    (tmp_path / "pkg" / "attention.py").write_text(attention)
    (tmp_path / "bench.py").write_text(bench)
    (tmp_path / "requirements.txt").write_text("torch==2.11\n")
    return tmp_path


def test_a_fingerprint_sees_code_not_docstrings_or_comments(tmp_path):
    base = visit_plan.fingerprint(SIDE, visit_plan._read_tree(_tree(tmp_path / "a", 'def f(x):\n    return x + 1\n')))
    documented = _tree(tmp_path / "b", '"""Module doc."""\n# a comment\ndef f(x):\n    """Doc."""\n    return x + 1  # why\n')
    assert visit_plan.fingerprint(SIDE, visit_plan._read_tree(documented)) == base
    changed = _tree(tmp_path / "c", 'def f(x):\n    return x + 2\n')
    assert visit_plan.fingerprint(SIDE, visit_plan._read_tree(changed)) != base
    # Only the named definition of a file counts: another function of bench.py changes nothing.
    other = _tree(tmp_path / "d", 'def f(x):\n    return x + 1\n',
                  bench="def hf_model():\n    return 1\n\ndef unrelated():\n    return 2\n")
    assert visit_plan.fingerprint(SIDE, visit_plan._read_tree(other)) == base


def _visit(visits: Path, name: str, sides: list[dict], fingerprints: dict | None, tests: list[dict] = ()) -> Path:
    visit = visits / name
    (visit / "throughput_1b_bf16").mkdir(parents=True)
    stages = [{"name": "throughput_1b_bf16", "status": "passed", "exit_code": 0, "reason": None, "figures": {"rows": [
        {"row": visit_plan.KNOWN_ROW, "hf_tokens_per_s": 1.0 if any(s["side"] == "hf" for s in sides) else None}]}}]
    if tests:
        stages.append({"name": "gpu_tests", "status": "passed", "exit_code": 0, "reason": None, "figures": {}})
    (visit / "summary.json").write_text(json.dumps({"device": "x", "commit": "abc", "budget_s": 600, "elapsed_s": 590,
                                                    "stages": stages}))
    (visit / "throughput_1b_bf16" / "throughput.sides.jsonl").write_text(
        "".join(json.dumps({"row": visit_plan.KNOWN_ROW, "tokens_per_s": 10.0, **s}) + "\n" for s in sides))
    if fingerprints is not None:
        visit_plan.write_fingerprints(visit, fingerprints, commit="abc", how="test")
    if tests:
        (visit / "gpu_tests").mkdir()
        (visit / "gpu_tests" / "gpu_check_x.json").write_text(json.dumps({"tests": list(tests)}))
    return visit


def test_known_sides_are_remeasured_when_never_timed_on_the_kind_or_their_code_changed(tmp_path):
    current = {name: "same" for name in visit_plan.KNOWN_SIDES}
    local = {"side": "megatron_ext", "settings": {"transformer_impl": "local", "cuda_graphs": "none"}}
    graphs = {"side": "cuda_graphs", "settings": {"transformer_impl": "te", "cuda_graphs": "local"}}  # the old spelling
    _visit(tmp_path, "h100-2026-11-27", [local, graphs, {"side": "hf"}],
           {**current, "te_spec_cuda_graphs": "older"})
    _visit(tmp_path, "h200-2026-11-26", [{"side": "local_spec"}], None)  # no settings recorded, no fingerprints
    h100 = visit_plan.plan_known_sides("h100", visits_dir=tmp_path, current=current)
    assert not h100["local_spec"].remeasure and "h100-2026-11-27" in h100["local_spec"].reason  # the default side then
    assert not h100["hf"].remeasure
    assert h100["te_spec_cuda_graphs"].remeasure and "code changed since h100-2026-11-27" in h100["te_spec_cuda_graphs"].reason
    assert h100["local_spec_cuda_graphs"].remeasure and "never timed on an H100" in h100["local_spec_cuda_graphs"].reason
    h200 = visit_plan.plan_known_sides("h200", visits_dir=tmp_path, current=current)
    assert h200["local_spec"].remeasure and "recorded no fingerprint" in h200["local_spec"].reason
    assert h200["hf"].remeasure and "never timed on an H200" in h200["hf"].reason


def test_the_suite_deselects_the_tests_passed_on_this_kind_and_times_only_changed_known_sides(tmp_path):
    _visit(tmp_path, "h100-2026-11-27", [], None, tests=[
        {"test": "tests/integration/test_gpu.py::test_a[x]", "outcome": "passed"},
        {"test": "tests/integration/test_gpu.py::test_b", "outcome": "failed"}])
    assert visit_plan.passed_gpu_tests("h100", visits_dir=tmp_path) == {"tests/integration/test_gpu.py::test_a[x]"}
    assert visit_plan.passed_gpu_tests("h200", visits_dir=tmp_path) == set()
    plan = VisitPlan(kind="h100", remeasure={"local_spec": "code changed"}, known={"hf": "timed", "te_spec_cuda_graphs": "timed"},
                     passed_tests=frozenset({"tests/integration/test_gpu.py::test_a[x]"}))
    stages = {s.name: s for s in gpu_suite.STAGES}
    ctx = StageContext(machine=GPU, stage_dir=tmp_path / "s", data_dir=None, cap_s=200, plan=plan)
    new_tests = stages["gpu_tests_new"].command(ctx)
    assert "--deselect 'tests/integration/test_gpu.py::test_a[x]'" in new_tests[new_tests.index("--pytest-args") + 1]
    known = stages["throughput_1b_known"].command(ctx)
    assert known[known.index("--variants") + 1:known.index("--no-baseline")] == ["local_spec"]
    assert stages["throughput_1b_known"].skip_if(ctx, {}) is None
    answered = StageContext(machine=GPU, stage_dir=tmp_path / "s", data_dir=None, cap_s=200,
                            plan=VisitPlan(kind="h100", remeasure={}, known={"hf": "timed in v"}))
    assert "every known side is answered" in stages["throughput_1b_known"].skip_if(answered, {})
    hf_changed = StageContext(machine=GPU, stage_dir=tmp_path / "s", data_dir=None, cap_s=200,
                              plan=VisitPlan(kind="h100", remeasure={"hf": "never timed"}, known={}))
    assert "--no-baseline" not in stages["throughput_1b_known"].command(hf_changed)


def test_fp8_at_1b_waits_for_its_gemms_to_pay():
    skip = {s.name: s for s in gpu_suite.STAGES}["throughput_1b_fp8"].skip_if
    ctx = StageContext(machine=GPU, stage_dir=Path("/x"), data_dir=None, cap_s=100)

    def gemm(at_1b: dict, status: str = "passed") -> dict:
        return {"fp8_gemm": StageResult(name="fp8_gemm", purpose="", status=status,
                                        figures={"fp8_speedup_vs_bf16": {"1b": at_1b}})}
    assert "x0.91 of bf16" in skip(ctx, gemm({"fp8_delayed": 0.91, "fp8_tensorwise": 0.85}))
    assert skip(ctx, gemm({"fp8_delayed": 1.12, "fp8_tensorwise": 0.95})) is None
    assert skip(ctx, gemm({"fp8_delayed": 0.5}, status="timed_out")) is None  # no answer: the step decides
    assert skip(ctx, {}) is None


def test_a_skipped_stage_says_why_and_named_stages_run_whatever_the_plan(tmp_path):
    stage = Stage(name="known", purpose="", command=lambda ctx: [gpu_suite.sys.executable, "-c", "pass"],
                  max_s=30, min_s=1, skip_if=lambda ctx, results: "answered in h100-2026-11-27")
    (result,) = gpu_suite.run_suite([stage], machine=GPU, budget=Budget(60, 5), output_dir=tmp_path / "a")
    assert result.status == "skipped" and result.reason == "answered in h100-2026-11-27"
    (result,) = gpu_suite.run_suite([stage], machine=GPU, budget=Budget(60, 5), output_dir=tmp_path / "b", chosen=True)
    assert result.status == "passed"


def test_the_committed_visits_have_fingerprints_and_the_plan_reads_them():
    """Every suite visit committed holds the fingerprints the next plan compares against."""
    for visit in visit_plan.VISITS_DIR.iterdir():
        if (visit / "summary.json").is_file():
            record = json.loads((visit / visit_plan.FINGERPRINTS_FILE).read_text())
            assert set(record["sides"]) == set(visit_plan.KNOWN_SIDES), visit.name
    decisions = visit_plan.plan_known_sides("h100")
    assert set(decisions) == set(visit_plan.KNOWN_SIDES) and all(d.reason for d in decisions.values())
