"""Phase contexts (``training.context``): each phase's length, RoPE base and batches, the data
positions of each length's dataset, the checks on them, and the plan and memory per phase."""

from __future__ import annotations

import pytest

from megatron_ext.config_loading import ConfigError, UserError
from megatron_ext.training import context
from megatron_ext.training.branching import first_divergence
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.dry_run import format_dry_run, make_plan, training_flops
from megatron_ext.performance.memory import GiB
from megatron_ext.training.memory_fit import check_run_fits, largest_phase_micro_batch, phase_memory

LONG = {"objective": "mlm", "mask_ratio": 0.4, "steps": 2, "seq_length": 256, "rotary_base": 160000}


def _config(phases=None, model=None, train_iters=8, **data):
    return run_config_from_dict(_raw(phases, model, train_iters, **data))


def _raw(phases=None, model=None, train_iters=8, **data):
    return ({
        "model": {"preset": "tiny", "vocab_size": 1024, "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                  "num_attention_heads": 4, "num_query_groups": 2, **(model or {})},
        "tokenizer": {"tokenizer_model": "unused"},
        "data": {"data_path": ["unused"], "seq_length": 64, "micro_batch_size": 4, "global_batch_size": 8, **data},
        "schedule": {"lr": 1e-3, "lr_decay_style": "cosine", "lr_warmup_iters": 1},
        "phases": phases or [{"objective": "clm", "steps": 6}, LONG],
        "training": {"train_iters": train_iters},
    })


def test_a_long_phase_keeps_tokens_per_step_and_switches_the_rotary_base():
    config = _config()
    assert config.model.seq_length == 256
    short, long = config.phase_contexts
    assert (short.seq_length, short.micro_batch_size, short.global_batch_size, short.rotary_base) == (64, 4, 8, 1e4)
    assert (long.seq_length, long.micro_batch_size, long.global_batch_size, long.rotary_base) == (256, 1, 2, 1.6e5)
    assert context.consumed_samples(config.phase_contexts, 7) == 6 * 8 + 2
    # The long dataset starts at the sample covering the 6 x 512 tokens read at 64.
    assert [(s.seq_length, s.start, s.end, s.first_sample, s.last_sample) for s in
            context.dataset_spans(config.phase_contexts)] == [(64, 0, 6, 0, 48), (256, 6, 8, 12, 16)]
    assert context.dataset_spans(config.phase_contexts)[1].sample_at(7) == 14
    # An explicit global batch changes the tokens per step (the dry run says so).
    explicit = _config(phases=[{"objective": "clm", "steps": 6}, {**LONG, "global_batch_size": 4}])
    assert explicit.phase_contexts[1].tokens_per_step == 1024
    assert "tokens/step 1,024 vs 512 in phases[0]" in format_dry_run(explicit, make_plan(explicit, 1))


@pytest.mark.parametrize("phase, model, message", [
    ({"seq_length": 96}, {}, r"phases\[1\].seq_length=96: keeping .* not a whole number; give phases\[1\].global_batch_size"),
    ({"seq_length": 512}, {"seq_length": 256}, r"phases\[1\].seq_length=512 exceeds model.seq_length=256"),
    ({"rotary_base": 0}, {}, r"rotary_base must be > 0"),
    ({"rope_base": 1e5}, {}, r"phases\[1\]: unknown key\(s\) \['rope_base'\] \(rope_base is now phases\[\*\].rotary_base"),
    ({"global_batch_size": 3, "micro_batch_size": 2}, {}, r"global_batch_size 3 is not divisible by micro_batch_size 2"),
])
def test_bad_phase_contexts_are_refused_naming_the_key(phase, model, message):
    with pytest.raises(UserError, match=message):
        _config(phases=[{"objective": "clm", "steps": 6}, {**LONG, **phase}], model=model)


@pytest.mark.parametrize("shared, key", [
    ({"micro_batch_size": 2}, "micro_batch_size 2 but data.micro_batch_size is 4"),
    ({"global_batch_size": 16}, "global_batch_size 16 but data.global_batch_size is 8"),
    ({"seq_length": 128, "global_batch_size": 4}, "seq_length 128 but data.seq_length is 64"),
])
def test_a_setting_every_phase_shares_is_refused_unless_it_is_the_runs(shared, key):
    """One context for the whole run reads data.*: a value set alike on every phase was ignored."""
    with pytest.raises(UserError, match=f"every phase reads {key}: a value all phases share is the run's"):
        _config(phases=[{"objective": "clm", "steps": 6, **shared}, {"objective": "mlm", "mask_ratio": 0.4,
                                                                     "steps": 2, **shared}])


def test_cuda_graphs_are_refused_with_changing_shapes():
    recipe_phases = [{"objective": "clm", "steps": 6}, LONG]
    with pytest.raises(ConfigError, match=r"cuda_graphs='megatron' captures one shape"):
        run_config_from_dict({
            "model": {"preset": "tiny", "vocab_size": 1024}, "tokenizer": {"tokenizer_model": "unused"},
            "data": {"data_path": ["unused"], "seq_length": 64, "micro_batch_size": 4, "global_batch_size": 8},
            "phases": recipe_phases, "training": {"train_iters": 8, "cuda_graphs": "megatron"},
            "schedule": {"lr": 1e-3, "lr_decay_style": "constant"}})


def test_attention_makes_long_tokens_dearer():
    config = _config()
    short_tokens = 6 * 512
    long_tokens = 2 * 512
    short_flops = training_flops(config, 0, 6) / short_tokens
    long_flops = training_flops(config, 6, 8) / long_tokens
    plain = _config(phases=[{"objective": "clm", "steps": 6}, {k: v for k, v in LONG.items()
                                                               if k not in ("seq_length", "rotary_base")}])
    assert long_flops > training_flops(plain, 6, 8) / long_tokens  # same objective, 4x the length
    assert short_flops > 0
    out = format_dry_run(config, make_plan(config, 1))
    assert "sequence 256, global 2 = micro 1 x DP 1 x 2, RoPE base 160000; same tokens/step" in out
    assert "sequence 64, global 8 = micro 4 x DP 1 x 2, RoPE base 10000" in out


def test_a_phase_that_does_not_fit_is_named_with_the_micro_batch_that_does():
    config = _config(phases=[{"objective": "clm", "steps": 6}, {**LONG, "micro_batch_size": 2, "global_batch_size": 8}])
    short, long = phase_memory(config, world_size=1)
    assert long.activations > short.activations  # 512 tokens per micro-batch vs 256
    usable = (short.total + long.total) // 2
    largest = largest_phase_micro_batch(config, 1, world_size=1, usable_bytes=usable)
    assert largest == 1
    with pytest.raises(UserError, match=r"phases\[1\] \(256 tokens x micro-batch 2\) needs about .* "
                                        r"set phases\[1\].micro_batch_size: 1"):
        check_run_fits(config, world_size=1, usable_bytes=usable, where="the test device")
    check_run_fits(config, world_size=1, usable_bytes=4 * GiB, where="the test device")
    with pytest.raises(UserError, match=r"phases\[1\]: global batch 2 is not divisible by micro batch 1 x data-parallel"):
        make_plan(_config(micro_batch_size=2), 4)


def test_branches_and_resumes_compare_the_contexts():
    base = _config()
    other_length = _config(phases=[{"objective": "clm", "steps": 6}, {**LONG, "seq_length": 128}])
    found = first_divergence(base, other_length)
    assert found.step == 6 and "seq_length 256 x global batch 2" in found.reason
    other_base = _config(phases=[{"objective": "clm", "steps": 6}, {**LONG, "rotary_base": 500000}])
    assert first_divergence(base, other_base).step == 6
    assert first_divergence(base, _config()) is None
    assert context.first_context_change(base.phase_contexts, other_length.phase_contexts)[0] == 6


def test_runs_of_other_lengths_compare_on_the_steps_both_train():
    longer = run_config_from_dict({**_raw(), "phases": [{"objective": "clm", "steps": 6}, {**LONG, "steps": 6}],
                                   "training": {"train_iters": 12}})
    assert context.first_context_change(_config().phase_contexts, longer.phase_contexts) is None
    assert context.first_context_change(longer.phase_contexts, _config().phase_contexts) is None


@pytest.mark.parametrize("ramp, batch", [((16, 16, 1000), 64), ((32, 32, 1_000_000), 1152), ((2, 2, 7), 8)])
def test_rampup_is_megatrons(ramp, batch):
    """The schedule equals Megatron-LM's ramp-up (``start + increment x floor(consumed / (samples /
    increments))``, its RampupBatchsizeNumMicroBatchesCalculator) at every consumed sample, and
    Megatron-Core's step calculator fed with it gives the same batches."""
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    start, increment, samples = ramp
    config = _config(phases=[{"objective": "clm", "steps": 200}], global_batch_size=batch, micro_batch_size=2,
                     rampup_batch_size=list(ramp), train_iters=200)
    schedule = context.rampup_schedule(config.data)
    calculator = StepBatchsizeNumMicroBatchesCalculator(
        micro_batch_size=2, data_parallel_size=1, decrease_batch_size_if_needed=False, rank=0,
        schedule=context.rampup_schedule_text(schedule))
    per_increment = samples / ((batch - start) // increment)
    for consumed in [*range(0, min(samples + 50, 3000)), samples - 1, samples, samples + 1]:
        expected = min(batch, start + increment * int(consumed / per_increment))
        calculator.update(consumed, consistency_check=False)
        assert calculator.get_current_global_batch_size() == expected == \
            next(b for threshold, b in reversed(schedule) if consumed >= threshold), consumed
    steps = [config.global_batch_size_at(step) for step in range(200)]
    assert steps[0] == start and steps == sorted(steps)
    assert config.consumed_samples(200) == sum(steps)


def test_rampup_plan_and_refusals():
    config = _config(phases=[{"objective": "clm", "steps": 8}], rampup_batch_size=[4, 4, 24])
    plan = format_dry_run(config, make_plan(config, 1))
    assert "batch ramp-up     4 + 4 per 24 samples to 8 over the first 24 samples" in plan
    assert "4 from step 0, 8 from step 6" in plan
    assert "tokens            512/step, 2,560 in total" in plan  # (6 x 4 + 2 x 8) x 64
    with pytest.raises(UserError, match=r"the ramp's global batch 4 is not divisible by micro_batch_size=4 x "
                                         r"data-parallel size 2"):
        make_plan(config, 2)
    with pytest.raises(ConfigError, match=r"rampup_batch_size needs phases of one sequence length"):
        _config(rampup_batch_size=[4, 4, 24])
