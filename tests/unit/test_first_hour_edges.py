"""The small edges a new user meets first: negative flag values, a near-miss key, a missing data
prefix, token counts, and ``--dry-run --gpu KIND`` judging memory for that GPU with advice the
recipe does not already follow."""

from __future__ import annotations

import shutil

import pytest
import yaml

from megatron_ext.config_loading import ConfigError, UserError
from megatron_ext.training.recipe import read_recipe, run_config_from_dict
from megatron_ext.training.dry_run import token_count
from megatron_ext.training.preflight import check_paths
from megatron_ext.performance.devices import GPU_MEMORY_GIB, PEAK_TFLOPS
from megatron_ext.training.memory_fit import memory_report, reduce_memory_advice
from helpers import tiny_recipe

from megatron_ext.cli import pretrain_encoder

FAKE = {"tokenizer": "/nonexistent/tok", "data": "/nonexistent/data_text_document"}


def test_negative_numbers_are_flag_values():
    parser, dests = pretrain_encoder.build_parser()
    args = parser.parse_args(["--config", "r.yaml", "--lr", "-1e-3", "--min-lr", "-2", "--seed", "-5"])
    assert (args.schedule__lr, args.schedule__min_lr, args.training__seed) == ("-1e-3", "-2", "-5")
    with pytest.raises(UserError, match="unrecognized arguments: -x"):  # a flag is still a flag
        parser.parse_args(["--config", "r.yaml", "-x"])


def test_a_near_miss_key_or_section_gets_a_did_you_mean(tmp_path):
    recipe = tiny_recipe(FAKE, tmp_path)
    recipe["schedule"]["lr_warmup_iter"] = 3
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['lr_warmup_iter'\] \(did you mean 'lr_warmup_iters'\?\)"):
        run_config_from_dict(recipe)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"schedul": {"lr": 1e-3}}))
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['schedul'\] \(did you mean 'schedule'\?\)"):
        read_recipe(path)
    recipe = tiny_recipe(FAKE, tmp_path)
    recipe["schedule"]["zzz"] = 1  # nothing near: no guess
    with pytest.raises(ConfigError) as refused:
        run_config_from_dict(recipe)
    assert "did you mean" not in str(refused.value)


def test_a_missing_prefix_names_the_prefixes_its_folder_holds(tmp_path, tiny_corpus):
    for suffix in (".bin", ".idx"):
        shutil.copy(tiny_corpus["data"] + suffix, str(tmp_path / "mine_content_document") + suffix)
    config = run_config_from_dict(tiny_recipe(tiny_corpus, tmp_path, data={"data_path": [str(tmp_path / "mine")]}))
    with pytest.raises(UserError, match=rf"mine.idx does not exist; the prefixes in {tmp_path}: "
                                        rf"{tmp_path}/mine_content_document"):
        check_paths(config)


def test_token_counts_take_the_unit_that_fits():
    assert [token_count(n) for n in (512, 20_480, 1_310_720, 2_100_000_000, 99_090_432_000, 1_500_000_000_000)] == \
        ["512", "20.5K", "1.31M", "2.1B", "99.1B", "1.5T"]


def test_dry_run_memory_is_judged_for_the_gpu_kind_asked_with_advice_not_already_taken(tmp_path):
    assert set(GPU_MEMORY_GIB) == set(PEAK_TFLOPS)
    config = run_config_from_dict(tiny_recipe(FAKE, tmp_path))
    report = memory_report(config, world_size=1, gpu_kind="H100")
    assert "on a H100: fits a H100 (80 GiB): 80.0 GiB usable" in report, report
    big = tiny_recipe(FAKE, tmp_path, model={"preset": "tiny", "vocab_size": 32768, "num_layers": 24,
                                               "hidden_size": 2048, "ffn_hidden_size": 8192,
                                               "num_attention_heads": 16, "num_query_groups": 16},
                      data={"micro_batch_size": 64, "global_batch_size": 64, "seq_length": 4096},
                      training={"recompute_granularity": "full"}, parallel={"use_distributed_optimizer": True})
    config = run_config_from_dict(big)
    report = memory_report(config, world_size=1, gpu_kind="L40S")
    assert "on a L40S: NOT READY" in report and "48.0 GiB usable in a L40S" in report, report
    advice = reduce_memory_advice(config)
    # The recipe has full recomputation, the distributed optimizer, scored-only LM head, no graphs.
    for taken in ("recompute_granularity", "use_distributed_optimizer", "lm_head_scored_only", "cuda_graphs"):
        assert taken not in advice, advice
    assert "micro_batch_size" in advice
    assert "recompute_granularity" in reduce_memory_advice(run_config_from_dict(tiny_recipe(FAKE, tmp_path)))


def test_the_tiny_preset_takes_the_tokenizers_vocabulary(tmp_path, tiny_corpus):
    """``model: {preset: tiny}`` (the docs' minimal recipe) gets the tokenizer's vocabulary, not
    the preset's 32,000-row placeholder; a vocab_size the recipe gives is kept."""
    raw = tiny_recipe(tiny_corpus, tmp_path)
    raw["model"] = {"preset": "tiny"}
    config, tokenizer = pretrain_encoder.config_from_recipe(raw)
    assert tokenizer is not None and config.model.vocab_size == 1024 >= tokenizer.vocab_size
    raw["model"] = {"preset": "tiny", "vocab_size": 4096}
    config, tokenizer = pretrain_encoder.config_from_recipe(raw)
    assert tokenizer is None and config.model.vocab_size == 4096
