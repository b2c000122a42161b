"""Phases over the step budget and the learning-rate schedule, checked against Megatron-Core."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.config_loading import ConfigError
from megatron_ext.objectives import CLM, MLM, MaskingConfig
from megatron_ext.phases import Phase, phase_at, resolve_phases
from megatron_ext.schedule import LRScheduleConfig, lr_at

PAPER = LRScheduleConfig(lr=5e-4, lr_warmup_iters=2000, lr_wsd_decay_iters=2000)


def _biphasic(clm_share: float, restart_warmup: bool = False, **mlm) -> list[Phase]:
    return [
        Phase(objective=CLM(), share=clm_share),
        Phase(objective=MLM(mask_ratio=0.4, **mlm), share=1 - clm_share, restart_warmup=restart_warmup),
    ]


@pytest.mark.parametrize(
    ("total", "clm_share", "clm_steps"),
    [(42_000, 0.25, 10_500), (42_000, 0.5, 21_000), (42_001, 0.25, 10_500), (42_001, 0.5, 21_001),
     (12_003, 0.75, 9_002), (7, 0.5, 4)],
)
def test_share_split(total, clm_share, clm_steps):
    clm, mlm = resolve_phases(_biphasic(clm_share), total)
    assert (clm.start, clm.end, mlm.start, mlm.end) == (0, clm_steps, clm_steps, total)
    assert (clm.objective, mlm.objective, clm.index, mlm.index) == (CLM(), MLM(mask_ratio=0.4), 0, 1)
    assert (clm.name, mlm.name) == ("clm", "mlm-40")


def test_largest_remainder_thirds():
    phases = [Phase(objective=CLM(), share=1 / 3)] * 3
    assert [p.steps for p in resolve_phases(phases, 10)] == [4, 3, 3]
    assert [p.steps for p in resolve_phases(phases, 11)] == [4, 4, 3]


def test_phase_at_boundaries():
    phases = resolve_phases(
        [
            Phase(objective=CLM(), steps=10_000),
            Phase(objective=MLM(mask_ratio=0.4), steps=32_000),
        ],
        42_000,
    )
    assert [phase_at(phases, s).name for s in (0, 9_999, 10_000, 41_999)] == [
        "clm", "clm", "mlm-40", "mlm-40",
    ]
    for step in (-1, 42_000):
        with pytest.raises(ValueError, match="outside"):
            phase_at(phases, step)


def test_mlm_phase_feeds_masking_config():
    _, mlm = resolve_phases(_biphasic(0.25), 100)
    assert mlm.objective.masking(0.4) == MaskingConfig(mask_ratio=0.4)
    _, bert = resolve_phases(_biphasic(0.25, mask_replace_prob=0.8, random_replace_prob=0.1), 100)
    assert (bert.objective.mask_replace_prob, bert.objective.random_replace_prob) == (0.8, 0.1)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"objective": "mlm", "steps": 5}, r"phases\[0\]: missing required key\(s\) \['mask_ratio'\]"),
        ({"objective": {"name": "mlm", "mask_ratio": 1.0}, "steps": 5}, "mask_ratio must be in"),
        ({"objective": "clm", "mask_ratio": 0.4, "steps": 5}, r"unknown key\(s\) \['mask_ratio'\]"),
        ({"objective": "clm", "random_replace_prob": 0.1, "steps": 5}, "random_replace_prob"),
        ({"objective": "mlm", "mask_ratio": 0.4, "steps": 5, "mask_replace_prob": 0.95, "random_replace_prob": 0.1},
         "random_replace_prob"),
        ({"objective": {"name": "mlm", "mask_ratio": 0.4}, "mask_ratio": 0.3, "steps": 5}, "not both"),
        ({"objective": {"mask_ratio": 0.4}, "steps": 5}, "missing key 'name'"),
        ({"objective": "clm"}, "steps and share"),
        ({"objective": "clm", "steps": 5, "share": 0.5}, "steps and share"),
        ({"objective": "clm", "steps": 0}, "steps"),
        ({"objective": "clm", "share": 0.0}, "share"),
        ({"objective": "mlm_", "steps": 5}, "unknown objective 'mlm_'"),
        ({"share": 1.0}, r"missing required key\(s\) \['objective'\]"),
    ],
)
def test_phase_validation(raw, field):
    with pytest.raises(ConfigError, match=field):
        Phase.from_config(raw, "phases[0]")


def test_flat_and_tagged_phases_read_the_same():
    """Today's flat keys, the tagged union, and an older run_config.json (unset keys as null) are
    one phase; the tagged form written back reads as the same phase."""
    flat = Phase.from_config({"objective": "mlm", "mask_ratio": 0.4, "mask_replace_prob": 0.8, "share": 1.0}, "p")
    tagged = Phase.from_config({"objective": {"name": "mlm", "mask_ratio": 0.4, "mask_replace_prob": 0.8},
                                "share": 1.0}, "p")
    saved = Phase.from_config({"objective": "mlm", "mask_ratio": 0.4, "steps": None, "share": 1.0,
                               "mask_replace_prob": 0.8, "random_replace_prob": None, "restart_warmup": False}, "p")
    assert flat == tagged == saved == Phase(objective=MLM(mask_ratio=0.4, mask_replace_prob=0.8), share=1.0)
    assert Phase.from_config(flat.to_config(), "p") == flat
    assert flat.to_config()["objective"] == {"name": "mlm", "mask_ratio": 0.4, "mask_replace_prob": 0.8}
    old_clm = {"objective": "clm", "mask_ratio": None, "steps": 3, "share": None, "mask_replace_prob": None,
               "random_replace_prob": None, "restart_warmup": False}
    assert Phase.from_config(old_clm, "p") == Phase(objective=CLM(), steps=3)
    with pytest.raises(ValueError, match="objective must be one of"):
        Phase(objective="clm", steps=3)


@pytest.mark.parametrize(
    ("phases", "total", "message"),
    [
        ([], 10, "phases must not be empty"),
        ([Phase(objective=CLM(), steps=10)], 0, "total_steps"),
        ([Phase(objective=CLM(), steps=4), Phase(objective=CLM(), steps=5)], 10, r"steps sum to 9"),
        ([Phase(objective=CLM(), share=0.5), Phase(objective=CLM(), share=0.4)], 10,
         r"share sum to 0.9"),
        ([Phase(objective=CLM(), steps=5), Phase(objective=CLM(), share=0.5)], 10,
         r"phases\[1\] sets share"),
        ([Phase(objective=CLM(), share=0.999), Phase(objective=CLM(), share=0.001)], 100,
         r"phases\[1\]\.share=0.001 gives 0"),
    ],
)
def test_resolve_errors(phases, total, message):
    with pytest.raises(ValueError, match=message):
        resolve_phases(phases, total)


def test_paper_wsd_values():
    expected = {
        0: 0.0,
        1: 5e-4 / 2000,
        1_999: 5e-4 * 1999 / 2000,
        2_000: 5e-4,
        20_000: 5e-4,
        39_999: 5e-4,
        40_000: 5e-4,  # Megatron keeps the step AT the decay start stable
        40_001: 5e-4 * 1999 / 2000,
        41_000: 5e-4 / 2,
        41_999: 5e-4 / 2000,
        42_000: 0.0,
    }
    for step, lr in expected.items():
        got = lr_at(step, config=PAPER, total_steps=42_000)
        assert got == pytest.approx(lr, rel=1e-12, abs=1e-18), step


def test_biphasic_mlm_continues_on_the_stable_lr():
    phases = resolve_phases(_biphasic(0.25), 42_000)
    for step in (10_499, 10_500, 10_501):
        assert lr_at(step, config=PAPER, total_steps=42_000, phases=phases) == 5e-4


def _megatron_lrs(config: LRScheduleConfig, total: int) -> list[float]:
    """Megatron's OptimizerParamScheduler as megatron.training builds it (global batch 1)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=config.lr_warmup_init,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_iters,
        lr_decay_steps=total,
        lr_decay_style="WSD" if config.lr_decay_style == "wsd" else config.lr_decay_style,
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=total,
        wd_incr_style="constant",
        wsd_decay_steps=config.lr_wsd_decay_iters,
        lr_wsd_decay_style=config.lr_wsd_decay_style,
    )
    lrs = [optimizer.param_groups[0]["lr"]]  # the constructor applies step(0)
    for _ in range(total):
        scheduler.step(1)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize(
    "config",
    [
        LRScheduleConfig(lr=3e-4, min_lr=1e-5, lr_warmup_iters=7, lr_wsd_decay_iters=11,
                         lr_wsd_decay_style=style)
        for style in ("linear", "cosine", "exponential", "minus_sqrt")
    ]
    + [
        LRScheduleConfig(lr=3e-4, min_lr=1e-5, lr_warmup_iters=7, lr_decay_style=style)
        for style in ("cosine", "linear", "constant")
    ]
    + [
        LRScheduleConfig(lr=1e-3, lr_warmup_iters=0, lr_decay_style="cosine"),
        LRScheduleConfig(lr=1e-3, lr_warmup_iters=5, lr_warmup_init=1e-4, lr_wsd_decay_iters=45),
    ],
    ids=lambda c: f"{c.lr_decay_style}-{c.lr_wsd_decay_style}-w{c.lr_warmup_iters}",
)
def test_matches_megatron_scheduler(config):
    total = 50
    ours = [lr_at(step, config=config, total_steps=total) for step in range(total + 1)]
    for step, (a, b) in enumerate(zip(ours, _megatron_lrs(config, total))):
        assert abs(a - b) <= 1e-12, (step, a, b)


def test_restart_warmup():
    config = LRScheduleConfig(lr=1e-3, lr_warmup_iters=10, lr_wsd_decay_iters=20)
    base = [lr_at(s, config=config, total_steps=100) for s in range(101)]
    restart_mid = resolve_phases(_biphasic(0.5, restart_warmup=True), 100)
    lrs = [lr_at(s, config=config, total_steps=100, phases=restart_mid) for s in range(101)]
    assert lrs[:50] == base[:50] and lrs[61:] == base[61:]
    assert (lrs[50], lrs[55], lrs[60]) == (0.0, pytest.approx(5e-4), pytest.approx(1e-3))
    # A restart inside the decay ramps up to the decaying rate, not to the peak.
    restart_late = resolve_phases(_biphasic(0.85, restart_warmup=True), 100)
    assert lr_at(85, config=config, total_steps=100, phases=restart_late) == 0.0
    late_90 = lr_at(90, config=config, total_steps=100, phases=restart_late)
    assert late_90 == pytest.approx(base[90] / 2)
    assert lr_at(95, config=config, total_steps=100, phases=restart_late) == pytest.approx(base[95])
    assert lr_at(96, config=config, total_steps=100, phases=restart_late) == base[96]
    # Restarting at step 0 is the ordinary warmup.
    first = [Phase(objective=CLM(), share=1.0, restart_warmup=True)]
    assert [lr_at(s, config=config, total_steps=100, phases=resolve_phases(first, 100))
            for s in range(101)] == base


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr": 1e-3}, "lr_wsd_decay_iters"),
        ({"lr": 1e-3, "lr_decay_style": "WSD"}, "lr_wsd_decay_iters"),
        ({"lr": 1e-3, "lr_wsd_decay_style": "step", "lr_wsd_decay_iters": 5}, "lr_wsd_decay_style"),
        ({"lr": 0.0, "lr_decay_style": "constant"}, "lr must"),
        ({"lr": 1e-3, "min_lr": 2e-3, "lr_decay_style": "constant"}, "min_lr"),
        ({"lr": 1e-3, "lr_warmup_init": 2e-3, "lr_decay_style": "constant"}, "lr_warmup_init"),
        ({"lr": 1e-3, "lr_warmup_iters": -1, "lr_decay_style": "constant"}, "lr_warmup_iters"),
    ],
)
def test_lr_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LRScheduleConfig(**kwargs)


def test_lr_decay_style_reads_megatron_spelling_and_other_styles_ignore_wsd_decay_iters():
    """As in Megatron-LM: ``WSD`` is the warmup-stable-decay style, and ``lr_wsd_decay_iters`` (set by
    every shipped recipe) is ignored by the other styles, so ``--lr-decay-style cosine`` works on them."""
    assert LRScheduleConfig(lr=1e-3, lr_decay_style="WSD", lr_wsd_decay_iters=5).lr_decay_style == "wsd"
    for style in ("cosine", "linear", "constant"):
        with_wsd = LRScheduleConfig(lr=1e-3, lr_decay_style=style, lr_warmup_iters=2, lr_wsd_decay_iters=5)
        plain = LRScheduleConfig(lr=1e-3, lr_decay_style=style, lr_warmup_iters=2)
        rates = [lr_at(step, config=with_wsd, total_steps=20) for step in range(20)]
        assert rates == [lr_at(step, config=plain, total_steps=20) for step in range(20)]
        assert (rates[-1] < rates[2]) == (style != "constant")  # decays over the whole run, not the last 5


def test_lr_at_errors():
    with pytest.raises(ValueError, match="step must be in"):
        lr_at(42_001, config=PAPER, total_steps=42_000)
    with pytest.raises(ValueError, match="exceeds total_steps"):
        lr_at(0, config=PAPER, total_steps=3_000)
    with pytest.raises(ValueError, match="total_steps must be"):
        lr_at(0, config=PAPER, total_steps=2_000)
    no_warmup = LRScheduleConfig(lr=1e-3, lr_decay_style="linear")
    with pytest.raises(ValueError, match=r"phases\[1\]\.restart_warmup"):
        lr_at(0, config=no_warmup, total_steps=100,
              phases=resolve_phases(_biphasic(0.5, restart_warmup=True), 100))
    with pytest.raises(ValueError, match="phases end at step 100"):
        lr_at(0, config=PAPER, total_steps=42_000, phases=resolve_phases(_biphasic(0.5), 100))


def test_the_learning_rate_is_megatrons_scheduler_stepped_as_megatron_lm_steps_it():
    """``lr_at`` gives Megatron-Core's ``OptimizerParamScheduler`` rate: at every step of the paper's
    recipes and the demo's, what a real scheduler over a real optimizer sets on the optimizer's
    parameter group after ``step(1)`` per update, as Megatron-LM's loop drives it. (``lr_at`` does not
    call it: importing ``megatron.core`` would cost the dry run ~5 s; docs/design.md.)"""
    from pathlib import Path

    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_ext.training.recipe import read_recipe, run_config_from_dict

    recipes = Path(__file__).resolve().parents[2] / "examples" / "recipes"
    for name in ("paper/1b_biphasic_25_75.yaml", "paper/210m_mlm_40.yaml", "demo_tiny_biphasic.yaml"):
        config = run_config_from_dict(read_recipe(recipes / name), tokenizer_vocab_size=128_256)
        s, total = config.schedule, config.training.train_iters
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=s.lr_warmup_init, max_lr=s.lr, min_lr=s.min_lr, lr_warmup_steps=s.lr_warmup_iters,
            lr_decay_steps=total, lr_decay_style={"wsd": "WSD"}.get(s.lr_decay_style, s.lr_decay_style),
            start_wd=0.0, end_wd=0.0, wd_incr_steps=total, wd_incr_style="constant",
            wsd_decay_steps=s.lr_wsd_decay_iters, lr_wsd_decay_style=s.lr_wsd_decay_style)
        assert not any(p.restart_warmup for p in config.resolved_phases)  # a restart is ours, not Megatron's
        for step in range(total + 1):
            assert lr_at(step, config=s, total_steps=total, phases=config.resolved_phases) == \
                optimizer.param_groups[0]["lr"], (name, step)
            scheduler.step(1)
