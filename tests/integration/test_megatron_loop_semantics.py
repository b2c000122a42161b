"""The training loop as a Megatron-LM user expects it (CPU, tiny runs): the step line's loss is the mean
over the log interval, ``training.eval_interval: 0`` still validates after the last step while
``data.eval_iters: 0`` evaluates nothing, a split's test share is evaluated once at the end, a phase
says when it begins, and a resume that would change what a step reads or attends to is refused."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from helpers import tiny_recipe
from megatron_ext.config_loading import UserError
from megatron_ext.training.loop import RESUME_KEEPS_DATA, pretrain
from megatron_ext.training.recipe import run_config_from_dict

LONG_PHASES = [{"objective": "clm", "share": 0.5},
               {"objective": "mlm", "mask_ratio": 0.4, "share": 0.5, "seq_length": 128, "rotary_base": 160_000.0}]
STEP_LINE = re.compile(r"^step (\d+)/\d+ \| (\S+) +\| loss (\S+) \|")


def _train(recipe: dict, **kwargs):
    """``pretrain`` on ``recipe``, with what it printed (rank 0's lines) and its metrics.jsonl rows."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = pretrain(run_config_from_dict(recipe), **kwargs)
    rows = [json.loads(line) for line in Path(recipe["logging"]["log_dir"], "metrics.jsonl").read_text().splitlines()]
    return result, out.getvalue().splitlines(), rows


@pytest.fixture(scope="module")
def every_fourth(tmp_path_factory, tiny_corpus):
    """8 steps (CLM then MLM-40, 4 each), a line every 4 steps, no periodic validation."""
    run_dir = tmp_path_factory.mktemp("every_fourth")
    return _train(tiny_recipe(tiny_corpus, run_dir, training={"train_iters": 8, "eval_interval": 0, "log_interval": 4},
                              checkpoint={"save": None}))


def test_the_step_line_shows_the_mean_loss_of_its_interval(every_fourth):
    result, lines, rows = every_fourth
    losses = {row["step"]: row["loss"] for row in rows if row["kind"] == "train"}
    assert losses == result.losses and sorted(losses) == list(range(1, 9))  # every step's own loss is kept
    printed = {int(m[1]): float(m[3]) for m in map(STEP_LINE.match, lines) if m}
    assert sorted(printed) == [4, 8]
    for step in printed:
        interval = [losses[s] for s in range(step - 3, step + 1)]
        assert printed[step] == pytest.approx(sum(interval) / 4, abs=5e-5), (step, interval)
        assert abs(printed[step] - losses[step]) > 1e-3  # not the step's own loss: this test can tell


def test_eval_interval_0_still_validates_after_the_last_step(every_fourth):
    result, lines, rows = every_fourth
    assert set(result.valid) == {8} and set(result.valid[8]) == {"clm", "mlm"}
    assert [row["step"] for row in rows if row["kind"] == "valid"] == [8]
    assert [line.split(":")[0] for line in lines if line.startswith("validation at")] == ["validation at step 8"]
    # The tiny recipe's split, 90,10,0, has no test share: nothing is tested.
    assert not result.test and not [row for row in rows if row["kind"] == "test"]
    assert not [line for line in lines if line.startswith("test at")]


def test_each_phase_says_when_it_begins(every_fourth):
    _, lines, _ = every_fourth
    assert [line for line in lines if line.startswith("phase ")] == [
        "phase 1/2 clm [0, 4) begins with step 1: objective clm, seq_length 64, RoPE base 10000, global batch 8",
        "phase 2/2 mlm-40 [4, 8) begins with step 5: objective mlm 0.4, seq_length 64, RoPE base 10000, global batch 8"]
    # Before the phase's first step line.
    assert lines.index(next(line for line in lines if line.startswith("phase 2/2"))) > \
        lines.index(next(line for line in lines if line.startswith("step 4/8")))


def test_a_test_share_is_evaluated_once_at_the_end_and_a_long_phase_names_its_changes(tmp_path, tiny_corpus):
    result, lines, rows = _train(tiny_recipe(tiny_corpus, tmp_path, phases=LONG_PHASES, data={"split": "80,10,10"},
                                             training={"train_iters": 4, "eval_interval": 3, "log_interval": 1},
                                             checkpoint={"save": None}))
    assert set(result.valid) == {3, 4}  # periodic, then after the last step
    assert set(result.test) == {"clm", "mlm"}
    assert result.test != result.valid[4]  # its own samples, not validation's
    tests = [row for row in rows if row["kind"] == "test"]
    assert tests == [{"kind": "test", "step": 4, **result.test}]
    assert [line for line in lines if line.startswith("test at")] == [
        f"test at step 4: clm loss {result.test['clm']:.4f} | mlm-40 loss {result.test['mlm']:.4f}"]
    assert ("phase 2/2 mlm-40 [2, 4) begins with step 3: objective mlm 0.4, seq_length 128 (was 64), RoPE base "
            "160000 (was 10000), global batch 4 (was 8)") in lines


def test_eval_iters_0_evaluates_nothing(tmp_path, tiny_corpus):
    result, lines, rows = _train(tiny_recipe(tiny_corpus, tmp_path, data={"split": "80,10,10", "eval_iters": 0},
                                             training={"train_iters": 4, "eval_interval": 2},
                                             checkpoint={"save": None}))
    assert result.final_step == 4 and not result.valid and not result.test
    assert not [row for row in rows if row["kind"] in ("valid", "test")]
    assert not [line for line in lines if line.startswith(("validation at", "test at"))]


def test_a_resume_that_changes_what_a_step_reads_or_attends_to_is_refused(tmp_path, tiny_corpus):
    isolated = {key: True for key in RESUME_KEEPS_DATA}
    assert set(isolated) == {"reset_attention_mask", "reset_position_ids", "eod_mask_loss"}
    sections = dict(training={"train_iters": 8, "eval_interval": 0, "log_interval": 1})
    first, _, _ = _train(tiny_recipe(tiny_corpus, tmp_path, data=isolated, **sections), exit_after_step=5)
    assert first.final_step == 5
    for key in RESUME_KEEPS_DATA:
        changed = tiny_recipe(tiny_corpus, tmp_path, data={**isolated, key: False}, **sections)
        with pytest.raises(UserError, match=rf"^resuming \S+iter_0000005 \(step 5\) with data\.{key} true -> false: "
                                            r".*keep it, or branch \(checkpoint\.branch_from\) or continue from the "
                                            r"weights \(checkpoint\.finetune\)$") as refused:
            pretrain(run_config_from_dict(changed))
        assert "\n" not in str(refused.value)
    # Unchanged, it resumes, and says which phase it resumes inside.
    resumed, lines, _ = _train(tiny_recipe(tiny_corpus, tmp_path, data=isolated, **sections))
    assert resumed.start_step == 5 and resumed.final_step == 8
    assert [line for line in lines if line.startswith("phase ")] == [
        "phase 2/2 mlm-40 [4, 8) continues with step 6: objective mlm 0.4, seq_length 64, RoPE base 10000, "
        "global batch 8"]
