"""What the training steps read: the data-parallel rank's micro-batches of each step, from Megatron's
dataset of the step's phase length (``training.context``: one dataset per length, read from where
the steps before left off) or, in a run whose phases set their own data, the span's sources
(``training.mixtures``), the validation batches, kept on the device, and the test split, read once
at the end of training (Megatron's "end of training for test data")."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.phases import ResolvedPhase
from megatron_ext.tokenizer import EncoderTokenizer
from megatron_ext.training import context as context_lib
from megatron_ext.training.datasets import DatasetProvider, document_end_id as eod_of, phase_validation_data
from megatron_ext.training.samplers import build_phase_iterator, build_train_iterator, build_valid_iterator
from megatron_ext.training.config import DataConfig, RunConfig
from megatron_ext.training.mixtures import SpanReads, source_names

if TYPE_CHECKING:
    from torch.utils.data import Dataset  # a dataset provider's (training.datasets)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def with_document_ends(batch: dict[str, torch.Tensor], document_end_id: int | None) -> dict[str, torch.Tensor]:
    """``batch`` with where its documents end (``document_ends``, bool ``[b, s]``: the objectives'
    data contract, ``objectives.base``) when documents are isolated (``document_end_id``, the EOD id
    under ``data.reset_attention_mask``); as it is otherwise (None)."""
    if document_end_id is None:
        return batch
    return {**batch, "document_ends": batch["tokens"] == document_end_id}


@dataclass(kw_only=True)
class Batches:
    """What the steps read: the training iterator of the current data segment (``training.context``),
    positioned at the next step, the validation batches (the same fixed ones at every
    evaluation, kept on the device) and the test split (``test_batches``)."""

    config: RunConfig
    tokenizer: EncoderTokenizer
    datasets: DatasetProvider
    """What builds the datasets (``training.datasets``), again at each data segment's first step."""
    train: Iterator | None
    segment: context_lib.DatasetSpan | None
    valid: list[dict[str, torch.Tensor]]
    test: Dataset | None = None
    """The test split of ``data.split`` (the dataset provider's); None when the split gives it no
    share or ``data.eval_iters`` is 0."""
    blend: list[dict] = field(default_factory=list)
    """The dataset provider's ``blend_shares``: each dataset's weight and share of the run's samples."""
    rampup: object | None = None
    """Megatron-Core's step batch-size calculator of ``data.rampup_batch_size`` (None: no ramp-up)."""
    document_end_id: int | None = None
    """The EOD id at which documents are isolated (``data.reset_attention_mask``); None: not isolated."""
    valid_sources: tuple[str, ...] = ()
    """Names of the validation blend's datasets when it has several, in its order (a batch row's
    ``dataset_id`` indexes them): each validation then gives each one's losses."""
    test_sources: tuple[str, ...] = ()
    """The same for the test blend."""
    phase_valid: dict[int, tuple[list[dict[str, torch.Tensor]], tuple[str, ...]]] = field(default_factory=dict)
    """Per phase with its own ``valid_data_path``: its validation batches and their sources."""
    source_plan: tuple[SpanReads, ...] | None = None
    """What each data span reads from each source, in a run whose phases set their own data
    (``training.mixtures``); None: the run reads ``data.data_path`` as one blend."""

    def micro_batches(self, step: int, context: context_lib.PhaseContext) -> Iterator[dict]:
        """The data-parallel rank's micro-batches of ``step`` (whose phase is ``context``'s): from
        the iterator of its segment, built at the segment's first step or where a resume starts."""
        segment = context_lib.span_at(context_lib.dataset_spans(self.config.phase_contexts), step)
        if segment != self.segment:
            self.train = segment_iterator(self.config, self.tokenizer, segment, step, datasets=self.datasets,
                                          source_plan=self.source_plan)
            self.segment = segment
        dp_size = parallel_state.get_data_parallel_world_size()
        count = self.config.global_batch_size_at(step) // (context.micro_batch_size * dp_size)
        if self.rampup is not None:  # Megatron's calculator decides; the plan must agree with it
            self.rampup.update(self.config.consumed_samples(step), consistency_check=True)
            if self.rampup.get() != count:
                raise RuntimeError(f"step {step}: Megatron's batch-size calculator gives {self.rampup.get()} "
                                   f"micro-batches, the plan {count}")
        for _ in range(count):
            yield with_document_ends(next(self.train), self.document_end_id)

    def validation(self, phase: ResolvedPhase, device: torch.device) -> tuple[list[dict[str, torch.Tensor]], tuple[str, ...]]:
        """The validation batches at an evaluation in ``phase``, and the names of their sources (empty
        for one): the run's, or those of the phase's own ``valid_data_path`` (built at its first
        evaluation, the first ``data.eval_iters`` global batches of that blend's valid split)."""
        if phase.valid_data_path is None:
            return self.valid, self.valid_sources
        if phase.index not in self.phase_valid:
            d = self.config.data
            own = phase_validation_data(d, phase.valid_data_path)  # checked by the pre-flight (its sources step)
            _, valid_ds, _ = self.datasets.build_datasets(
                own, tokenizer=self.tokenizer, train_samples=1, valid_samples=d.eval_iters * d.global_batch_size,
                seed=self.config.training.seed)
            self.phase_valid[phase.index] = (
                _evaluation_batches(valid_ds, self.config, device, split="valid", document_end_id=self.document_end_id),
                _blend_sources(own, "valid"))
        return self.phase_valid[phase.index]

    def test_batches(self, device: torch.device) -> list[dict[str, torch.Tensor]]:
        """The test evaluation's batches (the first ``data.eval_iters`` global batches of the test
        split, as validation reads its split), on ``device``; empty without a test split. Read when
        asked rather than kept on the device like the validation batches: they are read once, after
        the last step."""
        if self.test is None:
            return []
        return _evaluation_batches(self.test, self.config, device, split="test", document_end_id=self.document_end_id)


def segment_iterator(config: RunConfig, tokenizer: EncoderTokenizer, segment: context_lib.DatasetSpan,
                     step: int, *, datasets: DatasetProvider,
                     source_plan: tuple[SpanReads, ...] | None = None) -> Iterator:
    """Micro-batches of ``segment`` from ``step`` on: the training dataset of the segment's length
    (``datasets``'), sized for every sample that length's segments read (``training.context``); in a
    run whose phases set their own data, the span's reads of ``source_plan`` (planned once, at start)."""
    data_cfg = segment.contexts[0].data_config(config.data)
    spans = context_lib.dataset_spans(config.phase_contexts)
    first = 0
    if segment.mixture is not None:  # its own sources, each continued where the run left it
        plan = source_plan[spans.index(segment)]
        train_ds = datasets.build_span_dataset(data_cfg, plan, tokenizer=tokenizer, seed=config.training.seed)
        first = segment.first_sample  # the span's dataset starts at its own first sample
    else:
        train_ds, _, _ = datasets.build_datasets(
            data_cfg, tokenizer=tokenizer, train_samples=context_lib.dataset_samples(spans, segment.seq_length),
            valid_samples=0, seed=config.training.seed)
    reads = [(c.micro_batch_size, c.global_batch_size, segment.sample_at(max(step, c.phase.start)) - first,
              segment.sample_at(c.phase.end) - first) for c in segment.contexts if c.phase.end > step]
    return build_phase_iterator(train_ds, reads=reads, config=data_cfg,
                                dp_rank=parallel_state.get_data_parallel_rank(),
                                dp_size=parallel_state.get_data_parallel_world_size())


def _evaluation_batches(dataset: Dataset | None, config: RunConfig, device: torch.device, *,
                        split: str, document_end_id: int | None) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of one evaluation of ``dataset`` (``split``), on ``device``."""
    return [to_device(with_document_ends(b, document_end_id), device) for b in build_valid_iterator(
        dataset, config=config.data, dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(), split=split)]


def build_batches(config: RunConfig, tokenizer: EncoderTokenizer, *, start: int, device: torch.device,
                  datasets: DatasetProvider, source_plan: tuple[SpanReads, ...] | None = None) -> Batches:
    """The run's data from step ``start`` on, from the splits ``datasets`` builds. Evaluation
    (validation, and the test split at the end when ``data.split`` gives it a share) reads ``data.eval_iters`` global batches of each split,
    whatever ``training.eval_interval`` (which sets only how often validation runs), as in
    Megatron-LM: ``data.eval_iters: 0`` evaluates nothing. ``source_plan``: in a run whose phases set
    their own data, the plan the pre-flight made and checked (``Preflight.source_plan``); None: planned
    here by ``datasets``."""
    data_cfg = config.data
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    document_end_id = eod_of(data_cfg, tokenizer) if data_cfg.reset_attention_mask else None
    eval_samples = data_cfg.eval_iters * data_cfg.global_batch_size  # per split evaluated; 0: no evaluation
    evaluated = dict(valid_samples=eval_samples, test_samples=eval_samples, seed=config.training.seed)
    valid_ds = test_ds = None
    contexts = config.phase_contexts
    if context_lib.reads_sources(contexts) or context_lib.varies(contexts):
        # Training data per segment, built as the steps reach it; validation at the run's
        # data.seq_length in every phase, so that its losses compare over the whole run.
        train, segment = None, None
        blend = datasets.blend_shares(data_cfg, None, train_samples=0)  # shares known per segment only
        if context_lib.reads_sources(contexts) and source_plan is None:
            source_plan = datasets.plan_source_reads(data_cfg, context_lib.dataset_spans(contexts))
        if eval_samples:
            segments = context_lib.dataset_spans(contexts)
            base = (context_lib.dataset_samples(segments, data_cfg.seq_length)
                    if source_plan is None and any(s.seq_length == data_cfg.seq_length for s in segments) else 1)
            _, valid_ds, test_ds = datasets.build_datasets(data_cfg, tokenizer=tokenizer, train_samples=base,
                                                           **evaluated)
    elif data_cfg.rampup_batch_size is not None:  # one dataset, read in global batches that grow
        from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

        end = config.consumed_samples(config.training.train_iters)
        train_ds, valid_ds, test_ds = datasets.build_datasets(data_cfg, tokenizer=tokenizer, train_samples=end,
                                                              **evaluated)
        chunk = data_cfg.micro_batch_size * dp_size  # every batch of the ramp is whole chunks (layout.check_layout)
        train = build_phase_iterator(
            train_ds, reads=[(data_cfg.micro_batch_size, chunk, config.consumed_samples(start), end)],
            config=data_cfg, dp_rank=dp_rank, dp_size=dp_size)
        segment = context_lib.dataset_spans(contexts)[0]
        blend = datasets.blend_shares(data_cfg, train_ds, train_samples=end)
        rampup = StepBatchsizeNumMicroBatchesCalculator(
            micro_batch_size=data_cfg.micro_batch_size, data_parallel_size=dp_size,
            decrease_batch_size_if_needed=False, rank=dist.get_rank(),
            schedule=context_lib.rampup_schedule_text(context_lib.rampup_schedule(data_cfg)))
    else:  # one dataset and sampler for the whole run
        train_samples = config.training.train_iters * data_cfg.global_batch_size
        train_ds, valid_ds, test_ds = datasets.build_datasets(
            data_cfg, tokenizer=tokenizer, train_samples=train_samples, **evaluated)
        blend = datasets.blend_shares(data_cfg, train_ds, train_samples=train_samples)
        train = build_train_iterator(
            train_ds, config=data_cfg, dp_rank=dp_rank, dp_size=dp_size,
            consumed_samples=start * data_cfg.global_batch_size,
        )
        segment = context_lib.dataset_spans(contexts)[0]
    valid = (_evaluation_batches(valid_ds, config, device, split="valid", document_end_id=document_end_id)
             if eval_samples else [])
    return Batches(config=config, tokenizer=tokenizer, datasets=datasets, train=train, segment=segment,
                   valid=valid, test=test_ds if eval_samples else None, blend=blend,
                   rampup=rampup if data_cfg.rampup_batch_size is not None else None,
                   document_end_id=document_end_id, source_plan=source_plan,
                   valid_sources=_blend_sources(data_cfg, "valid"), test_sources=_blend_sources(data_cfg, "test"))


def _blend_sources(data: DataConfig, split: str) -> tuple[str, ...]:
    """Names of ``split``'s datasets when its blend has several (``source_names``), else none."""
    blend = data.split_blend(split)
    return source_names(blend[0]) if blend is not None and len(blend[0]) > 1 else ()
