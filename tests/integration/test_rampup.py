"""Batch-size ramp-up from a recipe (``data.rampup_batch_size``, CPU, tiny): the steps' global
batches follow Megatron's ramp through Megatron-Core's calculator, the log shows them, and a resume
mid-ramp and after it repeats the uninterrupted run exactly."""

from __future__ import annotations

import json

import pytest

from helpers import tiny_recipe
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.loop import pretrain

RAMP = {"rampup_batch_size": [4, 4, 24]}  # 4 until 24 samples are consumed, then 8


def test_rampup_trains_logs_and_resumes_exactly(tmp_path, tiny_corpus, capsys):
    config = run_config_from_dict(tiny_recipe(tiny_corpus, tmp_path / "a", data=RAMP))
    assert [config.global_batch_size_at(step) for step in range(8)] == [4] * 6 + [8] * 2
    assert config.consumed_samples(8) == 6 * 4 + 2 * 8
    straight = pretrain(config)
    out = capsys.readouterr().out
    assert "| batch 4" in out and "| batch 8" in out
    records = [json.loads(line) for line in (tmp_path / "a/log/metrics.jsonl").read_text().splitlines()]
    assert [r["global_batch_size"] for r in records if r["kind"] == "train"] == [4] * 6 + [8] * 2
    for stops in ((3,), (7,)):  # mid-ramp, after it
        run_dir = tmp_path / f"stop{stops[0]}"
        interrupted = run_config_from_dict(tiny_recipe(tiny_corpus, run_dir, data=RAMP))
        assert pretrain(interrupted, exit_after_step=stops[0]).final_step == stops[0]
        resumed = pretrain(interrupted)
        for step in range(stops[0] + 1, 9):
            assert resumed.losses[step] == straight.losses[step], f"step {step} differs after resume at {stops}"
    # Without the ramp the first steps read other samples (8 per step from the start).
    plain = pretrain(run_config_from_dict(tiny_recipe(tiny_corpus, tmp_path / "plain", checkpoint={"save": None})),
                     exit_after_step=1)
    assert plain.losses[1] != straight.losses[1]


@pytest.mark.parametrize("ramp, message", [
    ([4, 3, 24], r"global_batch_size 8 must be start \+ a whole number"),
    ([4, 4], r"expected \[start >= 1, increment >= 1, samples >= 0\]"),
])
def test_bad_rampups_are_refused(tmp_path, tiny_corpus, ramp, message):
    with pytest.raises(ValueError, match=message):
        run_config_from_dict(tiny_recipe(tiny_corpus, tmp_path, data={"rampup_batch_size": ramp}))


def test_a_resume_with_another_rampup_is_refused(tmp_path, tiny_corpus):
    recipe = tiny_recipe(tiny_corpus, tmp_path, data=RAMP, training={"train_iters": 8, "eval_interval": 0})
    pretrain(run_config_from_dict(recipe), exit_after_step=2)
    changed = tiny_recipe(tiny_corpus, tmp_path, data={"rampup_batch_size": [4, 4, 8]},
                          training={"train_iters": 8, "eval_interval": 0})
    with pytest.raises(ValueError, match=r"^resuming .* with another data.rampup_batch_size: \[4, 4, 24\] in the "
                                         r"saved run, \[4, 4, 8\] in this recipe"):
        pretrain(run_config_from_dict(changed))
