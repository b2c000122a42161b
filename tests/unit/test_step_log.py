"""The step line's loss is Megatron-LM's: the mean over the steps since the previous line that were not
skipped, counting the skipped ones; a phase that begins between two lines starts its own mean."""

from __future__ import annotations

import json

from helpers import tiny_recipe
from megatron_ext.phases import phase_at
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.step_log import MetricSinks, StepLogger


def test_the_line_averages_the_unskipped_steps_of_its_phase_since_the_last_line(tmp_path, capsys):
    # No file is read: the paths only have to be named.
    config = run_config_from_dict(tiny_recipe(
        {"tokenizer": "unused", "data": "unused"}, tmp_path, training={"train_iters": 8, "log_interval": 4},
        phases=[{"objective": "clm", "share": 0.25}, {"objective": "mlm", "mask_ratio": 0.4, "share": 0.75}]))
    sinks = MetricSinks(config.logging, run_config={}, wandb_run_id=None)
    log = StepLogger(config, sinks, total_steps=8, start_step=0)
    losses = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, float("nan"), 8.0]
    for step, loss in enumerate(losses):  # the 7th step is skipped (non-finite)
        log.step(step + 1, phase_at(config.resolved_phases, step), loss, 1e-3, 1.0, skipped=step == 6)
    sinks.close()
    lines = [line.split(" | ") for line in capsys.readouterr().out.splitlines()]
    assert [(fields[0], fields[1].strip(), fields[2]) for fields in lines] == [
        ("step 4/8", "mlm-40", "loss 3.5000"),  # mlm-40 began with step 3: steps 3 and 4, not the CLM ones
        ("step 8/8", "mlm-40", "loss 6.3333")]  # steps 5, 6 and 8
    assert "SKIPPED" not in lines[0][-1] and lines[1][-1] == "1 step SKIPPED (non-finite)"
    rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [row["loss"] for row in rows][:6] == losses[:6]  # every step's own loss
