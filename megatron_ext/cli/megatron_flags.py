"""Megatron-LM's command line as ``pretrain_encoder.py`` meets it: the one place that says which of
Megatron-LM's flags the trainer takes, what each means here, where this project keeps another
default on purpose, and what a Megatron flag it does not take should be replaced by.

A user moving a Megatron-LM launch script over passes Megatron's flags. Each one either does what
it does in Megatron-LM (its name is a recipe field's flag: ``training/recipe.py``), or is refused
in one line naming what to use instead (:func:`unsupported_flag_message`), never guessed from a
prefix (``allow_abbrev=False``) nor misread as another flag.

Megatron-LM's own flags and defaults are read from ``megatron_lm_flags.json``, written by
:func:`main` from a Megatron-LM checkout (``add_megatron_arguments`` of
``megatron/training/arguments.py`` at :data:`MEGATRON_LM_VERSION`, the release matching the
pinned megatron-core):

    python -m megatron_ext.cli.megatron_flags --megatron-lm /path/to/Megatron-LM

``tests/unit/test_megatron_flags.py`` keeps the table true: every flag of the trainer with a
Megatron-LM name has a row in :data:`MEGATRON_FLAGS_HERE` naming the test that shows its effect,
every default that differs from Megatron-LM's has its reason in :data:`DIFFERENT_DEFAULTS`, and
docs/pretraining.md's table is :func:`flags_table` (``tools/render_docs.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

MEGATRON_LM_VERSION = "core_v0.19.0"
"""The Megatron-LM release whose flags ``megatron_lm_flags.json`` lists (megatron-core 0.19.x)."""

FLAGS_FILE = Path(__file__).with_name("megatron_lm_flags.json")


@functools.cache
def megatron_lm_flags() -> dict[str, Any]:
    """Every long flag of Megatron-LM's training CLI, with its argparse default (``--help`` excepted)."""
    return json.loads(FLAGS_FILE.read_text())["flags"]


MEGATRON_FLAGS_HERE: dict[str, str] = {  # flag: the test that shows its effect (or its refusal where it cannot run)
    "--num-layers": "tests/unit/test_model.py::test_depth_scaled_init_only_shrinks_the_residual_output_projections",
    "--hidden-size": "tests/unit/test_model.py::test_paper_preset_parameter_counts",
    "--ffn-hidden-size": "tests/unit/test_model.py::test_paper_preset_parameter_counts",
    "--num-attention-heads": "tests/unit/test_model.py::test_matches_hugging_face_eurobert_and_llama",
    "--num-query-groups": "tests/unit/test_model.py::test_paper_preset_parameter_counts",
    "--kv-channels": "tests/integration/test_hf_interop.py::test_import_then_export_matches_hugging_face",
    "--vocab-size": "tests/integration/test_training.py::test_tokenizer_larger_than_model_vocab_is_refused",
    "--rotary-base": "tests/integration/test_hf_interop.py::test_import_then_export_matches_hugging_face",
    "--norm-epsilon": "tests/integration/test_hf_interop.py::test_import_then_export_matches_hugging_face",
    "--add-qkv-bias": "tests/unit/test_memory.py::test_stage_parameters_without_model_parallelism_is_the_exact_count",
    "--qk-layernorm": "tests/unit/test_memory.py::test_stage_parameters_without_model_parallelism_is_the_exact_count",
    "--transformer-impl": "tests/unit/test_gpu_path_guards.py::test_te_spec_falls_back_to_local_loudly_and_records_the_optimizer_format",
    "--attention-dropout": "tests/unit/test_megatron_flag_effects.py::test_dropouts_reach_the_layers_and_act_in_training_only",
    "--hidden-dropout": "tests/unit/test_megatron_flag_effects.py::test_dropouts_reach_the_layers_and_act_in_training_only",
    "--init-method-std": "tests/unit/test_megatron_flag_effects.py::test_init_method_std_sets_the_spread_of_every_matrix",
    "--max-position-embeddings": "tests/unit/test_phase_context.py::test_bad_phase_contexts_are_refused_naming_the_key",
    "--tokenizer-type": "tests/unit/test_tokenizer.py::test_config_errors",
    "--tokenizer-model": "tests/unit/test_tokenizer.py::test_ids_equal_megatron_core",
    "--vocab-file": "tests/unit/test_tokenizer.py::test_gpt2_bpe_equals_transformers_gpt2",
    "--merge-file": "tests/unit/test_tokenizer.py::test_gpt2_bpe_equals_transformers_gpt2",
    "--data-path": "tests/unit/test_training_data.py::test_blend_weights_parse_and_the_blend_follows_them",
    "--split": "tests/unit/test_training_data.py::test_valid_samples_without_a_valid_share",
    "--data-args-path": "tests/integration/test_phase_data.py::test_a_sharded_corpus_trains_from_its_blend_file_through_data_args_path",
    "--train-data-path": "tests/integration/test_phase_data.py::test_megatrons_per_split_paths_read_each_blend_whole_for_its_split",
    "--valid-data-path": "tests/integration/test_phase_data.py::test_megatrons_per_split_paths_read_each_blend_whole_for_its_split",
    "--test-data-path": "tests/integration/test_phase_data.py::test_megatrons_per_split_paths_read_each_blend_whole_for_its_split",
    "--seq-length": "tests/unit/test_training_data.py::test_samples_have_seq_length_and_a_seeded_order",
    "--micro-batch-size": "tests/unit/test_training_data.py::test_data_parallel_ranks_split_each_global_batch",
    "--global-batch-size": "tests/unit/test_training_data.py::test_resume_continues_exactly_where_an_uninterrupted_run_is",
    "--rampup-batch-size": "tests/unit/test_phase_context.py::test_rampup_is_megatrons",
    "--num-workers": "tests/integration/test_megatron_flag_runs.py::test_num_workers_start_loader_processes",
    "--data-cache-path": "tests/unit/test_training_data.py::test_samples_have_seq_length_and_a_seeded_order",
    "--eval-iters": "tests/unit/test_training_data.py::test_validation_sees_the_same_samples_every_time",
    "--reset-position-ids": "tests/unit/test_fusions.py::test_training_passes_positions_only_when_they_restart_per_document",
    "--reset-attention-mask": "tests/integration/test_isolated_documents_run.py::test_isolated_biphasic_run_trains_resumes_exactly_and_exports",
    "--eod-mask-loss": "tests/unit/test_training_data.py::test_document_flags_reach_gpt_dataset",
    "--adam-beta1": "tests/unit/test_megatron_flag_effects.py::test_adam_and_ddp_settings_reach_megatrons_optimizer_and_ddp",
    "--adam-beta2": "tests/unit/test_megatron_flag_effects.py::test_adam_and_ddp_settings_reach_megatrons_optimizer_and_ddp",
    "--adam-eps": "tests/unit/test_megatron_flag_effects.py::test_adam_and_ddp_settings_reach_megatrons_optimizer_and_ddp",
    "--weight-decay": "tests/integration/test_megatron_engine.py::test_decay_norms_and_biases_decays_exactly_the_one_dimensional_parameters",
    "--clip-grad": "tests/integration/test_megatron_engine.py::test_a_step_is_torch_adamw_on_the_mean_loss_of_every_scored_token",
    "--lr": "tests/unit/test_schedule.py::test_paper_wsd_values",
    "--min-lr": "tests/unit/test_schedule.py::test_matches_megatron_scheduler",
    "--lr-decay-style": "tests/unit/test_schedule.py::test_matches_megatron_scheduler",
    "--lr-warmup-iters": "tests/unit/test_schedule.py::test_paper_wsd_values",
    "--lr-warmup-init": "tests/unit/test_schedule.py::test_matches_megatron_scheduler",
    "--lr-wsd-decay-iters": "tests/unit/test_schedule.py::test_lr_decay_style_reads_megatron_spelling_and_other_styles_ignore_wsd_decay_iters",
    "--lr-wsd-decay-style": "tests/unit/test_schedule.py::test_matches_megatron_scheduler",
    "--train-iters": "tests/integration/test_recipes.py::test_step_budget_overrides",
    "--seed": "tests/unit/test_training_data.py::test_samples_have_seq_length_and_a_seeded_order",
    "--bf16": "tests/unit/test_gpu_path_guards.py::test_unsupported_requests_fail_before_the_model_is_built",
    "--eval-interval": "tests/integration/test_training.py::test_biphasic_run_logs_both_objectives_and_resumes_exactly",
    "--log-interval": "tests/integration/test_log.py::test_two_rank_run_prints_every_line_once",
    "--fp8-recipe": "tests/unit/test_gpu_path_guards.py::test_transformer_overrides_carry_fp8_and_recomputation",
    "--fp8-format": "tests/unit/test_megatron_flags.py::test_fp8_format_turns_fp8_on_as_in_megatron_lm",
    "--recompute-granularity": "tests/unit/test_gpu_path_guards.py::test_transformer_overrides_carry_fp8_and_recomputation",
    "--recompute-num-layers": "tests/unit/test_gpu_path_guards.py::test_transformer_overrides_carry_fp8_and_recomputation",
    "--cross-entropy-loss-fusion": "tests/unit/test_fusions.py::test_the_cross_entropy_kernel_reaches_the_transformer_config",
    "--cross-entropy-fusion-impl": "tests/unit/test_fusions.py::test_te_cross_entropy_on_cpu_runs_the_native_kernel_with_the_unfused_loss",
    "--no-rope-fusion": "tests/unit/test_fusions.py::test_settings_parse_and_reach_the_transformer_config",
    "--no-gradient-accumulation-fusion": "tests/unit/test_fusions.py::test_settings_parse_and_reach_the_transformer_config",
    "--exit-signal-handler": "tests/integration/test_stop.py::test_without_the_handler_a_signal_ends_the_run_at_once",
    "--exit-duration-in-mins": "tests/integration/test_stop.py::test_time_budget_and_exit_interval_stop_after_a_saved_step",
    "--exit-interval": "tests/integration/test_stop.py::test_time_budget_and_exit_interval_stop_after_a_saved_step",
    "--tensor-model-parallel-size": "tests/unit/test_gpu_path_guards.py::test_unsupported_requests_fail_before_the_model_is_built",
    "--pipeline-model-parallel-size": "tests/unit/test_gpu_path_guards.py::test_unsupported_requests_fail_before_the_model_is_built",
    "--use-distributed-optimizer": "tests/integration/test_megatron_engine.py::test_resume_refuses_another_optimizer_layout",
    "--overlap-grad-reduce": "tests/unit/test_megatron_flag_effects.py::test_adam_and_ddp_settings_reach_megatrons_optimizer_and_ddp",
    "--overlap-param-gather": "tests/unit/test_megatron_flag_effects.py::test_adam_and_ddp_settings_reach_megatrons_optimizer_and_ddp",
    "--distributed-timeout-minutes": "tests/unit/test_distributed_timeout.py::test_the_setting_is_the_collective_timeout_of_the_world_and_megatrons_groups",
    "--save": "tests/integration/test_training.py::test_biphasic_run_logs_both_objectives_and_resumes_exactly",
    "--load": "tests/integration/test_training.py::test_continued_pretraining_loads_weights_only",
    "--save-interval": "tests/integration/test_megatron_flag_runs.py::test_keep_last_zero_keeps_every_checkpoint_as_megatron_lm",
    "--finetune": "tests/integration/test_training.py::test_continued_pretraining_loads_weights_only",
    "--async-save": "tests/integration/test_processes.py::test_a_trainer_killed_during_async_saves_leaves_no_process",
    "--async-strategy": "tests/integration/test_checkpoint.py::test_the_nvrx_writer_is_refused_in_one_line_where_it_cannot_run",
    "--wandb-project": "tests/unit/test_megatron_flag_effects.py::test_wandb_project_and_experiment_name_name_the_wandb_run",
    "--wandb-exp-name": "tests/unit/test_megatron_flag_effects.py::test_wandb_project_and_experiment_name_name_the_wandb_run",
}
"""Each Megatron-LM flag the trainer takes and the test that shows its effect (a CPU refusal for the
GPU-only ones, whose effect the ``gpu`` tests show). ``tests/unit/test_megatron_flags.py`` fails on
a Megatron-named flag without a row, or a row whose test does not exist."""


DIFFERENT_DEFAULTS: dict[str, str] = {
    "--adam-beta2": "the paper's AdamW (EuroBERT's recipe)",
    "--adam-eps": "the paper's AdamW (EuroBERT's recipe)",
    "--weight-decay": "the paper's AdamW (EuroBERT's recipe)",
    "--lr-decay-style": "the paper's warmup-stable-decay schedule",
    "--lr-wsd-decay-style": "the paper's linear final decay",
    "--attention-dropout": "Llama-like pretraining (EuroBERT, the paper) uses no dropout",
    "--hidden-dropout": "Llama-like pretraining (EuroBERT, the paper) uses no dropout",
    "--transformer-impl": "the local spec runs on CPU and GPU; the GPU recipes set te (benchmarks/results/"
                          "recipe_defaults.md)",
    "--num-workers": "rows are read from memory-mapped Megatron datasets in the training process; a worker is a "
                     "process holding torch, which a CPU run cannot spare",
    "--log-interval": "a line every 10 steps: small and CPU runs are watched step by step",
    "--eval-interval": "Megatron-LM requires it with validation data; here a validation every 1000 steps",
    "--save-interval": "Megatron-LM saves only at the end without it; here every 1000 steps",
    "--no-rope-fusion": "fused RoPE needs Transformer Engine and a GPU: off unless asked (--rope-fusion)",
    "--no-gradient-accumulation-fusion": "the fusion needs Transformer Engine or apex: off unless asked "
                                         "(--gradient-accumulation-fusion)",
    "--exit-signal-handler": "SIGTERM and SIGUSR1 save and exit 75 (resumable): what a SLURM time limit, "
                             "preemption or a cancelled job needs; --no-exit-signal-handler for Megatron-LM's",
    "--async-strategy": "nvidia-resiliency-ext is not in requirements.txt (docs/gpu.md)",
    "--wandb-project": "W&B writes offline files by default (logging.wandb_mode: offline, Megatron-LM: no W&B "
                       "without --wandb-project); --wandb-mode disabled for none",
    "--recompute-num-layers": "read only with --recompute-granularity full, where Megatron-LM requires it",
    "--fp8-recipe": "unset means Megatron-LM's delayed once --fp8-format turns FP8 on",
    "--vocab-size": "Megatron-LM also pads the tokenizer's size (to --make-vocab-size-divisible-by 128 x TP)",
    "--num-query-groups": "Megatron-LM reads it only with --group-query-attention",
    "--max-position-embeddings": "the longest sequence of data.seq_length and the phases (RoPE has no learned "
                                 "table)",
}
"""Flags whose default here is not Megatron-LM's, and why (shown by ``--help`` beside Megatron's)."""


BEHAVIOUR_DIFFERENCES: dict[str, str] = {
    "--split": "unset with --data-path means '98,2,0': no test share unless asked (Megatron-LM warns and uses "
               "'969, 30, 1' when --split is missing)",
    "--bf16": "bf16 autocast over fp32 parameters; Megatron-LM's --bf16 also stores bf16 parameters with fp32 "
              "main parameters in the optimizer: add --params-dtype bfloat16 for that",
    "--save-interval": "keeps the newest --keep-last (2) checkpoints and every --keep-steps one; Megatron-LM "
                       "keeps every checkpoint: --keep-last 0",
    "--save": "a rerun resumes from the newest complete checkpoint here, with or without --load (Megatron-LM "
              "resumes only from --load)",
    "--vocab-size": "the embedding rows as given (a multiple of the tensor-parallel size); Megatron-LM pads it to "
                    "--make-vocab-size-divisible-by 128 x TP",
    "--num-query-groups": "takes effect alone; Megatron-LM reads it only with --group-query-attention (refused "
                          "here: drop it)",
    "--exit-interval": "saves and exits 75, the resumable stop the launch scripts requeue; Megatron-LM exits 0",
    "--exit-duration-in-mins": "saves and exits 75, the resumable stop the launch scripts requeue; Megatron-LM "
                               "exits 0",
}
"""Megatron-named flags that work otherwise here on purpose (``--help`` and the dry run say so)."""


_USE_RECIPE = "the encoder spec is Llama-like (RoPE, RMSNorm, SwiGLU, GQA): it is fixed here"
UNSUPPORTED: dict[str, str] = {
    "--fp16": "train in bf16 (--bf16): fp16 needs loss scaling, which this trainer does not do",
    "--optimizer": "this trainer always uses AdamW (Megatron-LM's --optimizer adam): drop the flag",
    "--exit-signal": "--exit-signal-handler catches both SIGTERM and SIGUSR1: drop the flag",
    "--train-samples": "give the run's length in steps: --train-iters",
    "--lr-decay-iters": "the decay spans the run (cosine, linear) or its last --lr-wsd-decay-iters steps (wsd)",
    "--lr-decay-samples": "the decay spans the run (cosine, linear) or its last --lr-wsd-decay-iters steps (wsd)",
    "--lr-warmup-fraction": "give the warmup in steps: --lr-warmup-iters",
    "--lr-warmup-samples": "give the warmup in steps: --lr-warmup-iters",
    "--lr-wsd-decay-samples": "give the decay in steps: --lr-wsd-decay-iters",
    "--position-embedding-type": _USE_RECIPE + " (rope; --rotary-base sets its base)",
    "--use-rotary-position-embeddings": _USE_RECIPE + " (rope is always on)",
    "--swiglu": _USE_RECIPE + " (SwiGLU is always on)",
    "--normalization": _USE_RECIPE + " (RMSNorm; --norm-epsilon sets its epsilon)",
    "--disable-bias-linear": _USE_RECIPE + " (no linear biases; --add-qkv-bias adds the QKV ones)",
    "--group-query-attention": "grouped-query attention is on whenever --num-query-groups is below "
                               "--num-attention-heads: drop the flag",
    "--untie-embeddings-and-output-weights": "embeddings and LM head are untied by default here (--tie-embeddings "
                                             "ties them): drop the flag",
    "--use-mcore-models": "every model here is a Megatron-Core model: drop the flag",
    "--use-flash-attn": "attention runs PyTorch's SDPA (local) or Transformer Engine's fused kernels (te): "
                        "choose with --transformer-impl",
    "--attention-backend": "attention runs PyTorch's SDPA (local) or Transformer Engine's fused kernels (te): "
                           "choose with --transformer-impl",
    "--recompute-method": "full recomputation is Megatron's uniform method here (--recompute-num-layers per chunk)",
    "--sequence-parallel": "not supported: tensor parallelism without sequence parallelism "
                           "(--tensor-model-parallel-size)",
    "--context-parallel-size": "not supported: long contexts train with a phase's seq_length (docs/pretraining.md)",
    "--ckpt-format": "checkpoints are always Megatron-Core's torch_dist format",
    "--no-load-optim": "start from a checkpoint's weights only with --finetune (fresh optimizer and schedule)",
    "--no-load-rng": "start from a checkpoint's weights only with --finetune (fresh optimizer and schedule)",
    "--use-checkpoint-args": "the recipe (--config) is the run's configuration; a resume refuses a changed model",
    "--tensorboard-dir": "metrics go to <--log-dir>/metrics.jsonl and W&B (--wandb-mode); no TensorBoard",
    "--wandb-save-dir": "W&B files go under --log-dir",
    "--mock-data": "train on real data: make demo-data builds a small corpus (README)",
    "--log-throughput": "the step line always shows tokens/s and MFU",
    "--no-bias-swiglu-fusion": "the fused SwiGLU is off by default here (--bias-activation-fusion turns it on)",
    "--apply-layernorm-1p": _USE_RECIPE,
    "--rotary-percent": _USE_RECIPE + " (RoPE over the whole head)",
    "--dataloader-type": "batches are drawn in Megatron's pretraining order (its single sampler), resumed exactly",
    "--calculate-per-token-loss": "the loss is always averaged over the scored tokens of the global batch",
    "--per-split-data-args-path": "give the splits' blends with --train-data-path, --valid-data-path and "
                                  "--test-data-path (a long blend: --data-args-path)",
    "--check-for-spiky-loss": "loss spikes are watched with --loss-spike-factor (and rolled back with "
                              "--spike-rollbacks): docs/pretraining.md, \"The edges of a long job\"",
    "--no-check-for-nan-in-loss-and-grad": "non-finite steps are always skipped and counted "
                                           "(--max-nonfinite-steps in a row stop the run, or roll it back)",
    "--rerun-mode": "a spike or the non-finite stop rolls back to a checkpoint with --spike-rollbacks",
    "--inprocess-heartbeat-timeout": "a hung rank ends the job, named, with --hang-timeout-minutes "
                                     "(heartbeat files, exit 75 for the launcher's restart)",
    "--enable-ft-package": "a hung rank ends the job, named, with --hang-timeout-minutes (heartbeat files, "
                           "exit 75 for the launcher's restart); nvidia-resiliency-ext is not required",
}
"""Megatron-LM flags the trainer does not take, with what to use instead (or why not)."""


def unsupported_flag_message(flag: str) -> str | None:
    """The one-line refusal of ``flag`` when it is a Megatron-LM flag this trainer does not take;
    None when it is not Megatron-LM's."""
    if flag not in megatron_lm_flags():
        return None
    reason = UNSUPPORTED.get(flag, "see `pretrain_encoder.py --help` and docs/pretraining.md#megatron-lm-flags "
                                   "for the flags this trainer takes")
    return f"Megatron-LM's {flag} is not supported here: {reason}"


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "[]"
    return "unset" if value is None else str(value)


def same_default(ours: Any, megatron: Any) -> bool:
    """Whether two defaults mean the same value (``10000.0`` and ``10000``; a required field and
    Megatron-LM's unset one)."""
    if ours is dataclasses.MISSING:
        return megatron is None
    if isinstance(ours, bool) or isinstance(megatron, bool):
        return ours is megatron
    if isinstance(ours, (int, float)) and isinstance(megatron, (int, float)):
        return float(ours) == float(megatron)
    if isinstance(ours, tuple):
        ours = list(ours)
        if not ours and megatron is None:  # an empty list of paths is Megatron's unset one
            return True
    return ours == megatron


def annotate_help(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """Append each flag's default (``defaults``: ``{argparse dest: the default a recipe that does
    not set it gets}``) to its help, with Megatron-LM's beside it where that differs, and how a
    Megatron-named flag behaves otherwise here on purpose."""
    names = megatron_lm_flags()
    for action in parser._actions:
        if action.dest not in defaults:
            continue
        ours = defaults[action.dest]
        notes = ["required (in the recipe)" if ours is dataclasses.MISSING else f"default: {_shown(ours)}"]
        for flag in action.option_strings:
            if flag in names and not same_default(ours, names[flag]):
                why = DIFFERENT_DEFAULTS.get(flag, "")
                notes.append(f"Megatron-LM: {_shown(names[flag])}{f', {why}' if why else ''}")
            if flag in BEHAVIOUR_DIFFERENCES:
                notes.append(f"unlike Megatron-LM: {BEHAVIOUR_DIFFERENCES[flag]}")
        # The help is already %-escaped (config_loading._field_docs); the notes are plain text.
        action.help = (action.help or "").rstrip() + " [" + "; ".join(notes).replace("%", "%%") + "]"


def megatron_differences(config) -> list[str]:
    """What this run (a ``RunConfig``) does otherwise than Megatron-LM would with the same flags, on
    purpose, one clause each: the dry run prints them so that a ported script's user sees them
    before the launch."""
    t, c, s = config.training, config.checkpoint, config.schedule
    found = []
    if t.bf16 and config.model.params_dtype == "float32":
        found.append("--bf16 is bf16 autocast over fp32 parameters (Megatron-LM's stores bf16 parameters with fp32 "
                     "main parameters: add --params-dtype bfloat16)")
    if c.save and c.keep_last:
        found.append(f"checkpoints beyond the newest {c.keep_last} are deleted (--keep-last; Megatron-LM keeps every "
                     "one: --keep-last 0)")
    if config.logging.wandb_mode != "disabled":
        found.append(f"W&B writes {config.logging.wandb_mode} under {config.logging.log_dir} (Megatron-LM: only with "
                     "--wandb-project; --wandb-mode disabled for none)")
    if c.save and not c.load:
        found.append("a rerun resumes from --save's newest checkpoint (Megatron-LM: only from --load)")
    if t.exit_signal_handler:
        found.append("SIGTERM/SIGUSR1 save and exit 75 (--exit-signal-handler, off by default in Megatron-LM)")
    if t.exit_interval or t.exit_duration_in_mins:
        found.append("--exit-interval/--exit-duration-in-mins stop with exit code 75, resumable (Megatron-LM: 0)")
    if s.lr_decay_style != "wsd" and s.lr_wsd_decay_iters is not None:
        found.append(f"schedule.lr_wsd_decay_iters={s.lr_wsd_decay_iters} is unused with lr_decay_style "
                     f"{s.lr_decay_style} (as in Megatron-LM)")
    return found


def trainer_flag_defaults(parser: argparse.ArgumentParser, dests: dict[str, tuple[str, str]]
                          ) -> dict[str, tuple[argparse.Action, Any]]:
    """``{flag: (its argparse action, the default a recipe that does not set it gets)}`` for every
    flag of the trainer's ``parser`` (``pretrain_encoder.build_parser``) that names one recipe field
    (``dests``: ``{dest: (section, field)}``)."""
    from megatron_ext.training.recipe import field_defaults

    defaults = field_defaults(dests)
    return {flag: (action, defaults[action.dest]) for action in parser._actions if action.dest in defaults
            for flag in action.option_strings}


def _first_sentence(text: str) -> str:
    """The first sentence of a field's doc, in Markdown (``x`` as `x`), without its flag's own name."""
    text = " ".join(text.replace("``", "`").replace("%%", "%").split())
    text = re.sub(r"^`--[a-z0-9-]+`:\s*", "", text)
    match = re.match(r"(.+?)\.(\s|$)", text)
    return match.group(1) if match else text


def flags_table(parser: argparse.ArgumentParser, dests: dict[str, tuple[str, str]]) -> str:
    """docs/pretraining.md's table (Markdown): each Megatron-LM flag the trainer takes (its
    ``parser`` and ``dests``: ``pretrain_encoder.build_parser``), the recipe key it sets and what
    that does, the defaults side by side and the test that shows its effect; then the refused ones."""
    names, ours = megatron_lm_flags(), trainer_flag_defaults(parser, dests)
    lines = ["| Megatron-LM flag | recipe key: what it does here | default here | Megatron-LM's | shown by |",
             "|---|---|---|---|---|"]
    for flag, test in sorted(MEGATRON_FLAGS_HERE.items()):
        action, default = ours[flag]
        section, field = dests[action.dest]
        does = f"`{section}.{field}`: {_first_sentence(action.help.split(' [')[0])}"
        if flag in BEHAVIOUR_DIFFERENCES:
            does += f"; unlike Megatron-LM: {BEHAVIOUR_DIFFERENCES[flag]}"
        here = "required" if default is dataclasses.MISSING else f"`{_shown(default)}`"
        if flag in DIFFERENT_DEFAULTS and not same_default(default, names[flag]):
            here += f" ({DIFFERENT_DEFAULTS[flag]})"
        cells = [f"`{flag}`", does, here, f"`{_shown(names[flag])}`", f"`{test.split('/')[-1]}`"]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines += ["", "Refused, each in one line naming what to use instead (any other Megatron-LM flag gets the "
              "same line pointing here):", ""]
    lines += [f"- `{flag}`: {reason}" for flag, reason in sorted(UNSUPPORTED.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write ``megatron_lm_flags.json`` from a Megatron-LM checkout (at :data:`MEGATRON_LM_VERSION`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--megatron-lm", required=True, type=Path, help="a Megatron-LM checkout (its root)")
    parser.add_argument("--output", type=Path, default=FLAGS_FILE, help="where to write the list")
    args = parser.parse_args(argv)
    # In a child process with the checkout first on its path: its megatron.training imports its own
    # megatron.core, which must not mix with the installed one in this process.
    dump = ("import argparse, json, sys\n"
            "from megatron.training.arguments import add_megatron_arguments\n"
            "parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))\n"
            "flags = {}\n"
            "for action in parser._actions:\n"
            "    for flag in action.option_strings:\n"
            "        if flag.startswith('--') and flag != '--help':\n"
            "            try: json.dumps(action.default); flags[flag] = action.default\n"
            "            except TypeError: flags[flag] = repr(action.default)\n"
            "json.dump(dict(sorted(flags.items())), sys.stdout)\n")
    env = {**os.environ, "PYTHONPATH": str(args.megatron_lm.resolve())}
    out = subprocess.run([sys.executable, "-c", dump], env=env, check=True, capture_output=True, text=True).stdout
    record = {"megatron_lm": MEGATRON_LM_VERSION,
              "source": "megatron/training/arguments.py: add_megatron_arguments(argparse.ArgumentParser())",
              "flags": json.loads(out)}
    args.output.write_text(json.dumps(record, indent=0) + "\n")
    print(f"{args.output}: {len(record['flags'])} flags of Megatron-LM {MEGATRON_LM_VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
