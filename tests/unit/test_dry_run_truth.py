"""``pretrain_encoder.py --dry-run`` tells the truth: it never fails where the run would train (a
batch-size ramp-up), never judges a plan by the memory of a machine that does not run it, names the
phase's own keys in a phase's advice and only flags the trainer has, and counts the attention
isolated documents actually compute (estimated from the data, saying from where)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron_ext.cli import pretrain_encoder
from helpers import tiny_recipe
from megatron_ext import hardware
from megatron_ext.config_loading import UserError
from megatron_ext.performance.flops import packed_attention
from megatron_ext.training.dry_run import document_attention, format_dry_run, make_plan, training_flops
from megatron_ext.training.memory_fit import (check_run_fits, estimate_memory, largest_micro_batch, memory_report,
                                              phase_memory, reduce_memory_advice)
from megatron_ext.training.recipe import run_config_from_dict

REPO = Path(__file__).resolve().parents[2]
DEMO_DATA = REPO / "data" / "demo_dataset" / "train_text_document"
FAKE = {"tokenizer": "/nonexistent/tok", "data": "/nonexistent/data_text_document"}
RAMP = [4, 4, 24]  # global batches 4, then 8 (tiny_recipe's global batch)


def _write(recipe: dict, path: Path) -> str:
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def _memory_lines(out: str) -> str:
    """The dry run's memory lines (from ``memory/rank`` up to the cost)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("memory/rank"))
    end = next(i for i, line in enumerate(lines) if i > start and not line.startswith(" "))
    return "\n".join(lines[start:end])


# -- 1. a batch-size ramp-up -------------------------------------------------------------------------


def test_a_rampup_recipe_dry_runs_and_its_micro_batch_search_keeps_to_the_ramp(tmp_path, tiny_corpus, capsys):
    """The search used to try micro-batches of 8 and make_plan refused them against the ramp's batch
    of 4 (exit 2 for a run that trains); it proposes only sizes that split every ramp batch."""
    recipe = tiny_recipe(tiny_corpus, tmp_path, data={"rampup_batch_size": RAMP})
    assert pretrain_encoder.main(["--config", _write(recipe, tmp_path / "r.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"same global batch and ramp-up batches: 4 \(data\.micro_batch_size; 4 in this config\)", out), out
    config = run_config_from_dict(recipe)
    assert largest_micro_batch(config, world_size=1, usable_bytes=1 << 50) == 4  # 8 splits 8 but not 4
    two_ranks = run_config_from_dict(tiny_recipe(tiny_corpus, tmp_path, data={"rampup_batch_size": RAMP,
                                                                              "micro_batch_size": 2}))
    assert largest_micro_batch(two_ranks, world_size=2, usable_bytes=1 << 50) == 2  # 4 / DP 2
    assert largest_micro_batch(two_ranks, world_size=2, usable_bytes=1) is None  # nothing fits: None, no error


def test_the_ramp_up_is_said_in_the_phases_it_spans(tmp_path):
    config = run_config_from_dict(tiny_recipe(FAKE, tmp_path, data={"rampup_batch_size": RAMP}))
    plan = format_dry_run(config, make_plan(config, 1))
    phase_lines = plan[plan.index("phases:"):].splitlines()
    assert phase_lines[2].endswith("batch ramp-up in steps [0, 4): global 4, 8 from step 6 (data.rampup_batch_size)")
    assert phase_lines[4].endswith("batch ramp-up in steps [4, 6): global 4, 8 from step 6 (data.rampup_batch_size)")
    assert re.search(r"clm +steps \[ +0, +4\) +4 steps +1.02K tokens", plan), plan  # 4 x 4 x 64, not 4 x 8 x 64
    longer = run_config_from_dict(tiny_recipe(FAKE, tmp_path, data={"rampup_batch_size": [2, 2, 12],
                                                                       "micro_batch_size": 2},
                                              training={"train_iters": 16}))
    plan = format_dry_run(longer, make_plan(longer, 1))
    assert "batch ramp-up in steps [0, 4): global 2 -> 6, 8 from step 4 (data.rampup_batch_size)" in plan, plan
    assert plan.count("batch ramp-up in steps") == 1  # the MLM phase runs at the full batch


# -- 2. memory judged for the machine that runs the plan ---------------------------------------------


@pytest.mark.skipif(hardware.on_gpu(), reason="a machine without GPUs")
def test_a_plan_for_more_processes_than_this_machine_runs_is_not_judged_by_its_memory(tmp_path, tiny_corpus, capsys):
    """64 processes planned on a CPU machine: the estimate, 'memory not checked' and --gpu KIND; no
    NOT READY about this machine (the estimate is far above its memory, which the old report judged)."""
    huge = {"seq_length": 8_000_000, "micro_batch_size": 1, "global_batch_size": 64}
    recipe = tiny_recipe(tiny_corpus, tmp_path, data=huge, model={"seq_length": 8_000_000})
    path = _write(recipe, tmp_path / "r.yaml")
    assert pretrain_encoder.main(["--config", path, "--dry-run", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    memory = _memory_lines(out)
    assert "NOT READY" not in out and "on this machine" not in memory, out
    assert "memory not checked (64 processes, and this machine has no GPU): give --gpu KIND (H100, " in memory, memory
    assert re.search(r"memory/rank +params .* GiB per rank", memory)
    assert estimate_memory(run_config_from_dict(recipe), world_size=64).total > hardware.usable_memory_bytes()[0]
    # One process is this machine's plan: judged here, as before.
    assert pretrain_encoder.main(["--config", path, "--dry-run", "--world-size", "1", "--global-batch-size", "1"]) == 0
    assert "on this machine: NOT READY, a run here would stop" in capsys.readouterr().out
    # --gpu KIND: judged for that GPU, and said so.
    assert pretrain_encoder.main(["--config", path, "--dry-run", "--world-size", "64", "--gpu", "H100"]) == 0
    memory = _memory_lines(capsys.readouterr().out)
    assert "on a H100: NOT READY, a run on a H100 would stop" in memory and "this machine" not in memory, memory


@pytest.mark.skipif(hardware.on_gpu(), reason="a machine without GPUs")
def test_paths_a_login_node_lacks_are_said_not_judged_for_a_plan_it_does_not_run(tmp_path, capsys):
    recipe = tiny_recipe(FAKE, tmp_path, data={"micro_batch_size": 1, "global_batch_size": 64})
    path = _write(recipe, tmp_path / "r.yaml")
    assert pretrain_encoder.main(["--config", path, "--dry-run", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "NOT READY" not in out, out
    for what in ("paths", "tokenizer"):
        assert f"{what}: fails on this machine, which does not run this plan (64 processes, and this machine has " \
               "no GPU); check where it starts: " in out, out
    assert pretrain_encoder.main(["--config", path, "--dry-run", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "paths: NOT READY, a run would stop here: " in out and "tokenizer: NOT READY, a run would stop here: " in out


LONG = {"objective": "mlm", "mask_ratio": 0.4, "steps": 2, "seq_length": 256, "micro_batch_size": 2,
        "global_batch_size": 8}


def _long_context(tmp_path, corpus=FAKE, **sections):
    return run_config_from_dict(tiny_recipe(corpus, tmp_path, phases=[{"objective": "clm", "steps": 6}, LONG],
                                            model={"seq_length": 256}, **sections))


def test_a_gpu_kind_is_named_in_the_per_phase_report(tmp_path):
    """Phases at other lengths: the header named 'this machine' even for --gpu H100."""
    report = memory_report(_long_context(tmp_path), world_size=1, gpu_kind="H100")
    assert report.startswith("memory/rank       per phase, on a H100 (a H100 (80 GiB): 80.0 GiB usable):"), report
    assert "this machine" not in report


# -- 3. a phase's advice names the phase's keys ------------------------------------------------------


def test_advice_for_a_phase_names_its_own_keys(tmp_path):
    config = _long_context(tmp_path)
    advice = reduce_memory_advice(config, phase=1)
    assert advice.startswith("lower phases[1].micro_batch_size (now 2) or phases[1].seq_length"), advice
    assert "data.micro_batch_size" not in advice and "data.seq_length" not in advice
    assert "data.micro_batch_size (now 4)" in reduce_memory_advice(config)  # the run's, for the run
    one = _long_context(tmp_path, data={"micro_batch_size": 1, "global_batch_size": 2})
    assert reduce_memory_advice(one, phase=0).startswith("lower data.seq_length,"), "a micro-batch of 1 is not lowered"
    # Where no micro-batch of the phase fits: the dry run's line and the run's refusal name phases[1].
    short, long = phase_memory(config, world_size=1)
    usable = (short.total + long.total) // 2
    with pytest.raises(UserError, match=r"phases\[1\] .*set phases\[1\]\.micro_batch_size: 1"):
        check_run_fits(config, world_size=1, usable_bytes=usable, where="the test device")
    with pytest.raises(UserError) as refused:
        check_run_fits(config, world_size=1, usable_bytes=short.total + 1, where="the test device")
    assert "lower phases[1].micro_batch_size (now 2) or phases[1].seq_length" in str(refused.value)
    assert "data.micro_batch_size" not in str(refused.value)


# -- 4. every hint names a flag the trainer has ------------------------------------------------------


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))


def test_the_trainers_hints_name_its_own_flags(tmp_path, tiny_corpus, capsys):
    """The cost line said '--calibrate here', a flag of the study tools only. Every flag any line
    of the trainer's dry run names (a speed unknown, memory not checked) is one the trainer has."""
    long = {"seq_length": 4096, "micro_batch_size": 1, "global_batch_size": 64}
    recipe = tiny_recipe(tiny_corpus, tmp_path, data=long, model={"seq_length": 4096})  # no CPU measurement
    path = _write(recipe, tmp_path / "r.yaml")
    assert pretrain_encoder.main(["--config", path, "--dry-run", "--world-size", "64", "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "cost              unknown: no speed known for cpu: give --gpu KIND" in out, out
    parser, _ = pretrain_encoder.build_parser()
    trainer_flags = set(parser._option_string_actions)
    assert "--calibrate" not in out and _flags(out) <= trainer_flags, _flags(out) - trainer_flags
    assert pretrain_encoder.main(["--config", path, "--dry-run", "--world-size", "64", "--gpu", "cpu",
                                  "--budget-gpu-hours", "10"]) == 2
    err = capsys.readouterr().err
    assert "the cost of the run is unknown" in err and "--calibrate" not in err and _flags(err) <= trainer_flags, err


def test_the_study_tools_keep_their_calibrate_hint():
    from megatron_ext.cli import plan_study, run_study
    from megatron_ext.performance.cost import speed_table

    for tool in (plan_study, run_study):
        parser = tool.build_parser()
        args = parser.parse_args(["study.yaml", "--gpu", "cpu"] if tool is plan_study
                                 else ["study.yaml", "--gpu", "cpu", "--launcher", "local"])
        hint = speed_table(args).unknown_hint
        assert "--calibrate" in hint and _flags(hint) <= set(parser._option_string_actions), hint


# -- 5. per-phase notes, isolated documents' attention -----------------------------------------------


def test_each_phase_says_isolation_and_the_long_context_phase(tmp_path):
    config = _long_context(tmp_path, data={"reset_attention_mask": True})
    plan = format_dry_run(config, make_plan(config, 1))
    notes = [line for line in plan.splitlines() if "documents isolated" in line]
    assert len(notes) == 2 and all("(data.reset_attention_mask)" in line for line in notes), plan
    assert "long context: phases[1].seq_length 256 (data.seq_length 64)" in notes[1], plan
    assert "long context" not in notes[0]
    # Without isolation the phases say nothing of documents; the long phase still says it is long.
    plain = _long_context(tmp_path)
    plain_plan = format_dry_run(plain, make_plan(plain, 1))
    assert "documents" not in plain_plan and "long context: phases[1].seq_length 256" in plain_plan


def test_isolated_documents_count_the_attention_they_compute_on_the_demo_data(tmp_path):
    """The demo corpus (445 documents of ~1,800 tokens) in rows of 512: rows that hold a document end
    attend less than s^2, so the isolated run's FLOPs are below the full rows', by the attention term only."""
    corpus = {"tokenizer": "/nonexistent/tok", "data": str(DEMO_DATA)}
    data = {"seq_length": 512, "global_batch_size": 8}
    full = run_config_from_dict(tiny_recipe(corpus, tmp_path, data=data, model={"seq_length": 512}))
    isolated = run_config_from_dict(tiny_recipe(corpus, tmp_path, data={**data, "reset_attention_mask": True},
                                                model={"seq_length": 512}))
    assert training_flops(isolated) < training_flops(full)
    attention = document_attention(isolated, 512)
    assert attention.source == str(DEMO_DATA) and 0 < attention.attended < 512 and attention.mean_segment < 512
    m = full.model
    tokens = 8 * 8 * 512
    assert training_flops(full) - training_flops(isolated) == pytest.approx(
        12 * m.num_layers * m.hidden_size * (512 - attention.attended) * tokens, rel=1e-9)
    plan = format_dry_run(isolated, make_plan(isolated, 1))
    assert re.search(r"attention FLOPs for isolated documents at seq 512, mean segment [\d,]+ tokens \(\d+\.\d % of "
                     rf"full rows' attention\) from {re.escape(str(DEMO_DATA))}", plan), plan
    assert "12*L*h*sum(d^2)/s" in plan
    assert document_attention(full, 512) is None


def _index(prefix: Path, lengths: list[int]) -> str:
    """A Megatron indexed dataset of documents of ``lengths`` tokens (Megatron's own writer)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for length in lengths:
        builder.add_document(torch.arange(length, dtype=torch.int64) % 1000 + 1, [length])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def test_documents_longer_than_rows_cost_what_full_rows_cost(tmp_path):
    """Every document a whole number of rows: each row holds one document, so isolation computes
    the full rows' attention and the FLOPs are equal; read from a real index (Megatron's writer)."""
    prefix = _index(tmp_path / "long_text_document", [64 * n for n in (3, 5, 2, 7, 4)])
    corpus = {"tokenizer": "/nonexistent/tok", "data": prefix}
    full = run_config_from_dict(tiny_recipe(corpus, tmp_path))
    isolated = run_config_from_dict(tiny_recipe(corpus, tmp_path, data={"reset_attention_mask": True}))
    assert document_attention(isolated, 64).attended == 64.0
    assert training_flops(isolated) == pytest.approx(training_flops(full), rel=1e-12)
    # Shorter documents in the same rows: less.
    short = _index(tmp_path / "short_text_document", [40, 24, 100, 92] * 10)
    shorter = run_config_from_dict(tiny_recipe({**corpus, "data": short}, tmp_path, data={"reset_attention_mask": True}))
    assert training_flops(shorter) < training_flops(full)


def test_packing_follows_gpt_datasets_rows():
    assert packed_attention(np.array([10_000]), 128, 4096) == (128.0, 128.0, 4096)  # one document, longer than rows
    # Rows of 128 over documents of 96: [96 | 32] [64 | 64] [32 | 96].
    keys, mean_segment, tokens = packed_attention(np.array([96] * 4), 128, 4096)
    assert tokens == 384 and keys == pytest.approx((96**2 + 32**2 + 64**2 + 64**2 + 32**2 + 96**2) / 384)
    assert mean_segment == 384 / 6
    assert packed_attention(np.array([5]), 128, 4096)[2] == 128  # a corpus shorter than a row repeats


def test_unreadable_data_counts_full_rows_and_says_so(tmp_path):
    config = run_config_from_dict(tiny_recipe(FAKE, tmp_path, data={"reset_attention_mask": True}))
    attention = document_attention(config, 64)
    assert attention.attended is None
    full = run_config_from_dict(tiny_recipe(FAKE, tmp_path))
    assert training_flops(config) == training_flops(full)
    plan = format_dry_run(config, make_plan(config, 1))
    assert ("documents         isolated (data.reset_attention_mask): attention FLOPs at seq 64 counted for full "
            "rows: data not readable here (/nonexistent/data_text_document.idx: No such file or directory)") in plan
    (tmp_path / "bad_text_document.idx").write_bytes(b"not an index at all, not at all, not at all")
    bad = run_config_from_dict(tiny_recipe({**FAKE, "data": str(tmp_path / "bad_text_document")}, tmp_path,
                                           data={"reset_attention_mask": True}))
    assert document_attention(bad, 64).attended is None


def test_the_isolated_estimate_imports_no_megatron(tmp_path):
    """The dry run stays free of Megatron's import (seconds on a login node) with isolated documents."""
    script = ("import sys; from pathlib import Path; from helpers import tiny_recipe; "
              "from megatron_ext.training.recipe import run_config_from_dict; "
              "from megatron_ext.training.dry_run import document_attention; "
              f"c = run_config_from_dict(tiny_recipe({{'tokenizer': 'x', 'data': {str(DEMO_DATA)!r}}}, Path('.'), "
              "data={'reset_attention_mask': True})); a = document_attention(c, 64); "
              "print(a.attended is not None, sorted(m for m in sys.modules if m.startswith('megatron.')))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(  # helpers, as pytest finds it
                              filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "True []"
