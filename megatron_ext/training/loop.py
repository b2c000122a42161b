"""The pretraining loop: phases (objectives) per step, WSD learning rate, checkpoints, logging.

Everything a step does is a function of the step number and the config: the phase and the
objective (``phases.phase_at``), the learning rate (``schedule.lr_at``), the data position
(``step * global_batch_size`` samples consumed) and the MLM masks (a generator seeded from
``(seed, step, micro-batch group)``). A resumed run therefore replays exactly what an
uninterrupted run would have done; model, optimizer and RNG states come from the checkpoint.

A branch (``checkpoint.branch_from``) is the same: its steps ``[branch_step, train_iters)`` are
functions of the step and of its own recipe (phases, schedule, data order for its own length),
and its starting state is the parent's after ``branch_step`` steps, which the branch check
(``training.branching.check_saved_parent``) has shown to be this recipe's own trajectory up to
there. So the trainer state carries over (step, RNG, the non-finite counters: the same steps),
except what names the parent's run itself (``PARENT_ONLY``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.config_loading import UserError
from megatron_ext import hardware, process_group, processes
from megatron_ext.model.provider import ENCODER, ModelProvider
from megatron_ext.objectives import Objective, PhaseProgress, Vocabulary
from megatron_ext.phases import Phase, ResolvedPhase, phase_at
from megatron_ext.schedule import lr_at
from megatron_ext.tokenizer import EncoderTokenizer
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.checkpoint.lock import SaveDirectoryLock
from megatron_ext.checkpoint.resume import BRANCHED_FROM, StartingPoint, load_starting_point
from megatron_ext.training import cuda_graphs
from megatron_ext.training import context as context_lib
from megatron_ext.training.branching import check_saved_parent
from megatron_ext.training.config import DataConfig, RunConfig
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.megatron_engine import MegatronEngine, MicroBatch, megatron_transformer_overrides
from megatron_ext.training.batches import Batches, build_batches, to_device
from megatron_ext.training.datasets import GPT_DATASETS, DatasetProvider, format_blend
from megatron_ext.training.mixtures import SpanReads, format_source_plan
from megatron_ext.training.recovery import (LossSpikeWatch, NonFiniteGuard, NonFiniteLossError, Rollbacks, RunRecovery,
                                            TimedSaves)
from megatron_ext.training.run_checkpoints import RunCheckpoints
from megatron_ext.training.watchdog import HangWatchdog, heartbeat_dir
from megatron_ext.training.preflight import Caller, preflight
from megatron_ext.training.step_log import MetricSinks, StepLogger, is_writer
from megatron_ext.training.stop import StopPolicy, write_exit_status
from megatron_ext.exit_codes import RESUMABLE_EXIT_CODE

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TrainResult:
    """What a run did (returned on every rank)."""

    start_step: int
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    """Completed step -> global mean training loss."""
    valid: dict[int, dict[str, float]] = field(default_factory=dict)
    """Completed step -> validation loss by ``objectives.validation_objectives`` key ({"clm": ..., "mlm": ...},
    and "mntp" for a run that trains MNTP)."""
    valid_by_source: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    """Completed step -> each validation source's losses by the same keys, when the validation data
    is a blend of several datasets (``{"wiki_text_document": {"clm": ..., ...}, ...}``)."""
    test: dict[str, float] = field(default_factory=dict)
    """The test split's losses, by the same keys as ``valid``, measured once after the last step
    (``training.train_iters``); empty when the split has no test share, ``data.eval_iters`` is 0 or
    the run stopped before its end."""
    skipped_steps: int = 0
    checkpoint: str | None = None
    """The last checkpoint written or loaded."""
    stopped: str | None = None
    """Why the run stopped before ``training.train_iters`` (a signal, the time budget, the exit
    interval), after saving ``final_step`` when ``checkpoint.save`` is set; None: it ran to the end."""

    @property
    def stop_summary(self) -> str:
        """One line for the exit status: where and why the run stopped."""
        return f"stopped after step {self.final_step}: {self.stopped}"


TRAIN_STREAM, EVAL_STREAM = 0, 1


def masking_generator(seed: int, step: int, group: int, device: torch.device, *, stream: int = TRAIN_STREAM) -> torch.Generator:
    """MLM mask RNG for one micro-batch, a pure function of (seed, stream, step, micro-batch group).

    ``group = micro_batch_index * dp_size + dp_rank`` names the same samples whatever the data
    parallel size (for a fixed micro-batch size), so DP=2 masks exactly what DP=1 masks.
    Validation uses its own stream with step 0, so every evaluation masks the same positions.
    """
    state = np.random.SeedSequence([seed, stream, step, group]).generate_state(2, dtype=np.uint32)
    return torch.Generator(device=device).manual_seed(int(state[0]) << 32 | int(state[1]))


@torch.no_grad()
def validate(engine: MegatronEngine, batches: list[dict[str, torch.Tensor]], *, config: RunConfig,
             vocabulary: Vocabulary, rotary_base: float, sources: Sequence[str] = ()
             ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Validation losses (``objectives.validation_objectives``) on the same fixed batches (global
    token means), whatever the run trains; the test split's at the end of training, measured alike.
    ``rotary_base``: the RoPE theta the model was last trained with (its phase's). With ``sources``
    (the names of a blend's datasets, whose batches say each row's, Megatron's ``dataset_id``), also
    each source's losses, from the same forward passes: ``(losses, {source: losses})``."""
    engine.model.eval()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    device = hardware.device()
    result: dict[str, float] = {}
    by_source: dict[str, dict[str, float]] = {name: {} for name in sources}
    for key, objective in config.validation_objectives().items():
        micro_batches = []
        for i, batch in enumerate(batches):
            gen = masking_generator(config.training.seed, 0, i * dp_size + dp_rank, device, stream=EVAL_STREAM)
            micro = _apply(objective, batch, VALIDATION_PROGRESS, vocabulary, gen, config, rotary_base)
            micro_batches.append(dataclasses.replace(micro, sources=batch["dataset_id"]) if sources else micro)
        if sources:
            loss_sum, tokens, per_source = engine.eval_loss_by_source(micro_batches, len(sources))
            for name, (source_sum, source_tokens) in zip(sources, per_source):
                by_source[name][key] = source_sum / source_tokens if source_tokens > 0 else math.nan
        else:
            loss_sum, tokens = engine.eval_loss(micro_batches)
        result[key] = loss_sum / tokens if tokens > 0 else math.nan
    engine.model.train()
    return result, by_source


ROLLBACKS = "rollbacks"
"""Trainer-state key: the run's rollbacks so far (``training.recovery.Rollbacks``)."""

LOSS_WINDOW = "loss_window"
"""Trainer-state key: the losses a spike is judged against (``training.recovery.LossSpikeWatch``)."""

PARENT_ONLY = ("wandb_run_id", ROLLBACKS, LOSS_WINDOW)
"""Trainer-state keys a branch does not take from its parent: a branch logs its own W&B run (in its
own ``logging.log_dir``), from its branch step on, and has its own rollbacks."""


def _trainer_state(step: int, config: RunConfig, nonfinite: int, skipped: int, wandb_run_id: str | None,
                   branched_from: dict | None, recovery: RunRecovery) -> dict:
    state = {
        "step": step,
        "consumed_samples": config.consumed_samples(step),  # Megatron's counter
        "nonfinite_in_a_row": nonfinite,
        "skipped_steps": skipped,
        "wandb_run_id": wandb_run_id,
        ROLLBACKS: recovery.rollbacks.done,
        LOSS_WINDOW: recovery.spikes.state(),
        **hardware.rng_state(),
    }
    if branched_from is not None:
        state[BRANCHED_FROM] = branched_from
    return state


def _micro_batch(batch: dict[str, torch.Tensor], step: int, phase: ResolvedPhase, group: int, *, config: RunConfig,
                 vocabulary: Vocabulary, device: torch.device, rotary_base: float) -> MicroBatch:
    """One micro-batch of ``step`` under ``phase``'s objective; ``group`` (micro-batch index x
    data-parallel size + rank) keys its masking stream, so the masks do not depend on the layout."""
    batch = to_device(batch, device)
    gen = masking_generator(config.training.seed, step, group, device)
    return _apply(phase.objective, batch, phase.progress(step), vocabulary, gen, config, rotary_base)


VALIDATION_PROGRESS = PhaseProgress(step=0, steps=1)
"""Validation objectives have no schedule: every evaluation measures the same thing."""


def _apply(objective: Objective, batch: dict[str, torch.Tensor], progress: PhaseProgress, vocabulary: Vocabulary,
           generator: torch.Generator, config: RunConfig, rotary_base: float) -> MicroBatch:
    """``objective`` on one device micro-batch, with the position ids and the RoPE base the model reads."""
    return MicroBatch(objective.make_batch(batch, progress=progress, vocabulary=vocabulary, generator=generator),
                      model_positions(batch, config), rotary_base)


def model_positions(batch: dict[str, torch.Tensor], config: RunConfig) -> torch.Tensor | None:
    """The position ids the model reads: the batch's with ``data.reset_position_ids`` (they restart
    per document), else None. Without the reset, GPTDataset's are ``0..s-1`` in every row, which is
    what the model computes from None, as one ``[s, 1, 1, d]`` RoPE table for the batch: the form
    Transformer Engine's fused RoPE (``training.rope_fusion``) accepts, and the same numbers."""
    return batch.get("position_ids") if config.data.reset_position_ids else None


def runnable_here(config: RunConfig, *, announce: bool = True) -> RunConfig:
    """``config`` with what this machine cannot run turned off (``hardware.transformer_impl_fallback``,
    ``hardware.fusion_fallbacks``); each change is printed to stderr once when ``announce``."""
    backend, warning = hardware.transformer_impl_fallback(config.model.transformer_impl)
    warnings = [warning] if warning is not None else []
    t = config.training
    fusions, fusion_warnings = hardware.fusion_fallbacks(
        rope_fusion=t.rope_fusion, gradient_accumulation_fusion=t.gradient_accumulation_fusion,
        transformer_impl=backend, cross_entropy_fusion_impl=t.cross_entropy_fusion_impl)
    if announce:
        for line in warnings + fusion_warnings:
            print(line, file=sys.stderr, flush=True)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, transformer_impl=backend),
                               training=dataclasses.replace(t, **fusions))


def pretrain(config: RunConfig, *, exit_after_step: int | None = None, model_provider: ModelProvider = ENCODER,
             dataset_provider: DatasetProvider = GPT_DATASETS) -> TrainResult:
    """Run (or resume) the configured pretraining. Initialises distributed state if needed.

    ``exit_after_step`` stops (after checkpointing) once that many steps are complete; used to
    test that resuming is exact. Signals and ``training.exit_*`` stop runs too (``training.stop``).
    ``model_provider`` builds the model of ``config.model`` (``model.provider``: the encoder by
    default) and ``dataset_provider`` the datasets of ``config.data`` (``training.datasets``:
    Megatron's ``GPTDataset`` by default), as torchtitan's train spec names them.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    preflight(config, Caller.RUN_BEFORE_PROCESS_GROUP, world_size=world_size)  # paths, layout, this machine
    config = runnable_here(config, announce=int(os.environ.get("RANK", "0")) == 0)
    if config.training.deterministic:  # before the process group (NCCL) and any CUDA work (cuBLAS)
        hardware.make_deterministic()
    processes.end_orphans()  # what a killed run on this machine left behind
    owns_process_group = not dist.is_initialized()
    try:
        if owns_process_group:
            process_group.init_process_group_and_model_parallel(
                tensor_parallel_size=config.parallel.tensor_model_parallel_size,
                pipeline_parallel_size=config.parallel.pipeline_model_parallel_size,
                seed=config.training.seed,
                timeout_minutes=config.parallel.distributed_timeout_minutes,
            )
        with processes.trainer_session():
            return _pretrain(config, exit_after_step=exit_after_step, model_provider=model_provider,
                             dataset_provider=dataset_provider)
    finally:
        if owns_process_group:
            process_group.destroy_process_group_and_model_parallel()


def _build_model_and_engine(config: RunConfig, device: torch.device, model_provider: ModelProvider) -> MegatronEngine:
    """This pipeline stage's model (``model_provider``'s) on ``device``, wrapped by the engine."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    cuda_graphs.prepare_rng(config)  # graph-safe RNG tracker before the layers' graph managers exist
    model = model_provider.build_model(config.model, pre_process=pp_rank == 0, post_process=pp_rank == pp_size - 1,
                                       transformer_overrides=megatron_transformer_overrides(config)).to(device)
    return MegatronEngine(model, config)


def _warn_of_kept_steps_missed(config: RunConfig, start: int) -> None:
    """Say so when ``checkpoint.keep_steps`` name steps this run has passed without saving them (they
    were added to a resumed run's recipe): the branches that start there will be refused."""
    kept = [step for step in config.checkpoint.keep_steps if step <= start]
    if not kept or not is_writer():
        return
    saved = {checkpoint.step for checkpoint in Checkpoint.every(config.checkpoint.save)}
    missed = [step for step in kept if step not in saved]
    if missed:
        print(f"warning: checkpoint.keep_steps {missed} are at or before this run's start (step {start}) and not in "
              f"checkpoint.save={config.checkpoint.save!r}: branches from them will be refused until the run is "
              "trained again from before them", file=sys.stderr, flush=True)


def _due(step: int, interval: int, total: int) -> bool:
    """Whether a periodic action (evaluation, saving) runs after ``step``: every ``interval``
    steps (0: none before the last; ``training.eval_interval: 0``, as in Megatron-LM, still
    validates at the end of training) and after the last."""
    return step == total or (interval > 0 and step % interval == 0)


def _pretrain(config: RunConfig, *, exit_after_step: int | None, model_provider: ModelProvider,
              dataset_provider: DatasetProvider) -> TrainResult:
    # First, before this run writes anything: a second trainer on the same save directory stops here.
    with (SaveDirectoryLock.acquire(config.checkpoint.save) if config.checkpoint.save
          else contextlib.nullcontext()) as lock:
        return _pretrain_locked(config, exit_after_step=exit_after_step, lock=lock, model_provider=model_provider,
                                dataset_provider=dataset_provider)


def _pretrain_locked(config: RunConfig, *, exit_after_step: int | None, lock: SaveDirectoryLock | None,
                     model_provider: ModelProvider, dataset_provider: DatasetProvider) -> TrainResult:
    # Everything a launch can get wrong is refused here, before the model is allocated: save space,
    # memory, the tokenizer, the sources (training.preflight).
    checks = preflight(config, Caller.RUN_BEFORE_MODEL, world_size=dist.get_world_size())
    # The pre-flight planned the sources as the default provider reads them; another plans its own.
    source_plan = checks.source_plan if dataset_provider is GPT_DATASETS else None
    device = hardware.device()
    engine = _build_model_and_engine(config, device, model_provider)
    try:
        return _train_engine(config, engine, tokenizer=checks.tokenizer, device=device,
                             exit_after_step=exit_after_step, lock=lock, dataset_provider=dataset_provider,
                             source_plan=source_plan)
    finally:
        engine.close()  # its CUDA graphs, whatever ends the run


RESUME_KEEPS_DATA = {
    "reset_attention_mask": "which tokens each token attends to",
    "reset_position_ids": "the positions RoPE reads",
    "eod_mask_loss": "which tokens the loss scores",
}
"""``data`` keys a resume keeps, with what a change would alter from the checkpoint's step on: the
steps after it would compute another function of the same samples than the steps before, which a
resume (the run continued as if never stopped) cannot be; a branch compares them too
(``training.branching``)."""


def _check_resume_keeps_context(checkpoint: Checkpoint, config: RunConfig) -> None:
    """Refuse, in one line naming the key and the step, to resume ``checkpoint`` with another
    ``RESUME_KEEPS_DATA`` setting, or with phases that read other sequence lengths, RoPE bases or
    global batches than the run that saved it (its data positions and positions' meaning would no
    longer be its own). Other settings continue a run only explicitly: a branch
    (``checkpoint.branch_from``) or continued pretraining (``checkpoint.finetune``)."""
    saved_raw = checkpoint.run_config()
    saved_data = saved_raw.get("data") or {}
    for key, what in RESUME_KEEPS_DATA.items():
        saved, wanted = saved_data.get(key, DataConfig.__dataclass_fields__[key].default), getattr(config.data, key)
        if saved != wanted:
            raise UserError(f"resuming {checkpoint} (step {checkpoint.step}) with data.{key} {json.dumps(saved)} -> "
                            f"{json.dumps(wanted)}: {what} would change from the next step on; keep it, or branch "
                            "(checkpoint.branch_from) or continue from the weights (checkpoint.finetune)")
    saved_ramp = saved_data.get("rampup_batch_size")
    ramp = config.data.rampup_batch_size
    if (list(saved_ramp) if saved_ramp else None) != (list(ramp) if ramp else None):
        raise UserError(f"resuming {checkpoint} with another data.rampup_batch_size: {saved_ramp} in the saved run, "
                        f"{list(ramp) if ramp else None} in this recipe; the steps' batches and data positions would "
                        "change: keep it, or branch (checkpoint.branch_from) or continue from the weights "
                        "(checkpoint.finetune)")
    raw_phases = saved_raw.get("phases") or []
    sets_context = any(isinstance(p, dict) and set(p) & set(Phase.CONTEXT_KEYS + Phase.DATA_KEYS) for p in raw_phases)
    if not sets_context and not context_lib.varies(config.phase_contexts) and \
            not context_lib.reads_sources(config.phase_contexts) and \
            saved_data.get("seq_length") == config.data.seq_length:
        return  # one length, the same, in both: nothing to compare (and older configs need not read)
    try:
        saved = run_config_from_dict(saved_raw)
    except UserError as error:
        raise UserError(f"resuming {checkpoint}: its saved run config does not read as a recipe: {error}") from None
    if (change := context_lib.first_context_change(saved.phase_contexts, config.phase_contexts)) is not None:
        raise UserError(
            f"resuming {checkpoint} with other phase contexts: {change[1]} (saved run vs this recipe); a resume keeps "
            "each phase's seq_length, rotary_base, global batch and data (data_path, temperature): continue with "
            "others as a branch "
            "(checkpoint.branch_from + branch_step) or continued pretraining (checkpoint.load + finetune), "
            "docs/pretraining.md")


def _starting_state(config: RunConfig, engine: MegatronEngine, *,
                    tokenizer: EncoderTokenizer) -> tuple[StartingPoint, dict]:
    """The starting point loaded into ``engine`` (this run's newest checkpoint, a branch's parent, the
    weights continued from, or nothing), and the trainer state the run goes on from, its RNG states
    restored."""
    where = f"checkpoint.branch_from={config.checkpoint.branch_from!r}"
    starting_point = load_starting_point(
        engine, config.checkpoint, tokenizer=tokenizer, tokenizer_model=config.tokenizer.tokenizer_model,
        model_fields=json.loads(json.dumps(config.to_dict()["model"])),  # as saved: lists, not tuples
        branch_check=lambda parent, step: check_saved_parent(parent, config, step, where=where))
    state = starting_point.trainer_state
    if state and not starting_point.from_parent:
        _check_resume_keeps_context(starting_point.checkpoint, config)
    if starting_point.from_parent:
        state = {key: value for key, value in state.items() if key not in PARENT_ONLY}
    hardware.set_rng_state(state)
    return starting_point, state


def _recovery_for(config: RunConfig, state: dict, rank_nodes: Sequence[str]) -> RunRecovery:
    """The run's spike watch, rollbacks, timed saves and hang watchdog, continued from ``state``."""
    t = config.training
    recovery = RunRecovery(spikes=LossSpikeWatch(t.loss_spike_factor, t.loss_spike_window, state.get(LOSS_WINDOW)),
                         rollbacks=Rollbacks(t.spike_rollbacks, config.checkpoint.save,
                                             save_interval=config.checkpoint.save_interval,
                                             keep_steps=config.checkpoint.keep_steps, done=state.get(ROLLBACKS)),
                         timed_saves=TimedSaves(config.checkpoint.save_interval_minutes))
    if t.hang_timeout_minutes is not None:
        rank = dist.get_rank()
        recovery.watchdog = HangWatchdog(timeout_s=60 * t.hang_timeout_minutes, rank=rank,
                                         directory=heartbeat_dir(config.checkpoint.save, config.logging.log_dir),
                                         node=rank_nodes[rank] if rank < len(rank_nodes) else None)
    return recovery


def _announce(config: RunConfig, batches: Batches, starting_point: StartingPoint, *, sinks: MetricSinks,
              log: StepLogger, start: int, rank_nodes: Sequence[str]) -> None:
    """What the run reads and where it starts: the metrics header, the banner, the data plan, a branch."""
    header = {"blend": batches.blend}
    if batches.source_plan is not None:
        header["source_reads"] = [dataclasses.asdict(plan) for plan in batches.source_plan]
    sinks.header(header, start)
    log.banner(config.resolved_phases, rank_nodes)
    if not is_writer():
        return
    if batches.source_plan is not None:
        print(format_source_plan(batches.source_plan), flush=True)
    elif len(batches.blend) > 1:
        print(format_blend(batches.blend, train_samples=config.training.train_iters * config.data.global_batch_size),
              flush=True)
    if starting_point.branched_from:
        origin = starting_point.branched_from
        print(f"branched from {origin['save']} at step {origin['step']}"
              + ("" if starting_point.from_parent else f" (resumed from this run's {starting_point.checkpoint})"),
              flush=True)


def _train_engine(config: RunConfig, engine: MegatronEngine, *, tokenizer: EncoderTokenizer, device: torch.device,
                  exit_after_step: int | None, lock: SaveDirectoryLock | None,
                  dataset_provider: DatasetProvider, source_plan: tuple[SpanReads, ...] | None) -> TrainResult:
    """The run with its engine built: the starting point loaded, then the steps. ``source_plan``: the
    pre-flight's (``build_batches``)."""
    total = config.training.train_iters
    starting_point, state = _starting_state(config, engine, tokenizer=tokenizer)
    start = int(state.get("step", 0))
    first_checkpoint = str(starting_point.checkpoint) if starting_point.checkpoint else None
    if start > total:
        raise UserError(f"the checkpoint is at step {start}, beyond training.train_iters={total}")
    if start == total:
        if is_writer():
            print(f"nothing to do: {first_checkpoint} already completed all {total} steps", flush=True)
        return TrainResult(start_step=start, final_step=start, checkpoint=first_checkpoint,
                           skipped_steps=int(state.get("skipped_steps", 0)))

    _warn_of_kept_steps_missed(config, start)
    batches = build_batches(config, tokenizer, start=start, device=device, datasets=dataset_provider,
                            source_plan=source_plan)
    t = config.training
    rank_nodes = process_group.rank_nodes()  # a collective, once: the log names each rank's node
    stop = StopPolicy(handle_signals=t.exit_signal_handler, duration_minutes=t.exit_duration_in_mins,
                      interval=t.exit_interval, rank_nodes=tuple(rank_nodes))
    result = TrainResult(start_step=start, final_step=start, checkpoint=first_checkpoint)
    guard = NonFiniteGuard(t.max_nonfinite_steps, in_a_row=int(state.get("nonfinite_in_a_row", 0)),
                            total=int(state.get("skipped_steps", 0)))
    recovery = _recovery_for(config, state, rank_nodes)
    with contextlib.ExitStack() as stack:  # undone in reverse, whatever ends the run
        # Installed first, removed last: a stop signal during set-up ends the run after its first
        # step, and a second one during the closing saves is only recorded.
        stack.enter_context(stop.signals_handled())
        sinks = MetricSinks(config.logging, run_config=config.to_dict(), wandb_run_id=state.get("wandb_run_id"),
                            start_step=start)
        stack.callback(sinks.close)
        log = StepLogger(config, sinks, total_steps=total, start_step=start)
        _announce(config, batches, starting_point, sinks=sinks, log=log, start=start, rank_nodes=rank_nodes)
        checkpoints = RunCheckpoints(config, engine, tokenizer, lock=lock)
        # No writer process outlives the run: published then stopped, or killed after an error.
        stack.push(lambda error_type, error, traceback: checkpoints.close(abort=error_type is not None))
        engine.checkpoint_model.train()
        if recovery.watchdog is not None:
            recovery.watchdog.start(start)
            stack.callback(recovery.watchdog.stop)
        _train_steps(config, start=start, total=total, phases=config.resolved_phases, batches=batches,
                     engine=engine, vocabulary=Vocabulary(tokenizer, size=config.model.vocab_size), device=device,
                     log=log, guard=guard, recovery=recovery, checkpoints=checkpoints,
                     stop=stop, sinks=sinks, result=result, exit_after_step=exit_after_step,
                     branched_from=starting_point.branched_from)
        checkpoints.wait()  # the last checkpoint is complete when the run returns
        if result.stopped and config.checkpoint.save:
            # Said now, not at exit: a launcher may end this process once another rank has exited.
            write_exit_status(RESUMABLE_EXIT_CODE, result.stop_summary)
    result.skipped_steps = guard.total
    if result.stopped and is_writer():
        saved = (f"checkpoint {result.checkpoint} is complete; the same command resumes (exit code "
                 f"{RESUMABLE_EXIT_CODE})") if config.checkpoint.save else "NOTHING SAVED (checkpoint.save is not set)"
        print(f"stopped after step {result.final_step}/{total} ({result.stopped}); {saved}", flush=True)
    return result


def _train_steps(config: RunConfig, *, start: int, total: int, phases, batches: Batches, engine: MegatronEngine,
                 vocabulary: Vocabulary, device: torch.device, log: StepLogger, guard: NonFiniteGuard,
                 recovery: RunRecovery, checkpoints: RunCheckpoints, stop: StopPolicy, sinks: MetricSinks,
                 result: TrainResult,
                 exit_after_step: int | None, branched_from: dict | None) -> None:
    """Steps ``start`` to ``total`` (or to the step a stop asks for), with their validations and saves;
    after the last, the validation (whatever ``training.eval_interval``) and the test split's
    evaluation, as Megatron-LM ends a run."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    for step in range(start, total):
        done = step + 1
        phase = phase_at(phases, step)
        if step == phase.start or step == start:
            log.phase_begins(step, phase)
        context = context_lib.context_at(config.phase_contexts, step)
        lr = lr_at(step, config=config.schedule, total_steps=total, phases=phases)
        micro_batches = [_micro_batch(batch, step, phase, micro * dp_size + dp_rank, config=config,
                                      vocabulary=vocabulary, device=device, rotary_base=context.rotary_base)
                         for micro, batch in enumerate(batches.micro_batches(step, context))]
        outcome = engine.train_step(micro_batches, lr)
        checkpoints.poll()
        try:
            guard.update(done, outcome, phase)
            nonfinite = None
        except NonFiniteLossError as error:
            if not recovery.rollbacks.left:
                raise
            nonfinite = error  # rolled back below instead of ending the run
        result.final_step = done
        result.losses[done] = outcome.loss
        log.step(done, phase, outcome.loss, lr, outcome.grad_norm, outcome.skipped)
        rolled = recovery.after_step(done, outcome.loss, phase, nonfinite=nonfinite, guard=guard, engine=engine,
                                     checkpoints=checkpoints, log=log)
        if config.data.eval_iters and _due(done, config.training.eval_interval, total):
            valid_batches, valid_sources = batches.validation(phase, device)
            result.valid[done], by_source = validate(engine, valid_batches, config=config, vocabulary=vocabulary,
                                                     rotary_base=context.rotary_base, sources=valid_sources)
            if by_source:
                result.valid_by_source[done] = by_source
            log.validation(done, result.valid[done], by_source)
        if done == total and (test_batches := batches.test_batches(device)):
            result.test, by_source = validate(engine, test_batches, config=config, vocabulary=vocabulary,
                                              rotary_base=context.rotary_base, sources=batches.test_sources)
            log.test(done, result.test, by_source)
        # A collective, every rank, every step: stop or not, and a wall-clock save or not.
        agreed = stop.agree(done, device, timed_save_elapsed=recovery.timed_saves.elapsed())
        stopping = agreed.stop
        if stopping is None and exit_after_step is not None and done >= exit_after_step:
            stopping = f"exit_after_step={exit_after_step}"
        if done == total:
            stopping = None  # the run is complete, not stopped
        kept = done in config.checkpoint.keep_steps  # a step other runs start from
        if config.checkpoint.save and (_due(done, config.checkpoint.save_interval, total) or stopping or kept
                                       or rolled or agreed.timed_save):
            result.checkpoint = checkpoints.save(done, _trainer_state(
                done, config, guard.in_a_row, guard.total, sinks.wandb_run_id, branched_from,
                recovery), weights_step=rolled["to_step"] if rolled else done,
                protect=recovery.rollbacks.protected(done))
            recovery.timed_saves.saved()
        recovery.step_finished(done)
        if stopping:
            result.stopped = stopping
            return
