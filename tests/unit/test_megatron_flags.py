"""Megatron-LM's flags on ``pretrain_encoder.py``: each one the trainer takes does what it does in
Megatron-LM 0.19 (a test shows it), differs only where ``megatron_flags`` says why, and every other
one is refused in one line; no flag is guessed from a prefix."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from megatron_ext.cli import pretrain_encoder
from megatron_ext.cli import megatron_flags
from megatron_ext.cli.megatron_flags import (BEHAVIOUR_DIFFERENCES, DIFFERENT_DEFAULTS, MEGATRON_FLAGS_HERE,
                                             UNSUPPORTED, megatron_lm_flags, same_default, trainer_flag_defaults)

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "recipes" / "paper" / "1b_mlm_40.yaml"


def _trainer_flags() -> dict:
    """Each flag of the trainer that sets one recipe field, with its action and default."""
    return trainer_flag_defaults(*pretrain_encoder.build_parser())


def _megatron_named() -> dict:
    """The trainer's flags that are Megatron-LM's too, with their action and default."""
    names = megatron_lm_flags()
    return {flag: found for flag, found in _trainer_flags().items() if flag in names}


def test_the_flag_list_is_megatron_lm_0_19s():
    """The committed list is Megatron-LM's whole training CLI at core_v0.19.0 (846 flags), with the
    defaults of that release, not a hand-picked subset."""
    names = megatron_lm_flags()
    assert len(names) > 800 and megatron_flags.MEGATRON_LM_VERSION == "core_v0.19.0"
    assert names["--adam-beta2"] == 0.999 and names["--log-interval"] == 100 and names["--fp8-format"] is None
    assert "--apply-rope-fusion" not in names and names["--no-rope-fusion"] is True  # the fusion is on there


def test_every_megatron_named_flag_has_a_row_naming_the_test_of_its_effect():
    """A Megatron-named flag cannot land without a row, and each row's test exists: the table is
    what docs/pretraining.md shows."""
    taken = _megatron_named()
    missing = sorted(set(taken) - set(MEGATRON_FLAGS_HERE))
    assert not missing, f"Megatron-LM flags the trainer takes without a row in MEGATRON_FLAGS_HERE: {missing}"
    stale = sorted(set(MEGATRON_FLAGS_HERE) - set(taken))
    assert not stale, f"rows for flags the trainer does not take (or not Megatron-LM's): {stale}"
    for flag, test in MEGATRON_FLAGS_HERE.items():
        path, _, name = test.partition("::")
        tree = ast.parse((REPO / path).read_text())
        functions = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert name.split("::")[-1] in functions, f"{flag}: {test} does not exist"


def test_defaults_that_differ_from_megatron_lm_say_why_and_help_shows_both():
    names = megatron_lm_flags()
    differing = {flag for flag, (_, default) in _megatron_named().items() if not same_default(default, names[flag])}
    unexplained = sorted(differing - set(DIFFERENT_DEFAULTS))
    assert not unexplained, f"defaults that differ from Megatron-LM's without a reason in DIFFERENT_DEFAULTS: {unexplained}"
    stale = sorted(set(DIFFERENT_DEFAULTS) - differing)
    assert not stale, f"DIFFERENT_DEFAULTS rows whose default is Megatron-LM's (or not a flag here): {stale}"
    parser, _ = pretrain_encoder.build_parser()
    text = " ".join(" ".join(action.help or "" for action in parser._actions).split())
    assert parser.format_help()  # the notes' text formats (no stray % for argparse)
    assert "[default: 0.95; Megatron-LM: 0.999, the paper's AdamW" in text  # --adam-beta2
    assert "[default: 10; Megatron-LM: 100, " in text  # --log-interval
    assert "[default: False; Megatron-LM: True, fused RoPE needs" in text  # --rope-fusion / --no-rope-fusion
    assert "unlike Megatron-LM: bf16 autocast over fp32 parameters" in text  # --bf16
    assert "Megatron-LM keeps every checkpoint: --keep-last 0" in text  # --save-interval
    assert "[required (in the recipe)]" in text  # --lr
    assert "--apply-rope-fusion" not in text  # not a flag of Megatron-LM 0.19


def test_refusal_table_names_megatron_flags_the_trainer_does_not_take():
    names, taken = megatron_lm_flags(), _trainer_flags()
    assert set(UNSUPPORTED) <= set(names)
    assert not set(UNSUPPORTED) & set(taken)
    assert set(BEHAVIOUR_DIFFERENCES) <= set(MEGATRON_FLAGS_HERE)


@pytest.mark.parametrize("argv, message", [
    # Guessed from a prefix before: read as --optimizer-format and refused naming that key.
    (["--optimizer", "sgd"], "Megatron-LM's --optimizer is not supported here: this trainer always uses AdamW"),
    (["--exit-signal", "SIGUSR1"], "Megatron-LM's --exit-signal is not supported here: --exit-signal-handler catches"),
    (["--fp16"], "Megatron-LM's --fp16 is not supported here: train in bf16 (--bf16)"),
    (["--train-samples=1000"], "Megatron-LM's --train-samples is not supported here: give the run's length in steps"),
    # Any other Megatron-LM flag: the same one line, pointing at the table.
    (["--num-experts", "8"], "Megatron-LM's --num-experts is not supported here: see `pretrain_encoder.py --help` "
                             "and docs/pretraining.md#megatron-lm-flags"),
    # Not Megatron's either: argparse's line; a prefix is no longer completed.
    (["--save-int", "5"], "unrecognized arguments: --save-int 5"),
    (["--optimizer-form", "dp_reshardable"], "unrecognized arguments: --optimizer-form dp_reshardable"),
])
def test_unsupported_and_abbreviated_flags_are_refused_in_one_line(capsys, argv, message):
    code = pretrain_encoder.main(["--config", str(RECIPE), "--dry-run", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert message in err[0], err[0]


def test_fp8_format_turns_fp8_on_as_in_megatron_lm(capsys):
    """``--bf16 --fp8-format hybrid`` trains in FP8 (Megatron-LM's meaning): before, only
    ``--fp8-recipe`` did and this pair trained in bf16 without a word."""
    from megatron_ext.training.megatron_engine import megatron_transformer_overrides

    parser, dests = pretrain_encoder.build_parser()
    args = parser.parse_args(["--config", str(RECIPE), "--bf16", "--fp8-format", "hybrid", "--transformer-impl",
                              "transformer_engine"])  # Megatron-LM's spelling of the TE spec
    config, _ = pretrain_encoder.load_config(args, dests)
    assert (config.training.fp8_format, config.training.fp8_recipe) == ("hybrid", "delayed")  # Megatron's default
    overrides = megatron_transformer_overrides(config)
    assert (overrides["fp8"], overrides["fp8_recipe"]) == ("hybrid", "delayed")
    assert pretrain_encoder.main(["--config", str(RECIPE), "--dry-run", "--world-size", "8", "--fp8-format", "e4m3",
                                  "--fp8-recipe", "tensorwise"]) == 0
    assert "FP8 (tensorwise, e4m3)" in capsys.readouterr().out
    # Without --fp8-format, --fp8-recipe does nothing in Megatron-LM: refused here, naming the switch.
    assert pretrain_encoder.main(["--config", str(RECIPE), "--dry-run", "--fp8-recipe", "tensorwise"]) == 2
    assert "training.fp8_format (Megatron-LM's --fp8-format) turns it on" in capsys.readouterr().err
    args = parser.parse_args(["--config", str(RECIPE)])
    config, _ = pretrain_encoder.load_config(args, dests)
    assert config.training.fp8_recipe is None and "fp8" not in megatron_transformer_overrides(config)


def test_lr_decay_style_cosine_runs_on_a_recipe_with_wsd_decay_iters(capsys):
    """Every shipped recipe sets lr_wsd_decay_iters; Megatron-LM ignores it for other styles, and so
    does this trainer (the dry run says it is unused) instead of refusing with no way out."""
    assert pretrain_encoder.main(["--config", str(RECIPE), "--dry-run", "--world-size", "8",
                                  "--lr-decay-style", "cosine"]) == 0
    out = capsys.readouterr().out
    assert "learning rate     cosine" in out
    assert "lr_wsd_decay_iters=2000 is unused with lr_decay_style cosine" in out


def test_dry_run_says_where_this_run_differs_from_megatron_lm_on_purpose(capsys, tmp_path):
    save = str(tmp_path / "ckpt")
    assert pretrain_encoder.main(["--config", str(RECIPE), "--dry-run", "--world-size", "8", "--save", save,
                                  "--bf16", "--params-dtype", "float32", "--exit-interval", "100"]) == 0
    out = capsys.readouterr().out
    line = out.split("unlike Megatron-LM, on purpose:\n")[1].split("\nmemory/rank")[0]  # its indented lines
    assert "--bf16 is bf16 autocast over fp32 parameters" in line
    assert "--keep-last 0" in line and "W&B writes offline" in line and "resumes from --save's newest" in line
    assert "stop with exit code 75" in line
    (tmp_path / "ckpt").mkdir()
    assert pretrain_encoder.main(["--config", str(RECIPE), "--dry-run", "--world-size", "8", "--save", save,
                                  "--load", save, "--keep-last", "0", "--wandb-mode", "disabled",
                                  "--no-exit-signal-handler", "--params-dtype", "bfloat16"]) == 0
    assert "unlike Megatron-LM" not in capsys.readouterr().out


def test_docs_table_is_the_code_table():
    page = (REPO / "docs" / "pretraining.md").read_text()
    region = re.search(r"<!-- generated: megatron-flags -->\n(.*?)<!-- end generated: megatron-flags -->", page, re.S)
    assert region and region.group(1) == megatron_flags.flags_table(*pretrain_encoder.build_parser())
    for flag in MEGATRON_FLAGS_HERE:
        assert f"| `{flag}` |" in region.group(1)
