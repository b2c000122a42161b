"""The pre-flight: every check a run makes before its first step, in the order a run makes them, and
the one entry point (:func:`preflight`) that the trainer, ``--dry-run`` and the study planner call.

A check refuses in one line that names the key (``UserError``: exit code 2; a checkpoint directory
without room: ``storage.CheckpointStorageError``, exit code 74). Where a check's rule lives is
said below; a rule is stated once, and every caller reaches it through :func:`preflight`.

The checks, in order:

1. **config**: when a ``RunConfig`` is built (``training.config``: each section's ``__post_init__``
   for its own fields, ``DataConfig.__post_init__`` reading ``data.data_args_path``'s file of
   ``data_path`` entries, ``RunConfig.__post_init__`` for the rules across sections: phases, schedule,
   phase contexts, FP8 needs the ``te`` layers, what each objective selects at its length), the
   CUDA-graph rules of the config (``cuda_graphs.training_problem``, ``cuda_graphs.run_problem``).
   Every caller builds the config first, so every caller meets these.
2. **paths** (:func:`check_paths`): the save and log directories writable, every ``.bin``/``.idx``
   of every prefix the config names present (``RunConfig.data_paths``: ``data.data_path`` or
   Megatron's per-split paths, each ``phases[i].data_path`` and ``phases[i].valid_data_path``),
   ``checkpoint.load`` present.
3. **layout** (``training.layout.check_layout``): the world size divides by TP x PP, the model
   splits over TP and PP (``training.layout.model_parallel_problem``), every global batch (phases',
   ramp-up's) divides by micro-batch x DP. Without a world size (the study planner: its runs'
   processes are the launcher's) only the model's split. (Its own module: the memory estimate's
   micro-batch search keeps to the same rules.)
4. **machine** (:func:`check_machine`): what this machine cannot run: CUDA graphs without a GPU
   (``cuda_graphs.machine_problem``), FP8, recomputation and fp32 autocast without CUDA
   (``hardware.check_run_supported``), ``checkpoint.async_strategy: nvrx`` without NVRx
   (``checkpoint.config.check_nvrx_async_writer``).

   The trainer's process group starts here (its layout checked, its GPU not yet chosen); then, its
   save directory locked (``checkpoint.lock``), before the model is built:

5. **save space** (:func:`check_save_space`): the first checkpoint fits in ``checkpoint.save``
   (rank 0 judges for all; exit code 74), a warning when ``keep_last`` of them will not.
6. **memory** (``training.memory_fit.check_run_fits``: the estimate of every phase against this
   process's device; ``--dry-run``: ``training.memory_fit.memory_report``, the same estimate with its
   verdict, for a GPU kind or for this machine where it runs the plan).
7. **tokenizer** (:func:`check_tokenizer_serves`: the embedding holds its ids, each objective,
   validation's included, finds what it needs; ``data.provenance.check_data_tokenizer``: the data
   was made by this tokenizer, a notice when the data does not say).
8. **sources** (:func:`check_sources`): what a run would otherwise meet only when its steps reach
   it. In a run whose phases set their own data, the plan of what each data span reads from each
   source (:func:`plan_sources`, ``training.datasets.plan_source_reads``: a source with no whole
   sample at a phase's length, ``training.mixtures.check_enough_data``; a train split without
   tokens, ``training.datasets.train_split_tokens``), then the files (:func:`check_source_files`):
   each source's index (``training.datasets.check_source``: ``data.index_checks.read_index``,
   ``check_token_dtype``, ``scan_token_ids`` against the tokenizer), and each phase's own
   ``valid_data_path`` checked as its first evaluation would build it
   (``training.datasets.check_split_blends``: the same index checks, and the split's shares). The
   plan is kept (``Preflight.source_plan``) for what reads it: ``training.batches.build_batches``
   (its ``source_plan``), and ``--dry-run``, which prints and prices it, also beside a NOT READY
   line of the files.

Who runs which (:class:`Caller`)::

    check        study plan   dry run                        run
    1 config     raises       raises                         raises
    2 paths      -            NOT READY line (*)             raises
    3 layout     model split  raises                         raises
    4 machine    -            - (plans for other machines)   raises
    5 save space -            -                              raises (exit 74)
    6 memory     -            report, NOT READY line         raises
    7 tokenizer  -            NOT READY line (*) / raises    raises
    8 sources    -            NOT READY line (*)             raises

(*) what this machine lacks is ``NOT READY`` only where this machine runs the plan
(``hardware.runs_elsewhere``); a plan for the compute nodes, made on a login node, says it fails
here and to check where it starts. The trainer calls :func:`preflight` twice, at the two moments
above (``RUN_BEFORE_PROCESS_GROUP``: 2-4; ``RUN_BEFORE_MODEL``: 5-8). ``--dry-run`` checks the
sources' indexes where it has the tokenizer (check 7 built it), and plans them only where the paths
are present (check 2).

Checked later, before the first step, where what they check first exists: the starting checkpoint
(damage, the optimizer format, a resume that changes the data's attention or positions, a branch's
parent: ``checkpoint.resume.load_starting_point``, ``loop._check_resume_keeps_context``,
``training.branching.check_saved_parent``) once the model is built to load into; the indexes of
``data.data_path``'s prefixes (header, document index, token dtype and ids against the tokenizer, the
split's shares: ``training.datasets.build_datasets``, through ``check_split_blends``) as the run's
datasets are built from them, before the first step. Not checks: what this machine
lacks and the run turns off, announced once (``loop.runnable_here``: the ``te`` layers, the fused
kernels), after check 4.
"""

from __future__ import annotations

import enum
import functools
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_ext.config_loading import UserError
from megatron_ext.training.config import RunConfig
from megatron_ext.training.layout import check_layout

if TYPE_CHECKING:
    from collections.abc import Sequence

    from megatron_ext.tokenizer import EncoderTokenizer
    from megatron_ext.training.mixtures import SpanReads


class Caller(enum.Enum):
    """Who asks, which decides the checks and how a failure is said (module docstring)."""

    STUDY_PLAN = "study plan"
    """``study.plan``: each run of a study, before it is planned; no world size, no machine."""
    DRY_RUN = "dry run"
    """``pretrain_encoder.py --dry-run``: a plan for a world size, on this machine or another."""
    RUN_BEFORE_PROCESS_GROUP = "run, before its process group"
    """The trainer (``loop.pretrain``), before anything starts."""
    RUN_BEFORE_MODEL = "run, before its model"
    """The trainer, its process group up and its save directory locked."""


NOT_READY = "NOT READY, a run would stop here"
"""How ``--dry-run`` says what would stop a run on this machine (its paths, its tokenizer)."""


@dataclass(frozen=True, kw_only=True)
class Preflight:
    """What a pre-flight found; the checks it ran passed (a failure raised), but for what
    ``--dry-run`` says instead of refusing (``lines``)."""

    caller: Caller
    data_parallel: int | None = None
    """The data-parallel size (check 3), where the caller's checks include the world's."""
    tokenizer: EncoderTokenizer | None = None
    """The run's tokenizer, built by check 7 (None where it was not built)."""
    memory: str | None = None
    """``--dry-run``'s memory lines (check 6)."""
    source_plan: tuple[SpanReads, ...] | None = None
    """What each data span reads from each source (check 8), in a run whose phases set their own data;
    None: the run reads one blend, or (``--dry-run``) the sources could not be planned here (``lines``
    says why; a plan whose files then fail their checks is kept)."""
    lines: tuple[str, ...] = ()
    """``--dry-run``'s last lines: what the paths check found, then the tokenizer's, the sources'
    (checks 2, 7, 8)."""


def preflight(config: RunConfig, caller: Caller, *, world_size: int | None = None,
              tokenizer: EncoderTokenizer | None = None, gpu_kind: str | None = None) -> Preflight:
    """Run ``caller``'s checks of ``config`` at ``world_size`` processes, in the order of the module
    docstring, raising the first failure. ``tokenizer``: one already built (``--dry-run`` of a
    ``model.vocab_size: from_tokenizer`` recipe); ``gpu_kind``: the GPU ``--dry-run --gpu`` judges
    the memory for (None: this machine, where it runs the plan)."""
    if caller is not Caller.STUDY_PLAN and world_size is None:
        raise ValueError(f"the {caller.value} pre-flight needs a world size")
    if caller is Caller.STUDY_PLAN:
        return Preflight(caller=caller, data_parallel=check_layout(config, None))
    if caller is Caller.RUN_BEFORE_PROCESS_GROUP:
        check_paths(config)  # unwritable outputs and missing inputs, before anything starts
        data_parallel = check_layout(config, world_size)  # before the process group exists
        check_machine(config)
        return Preflight(caller=caller, data_parallel=data_parallel)
    if caller is Caller.RUN_BEFORE_MODEL:
        return _before_model(config, world_size)
    return _dry_run(config, world_size, tokenizer, gpu_kind)


def _before_model(config: RunConfig, world_size: int) -> Preflight:
    """Checks 5-8 of the trainer (the process group up: rank 0 judges the save space for all, and
    this process's GPU is chosen)."""
    from megatron_ext import hardware
    from megatron_ext.data.provenance import check_data_tokenizer
    from megatron_ext.tokenizer import build_tokenizer
    from megatron_ext.training.memory_fit import check_run_fits
    from megatron_ext.training.step_log import is_writer

    if config.checkpoint.save:
        check_save_space(config)
    usable, where = hardware.usable_memory_bytes()
    check_run_fits(config, world_size=world_size, usable_bytes=usable, where=where)
    tokenizer = build_tokenizer(config.tokenizer)
    check_tokenizer_serves(config, tokenizer)
    for field, prefixes in config.data_paths().items():  # the data's own tokenizer is this one
        unrecorded = check_data_tokenizer(prefixes, tokenizer, field=field)
        if unrecorded and is_writer():
            print(unrecorded, file=sys.stderr, flush=True)
    return Preflight(caller=Caller.RUN_BEFORE_MODEL, tokenizer=tokenizer, source_plan=check_sources(config, tokenizer))


def _dry_run(config: RunConfig, world_size: int, tokenizer: EncoderTokenizer | None,
             gpu_kind: str | None) -> Preflight:
    """``--dry-run``'s checks: the layout refuses; what this machine lacks or cannot read (paths, the
    tokenizer, the sources) is said, NOT READY where this machine runs the plan; what the tokenizer
    cannot serve refuses, as the run would refuse it."""
    from megatron_ext.data.provenance import check_data_tokenizer
    from megatron_ext.hardware import runs_elsewhere
    from megatron_ext.tokenizer import build_tokenizer, is_hub_id
    from megatron_ext.training.memory_fit import memory_report

    data_parallel = check_layout(config, world_size)
    # What this machine lacks stops a run here only; a plan it does not run (64 GPUs planned on a
    # login node) starts where the compute nodes' mounts are: said, not judged NOT READY.
    elsewhere = runs_elsewhere(world_size)
    missing = (NOT_READY if elsewhere is None
               else f"fails on this machine, which does not run this plan ({elsewhere}); check where it starts")
    tokenizer_line = None
    model = config.tokenizer.tokenizer_model
    if tokenizer is None and model is not None and not os.path.exists(model) and is_hub_id(model):
        # A download (minutes of retries without network) has no place in a dry run.
        tokenizer_line = (f"tokenizer: hub id {model!r} not loaded by --dry-run; the run checks it before "
                          "building the model")
    else:
        try:  # like the paths below, the tokenizer may be on a mount of the compute nodes only
            tokenizer = tokenizer or build_tokenizer(config.tokenizer)
        except UserError as err:
            tokenizer_line = f"tokenizer: {missing}: {err}"
        else:  # what the objectives need of it: refused now (before the plan), as the run would refuse it
            check_tokenizer_serves(config, tokenizer)
            notices = [notice for field, prefixes in config.data_paths().items()  # refuses another's data
                       if (notice := check_data_tokenizer(prefixes, tokenizer, field=field))]
            tokenizer_line = "; ".join(notices) or None
    memory = memory_report(config, world_size=world_size, gpu_kind=gpu_kind)
    source_plan, sources_line = None, None
    try:  # a plan made on a login node may name paths mounted only on the compute nodes
        paths_line = "checked: " + ", ".join(check_paths(config))
    except UserError as err:
        paths_line = f"paths: {missing}: {err}"
    else:  # the data present: what the run would refuse of it before its first step (said once, not twice)
        try:  # a plan made keeps its shares in the printout when a source's files fail their checks
            source_plan = plan_sources(config)
            if tokenizer is not None:
                check_source_files(config, tokenizer, source_plan)
        except (OSError, UserError) as err:
            sources_line = f"sources: {missing}: {err}"
    return Preflight(caller=Caller.DRY_RUN, data_parallel=data_parallel, tokenizer=tokenizer, memory=memory,
                     source_plan=source_plan, lines=tuple(line for line in (paths_line, tokenizer_line, sources_line)
                                                          if line))


# -- 2. paths ------------------------------------------------------------------------------------


def check_paths(config: RunConfig) -> list[str]:
    """Fail now, naming the field, on paths a run would trip over later: a save or log directory
    that cannot be written (found otherwise at the first save, a whole save interval in), missing
    ``.bin``/``.idx`` files of any prefix the config names (``RunConfig.data_paths``), a
    ``checkpoint.load`` that does not exist, or
    ``checkpoint.finetune`` without ``checkpoint.load``. Writes nothing that stays (a probe file is
    created and removed in the nearest existing directory). Returns what was checked."""
    from megatron_ext.data.index_checks import missing_prefix_problem

    checked = []
    cc = config.checkpoint
    if cc.finetune and not cc.load:
        raise UserError("checkpoint.finetune needs checkpoint.load (the checkpoint to start from)")
    if cc.load and not Path(cc.load).exists():
        raise UserError(f"checkpoint.load={cc.load!r} does not exist")
    for field_name, directory in (("checkpoint.save", cc.save), ("logging.log_dir", config.logging.log_dir)):
        if not directory:
            continue
        existing = Path(directory).absolute()
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise UserError(f"{field_name}={directory!r}: {existing} is a file, not a directory")
        try:
            with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-probe-"):
                pass
        except OSError as error:
            raise UserError(f"{field_name}={directory!r} cannot be written ({existing}: {error.strerror}); "
                            "choose a writable directory") from None
        checked.append(f"{field_name} writable")
    prefixes = set()
    for field, named in config.data_paths().items():
        for prefix in named:
            if (problem := missing_prefix_problem(prefix)) is not None:
                raise UserError(f"{field}: {problem}")
        prefixes.update(named)
    checked.append(f"{len(prefixes)} data prefix(es) present")
    return checked


# -- 4. machine ----------------------------------------------------------------------------------


def check_machine(config: RunConfig) -> None:
    """Refuse, naming the setting, what this machine cannot run (before any model is built)."""
    from megatron_ext import hardware
    from megatron_ext.checkpoint.config import check_nvrx_async_writer
    from megatron_ext.training import cuda_graphs

    if (problem := cuda_graphs.machine_problem(config)) is not None:
        raise UserError(problem)
    hardware.check_run_supported(fp8_recipe=config.training.fp8_recipe,
                                 recompute_granularity=config.training.recompute_granularity,
                                 bf16_autocast=config.training.bf16, params_dtype=config.model.params_dtype)
    if config.checkpoint.async_save and config.checkpoint.async_strategy == "nvrx":
        check_nvrx_async_writer()


# -- 5. save space -------------------------------------------------------------------------------


def checkpoint_bytes_estimate(config: RunConfig) -> int:
    """About the size of one checkpoint of ``config``: every parameter once in its dtype, and Adam's
    state (two fp32 moments, plus fp32 main parameters for lower-precision ones)."""
    from megatron_ext.performance.memory import stage_parameters

    params = stage_parameters(config.model, tensor_parallel=1, pipeline_parallel=1)
    param_bytes = config.model.torch_dtype.itemsize
    return params * (param_bytes + 8 + (4 if param_bytes < 4 else 0))


def check_save_space(config: RunConfig) -> None:
    """Refuse a run whose first save cannot fit in ``checkpoint.save`` (``CheckpointStorageError``,
    exit code 74, on every rank), warn when ``keep_last`` checkpoints will not (rank 0 judges, for
    all: ranks on one shared directory must not disagree)."""
    import torch.distributed as dist

    from megatron_ext.checkpoint import storage
    from megatron_ext.checkpoint.reader import intact_checkpoints
    from megatron_ext.training.step_log import is_writer

    verdict: list = [None]
    if dist.get_rank() == 0:
        save_dir = Path(config.checkpoint.save)
        kept = intact_checkpoints(save_dir)[-config.checkpoint.keep_last:]
        sizes = [storage.directory_bytes(path) for path in kept]
        check = storage.SpaceCheck(save_dir=save_dir, checkpoint_bytes=sizes[-1] if sizes else
                                   checkpoint_bytes_estimate(config), measured=bool(sizes),
                                   kept=config.checkpoint.keep_last, existing_bytes=sum(sizes))
        verdict[0] = check.problem()
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is None:
        return
    message, fatal = verdict[0]
    if fatal:
        raise storage.CheckpointStorageError(message)
    if is_writer():
        print(f"warning: {message}", file=sys.stderr, flush=True)


# -- 7. tokenizer --------------------------------------------------------------------------------


def check_tokenizer_serves(config: RunConfig, tokenizer: EncoderTokenizer) -> None:
    """Refuse, naming the tokenizer (and the objective), a tokenizer the run cannot train with: more
    ids than the model's embedding rows, or what an objective needs and it lacks (a mask token,
    word marks: ``Objective.check_tokenizer``), validation's objectives included. ``--dry-run`` and
    every run ask, before any model is built."""
    if tokenizer.vocab_size > config.model.vocab_size:
        raise UserError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids but model.vocab_size is "
            f"{config.model.vocab_size}; set model.vocab_size >= {tokenizer.vocab_size} (or from_tokenizer)"
        )
    if config.data.reset_attention_mask:
        from megatron_ext.training.datasets import document_end_id

        document_end_id(config.data, tokenizer)
    for phase in config.phases:
        phase.objective.check_tokenizer(tokenizer)
    if config.data.eval_iters:  # validation runs (at least after the last step)
        for objective in config.validation_objectives().values():
            try:
                objective.check_tokenizer(tokenizer)
            except UserError as err:
                raise type(err)(f"validation (data.eval_iters={config.data.eval_iters}) measures "
                                f"{objective.name}: {err}; or set data.eval_iters: 0") from None


# -- 8. sources ----------------------------------------------------------------------------------


def check_sources(config: RunConfig, tokenizer: EncoderTokenizer | None) -> tuple[SpanReads, ...] | None:
    """Refuse, naming the setting and the prefix, data a run would otherwise stop on only when its
    steps reach it: the plan of a run whose phases set their own data (:func:`plan_sources`), then,
    given the ``tokenizer``, its sources' files (:func:`check_source_files`). Returns the plan; None
    where the run reads one blend."""
    plan = plan_sources(config)
    if tokenizer is not None:  # None: --dry-run without the tokenizer (a hub id, or not on this machine)
        check_source_files(config, tokenizer, plan)
    return plan


def plan_sources(config: RunConfig) -> tuple[SpanReads, ...] | None:
    """In a run whose phases set their own data, what each data span reads from each source
    (``datasets.plan_source_reads``), refusing a source with no whole sample at a phase's length or
    whose train split holds no tokens; None where the run reads one blend."""
    from megatron_ext.training.context import dataset_spans, reads_sources
    from megatron_ext.training.datasets import plan_source_reads

    contexts = config.phase_contexts
    return plan_source_reads(config.data, dataset_spans(contexts)) if reads_sources(contexts) else None


def check_source_files(config: RunConfig, tokenizer: EncoderTokenizer, plan: Sequence[SpanReads] | None) -> None:
    """Each source of ``plan`` as its epochs will be built (``datasets.check_source``: its index,
    dtype and ids) and each phase's own ``valid_data_path`` as its first evaluation builds it
    (``datasets.check_split_blends``); the first failure raised, naming the setting."""
    from megatron_ext.training.datasets import check_source, check_split_blends, phase_validation_data

    named_by = {}  # each prefix by the first setting naming it
    for field, prefixes in config.data_paths().items():
        for prefix in prefixes:
            named_by.setdefault(prefix, field)
    checks = [(named_by.get(prefix, "data_path"), functools.partial(check_source, config.data, prefix, tokenizer))
              for prefix in dict.fromkeys(source.prefix for span in plan or () for source in span.sources)]
    checks += [(f"phases[{phase.index}].valid_data_path", functools.partial(
        check_split_blends, phase_validation_data(config.data, phase.valid_data_path), tokenizer))
        for phase in config.resolved_phases if phase.valid_data_path is not None]
    for field, check in checks:
        try:
            check()
        except UserError as err:
            raise type(err)(f"{field}: {err}") from None
