"""The run configuration: one dataclass per concern, read from a YAML recipe plus overrides.

A recipe (see ``examples/recipes/``)::

    base: ../sizes/610m.yaml          # optional: deep-merged underneath this file
    model: {preset: 610m}             # a preset plus any EncoderModelConfig field
    tokenizer: {tokenizer_model: meta-llama/Meta-Llama-3-8B}
    data: {data_path: [1.0, /data/fineweb_edu_text_document], seq_length: 2048, ...}
    optimizer: {...}
    schedule: {lr: 5.0e-4, lr_decay_style: wsd, lr_warmup_iters: 2000, lr_wsd_decay_iters: 2000}
    phases:
      - {objective: clm, share: 0.25}
      - {objective: mlm, mask_ratio: 0.4, share: 0.75}   # or objective: {name: mlm, mask_ratio: 0.4}
    training: {train_iters: 42000}
    parallel: {tensor_model_parallel_size: 1}
    checkpoint: {save: /ckpt/run, save_interval: 1000}
    logging: {wandb_project: encoders}

Command-line flags mirror Megatron-LM's names (``--micro-batch-size``, ``--lr``, ``--save`` ...);
``pretrain_encoder.py --help`` lists them all with their docs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from megatron_ext.config_loading import ConfigError, UserError
from megatron_ext.objectives import Objective, validation_objectives
from megatron_ext.model.config import EncoderModelConfig
from megatron_ext.phases import Phase, ResolvedPhase, resolve_phases
from megatron_ext.schedule import LRScheduleConfig, lr_at
from megatron_ext.tokenizer import TokenizerConfig
from megatron_ext.checkpoint.config import CheckpointConfig
from megatron_ext.data.blend_file import read_blend
from megatron_ext.training.mixtures import parse_blend


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Which data to read and how to batch it; names follow Megatron-LM's flags."""

    data_path: tuple[str, ...] = ()
    """``--data-path``: dataset prefixes (``{prefix}.bin``/``.idx``), or alternating
    ``weight prefix weight prefix ...`` to blend them in those proportions. Several prefixes without
    weights blend in proportion to their sizes, one pass over each (Megatron never repeats them).
    Give it, or ``train_data_path`` (one of the two)."""
    data_args_path: str | None = None
    """``--data-args-path``: a file holding ``data_path``'s entries, whitespace-separated, read instead
    of ``data_path`` (Megatron's meaning: a blend too long for a command line), e.g. the
    ``.blend`` file ``tools/preprocess_data.py --shard-size`` writes (``tokens prefix`` per shard)."""
    train_data_path: tuple[str, ...] = ()
    """``--train-data-path``: the training blend alone, in ``data_path``'s forms, each prefix read
    whole for training (Megatron's ``blend_per_split``: no ``split``); with ``valid_data_path`` and
    ``test_data_path`` instead of ``data_path``."""
    valid_data_path: tuple[str, ...] = ()
    """``--valid-data-path``: the validation blend, read whole (with ``train_data_path``); needed
    when ``eval_iters`` asks for validation."""
    test_data_path: tuple[str, ...] = ()
    """``--test-data-path``: the test blend, read whole once after the last step (with
    ``train_data_path``); none: no test evaluation."""
    split: str | None = None
    """``--split``: comma-separated train,valid,test proportions of each prefix's sequences of
    ``data_path``; None: ``DEFAULT_SPLIT``. Refused with the per-split paths, which are read whole
    (Megatron's ``blend_per_split``)."""
    seq_length: int
    """``--seq-length``: tokens per sample."""
    micro_batch_size: int
    """``--micro-batch-size``: samples per forward/backward pass on one data-parallel rank."""
    global_batch_size: int
    """``--global-batch-size``: samples per optimizer step, over all data-parallel ranks."""
    rampup_batch_size: tuple[int, ...] | None = None
    """``--rampup-batch-size``: ``[start, increment, samples]``, Megatron-LM's batch-size ramp-up:
    the global batch starts at ``start`` and grows by ``increment`` in equal steps over the first
    ``samples`` samples to ``global_batch_size``, then stays there. Run through Megatron-Core's
    step batch-size calculator (``training.context.rampup_schedule``); every size must divide by
    ``micro_batch_size`` x the data-parallel size. None: no ramp-up."""
    num_workers: int = 0
    """``--num-workers``: DataLoader worker processes (0: load in the training process)."""
    data_cache_path: str | None = None
    """``--data-cache-path``: where Megatron caches its index arrays. None: ``cache/<fingerprint>``
    in the directory of the first prefix, the fingerprint changing whenever the data files do."""
    eval_iters: int = 100
    """``--eval-iters``: global batches per evaluation: each validation, and the test split's once
    after the last step when ``split`` gives it a share (Megatron-LM's end-of-training test). 0: no
    validation and no test, the one switch that turns evaluation off, as in Megatron-LM."""
    reset_position_ids: bool = False
    """``--reset-position-ids``: restart the RoPE positions after each EOD token, so each document
    of a packed row starts at position 0 (GPTDataset's ``position_ids``)."""
    reset_attention_mask: bool = False
    """``--reset-attention-mask``: documents of a packed row attend only within themselves (each
    ends at and includes the tokenizer's EOD; a row's edge also ends one), in every objective and
    in validation: Transformer Engine's packed-sequence (THD) kernels on ``cu_seqlens``, a
    per-document attention on the local spec, never an ``[s, s]`` mask. The objectives then never
    predict across a document end (CLM scores no EOD input; MNTP selects no document's first
    token). Off (the paper's setting): attention spans the documents of a row."""
    eod_mask_loss: bool = False
    """``--eod-mask-loss``: give no loss to positions whose input token is EOD."""
    max_tokens_to_scan: int = 100_000_000
    """Datasets with at most this many tokens are scanned whole at start-up for ids outside the
    tokenizer vocab (fast with numpy); larger ones rely on the per-batch check. 0: never scan."""

    def __post_init__(self) -> None:
        for name in ("data_path", *PER_SPLIT_PATHS):
            value = getattr(self, name)
            if isinstance(value, str):
                raise UserError(f"{name}: expected a list of prefixes, got the string {value!r}")
            object.__setattr__(self, name, tuple(value))
            if value:
                parse_blend(value, where=name)
        if self.data_args_path is not None:
            if self.data_path:
                raise UserError(f"data.data_args_path={self.data_args_path!r} is read instead of data_path: give one")
            where = f"data.data_args_path={self.data_args_path!r}"
            entries = read_blend(self.data_args_path, where=where)
            parse_blend(entries, where=where)
            object.__setattr__(self, "_args_entries", entries)
        one_blend = bool(self.data_path) or self.data_args_path is not None
        if one_blend == bool(self.train_data_path):
            raise UserError("data: give data_path (one blend cut by split into train, valid and test; or "
                            "data_args_path, a file of it) or train_data_path (with valid_data_path, "
                            f"test_data_path: a blend per split), not {'both' if one_blend else 'neither'}")
        if one_blend:
            if self.split is None:
                object.__setattr__(self, "split", DEFAULT_SPLIT)
            if self.valid_data_path or self.test_data_path:
                raise UserError("data.valid_data_path / test_data_path come with train_data_path, not data_path "
                                "(whose split cuts the valid and test splits), as in Megatron")
            proportions = split_proportions(self.split)
            if self.eval_iters and (len(proportions) < 2 or proportions[1] == 0):
                # Megatron-LM skips validation without a word here; eval_iters would then do nothing.
                raise UserError(f"split {self.split!r} gives the valid split no share, but data.eval_iters="
                                f"{self.eval_iters} asks for validation; give it a share (e.g. 98,2,0) or set "
                                "data.eval_iters: 0 (no validation)")
        else:
            if self.split is not None:
                raise UserError(f"data.split {self.split!r} with train_data_path: each per-split blend is read "
                                "whole (Megatron's blend_per_split); drop split (split: null under a base that "
                                "sets one), or give data_path instead")
            if self.eval_iters and not self.valid_data_path:
                raise UserError(f"data.eval_iters={self.eval_iters} asks for validation but there is no "
                                "valid_data_path beside train_data_path; give one or set data.eval_iters: 0")
        for name in ("seq_length", "micro_batch_size", "global_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.rampup_batch_size is not None:
            ramp = self.rampup_batch_size
            if len(ramp) != 3 or ramp[0] < 1 or ramp[1] < 1 or ramp[2] < 0:
                raise UserError(f"rampup_batch_size: expected [start >= 1, increment >= 1, samples >= 0], got {list(ramp)}")
            if ramp[0] >= self.global_batch_size or (self.global_batch_size - ramp[0]) % ramp[1]:
                raise UserError(f"rampup_batch_size {list(ramp)}: global_batch_size {self.global_batch_size} must be "
                                f"start + a whole number (>= 1) of increments, as in Megatron")
        for name in ("num_workers", "eval_iters", "max_tokens_to_scan"):
            if getattr(self, name) < 0:
                raise UserError(f"{name}: expected >= 0, got {getattr(self, name)}")

    @property
    def blend(self) -> tuple[list[str], list[float] | None]:
        """The training blend (``data_path``, or ``train_data_path``) as Megatron's ``(prefixes,
        weights or None)``, the pair its ``datasets.utils.get_blend_from_list`` returns (tested
        equal): ``weight prefix`` pairs when every other entry from the first is a number, prefixes
        alone otherwise. Parsed here so that reading a recipe (and ``--dry-run``) imports no Megatron."""
        return parse_blend(self.training_entries, where="data_path")

    @property
    def training_entries(self) -> tuple[str, ...]:
        """The training blend's entries: ``data_path``, the file of ``data_args_path``, or
        ``train_data_path``."""
        if self.data_args_path is not None:
            return self._args_entries
        return self.data_path or self.train_data_path

    @property
    def per_split(self) -> bool:
        """Whether each split has its own blend (``train_data_path``...), read whole."""
        return bool(self.train_data_path)

    def split_blend(self, split: str) -> tuple[list[str], list[float] | None] | None:
        """The blend that ``split`` (``train``, ``valid``, ``test``) reads: ``data_path``'s, or its
        own per-split path's (None: none given)."""
        if not self.per_split:
            return self.blend
        paths = getattr(self, f"{split}_data_path")
        return parse_blend(paths, where=f"{split}_data_path") if paths else None

    def split_cut(self, split: str) -> str:
        """The ``split`` string that cuts ``split``'s share out of each of its prefixes: ``data.split``,
        or with per-split paths the whole prefix (Megatron's ``blend_per_split`` reads it whole)."""
        if not self.per_split:
            return self.split
        return ",".join("100" if name == split else "0" for name in ("train", "valid", "test"))


DEFAULT_SPLIT = "98,2,0"
"""``data.split`` when unset with ``data_path``: 2 % validation, no test share unless asked
(Megatron-LM uses ``969, 30, 1`` when ``--split`` is missing)."""

PER_SPLIT_PATHS = ("train_data_path", "valid_data_path", "test_data_path")
"""Megatron's ``--train-data-path``/``--valid-data-path``/``--test-data-path``: a blend per split."""


def split_proportions(split: str) -> list[float]:
    """``data.split`` as its train, valid, test proportions (``UserError`` naming it otherwise)."""
    try:
        parts = [float(p) for p in split.split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(p < 0 or not math.isfinite(p) for p in parts) or parts[0] <= 0:
        raise UserError(
            f"split: expected 'train,valid,test' proportions such as '98,2,0' (train > 0), got {split!r}"
        )
    return parts


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW, as in the paper (decoupled weight decay)."""

    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2 (the paper: 0.95)."""
    adam_eps: float = 1e-5
    """AdamW epsilon (the paper: 1e-5)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (on matrices only unless ``decay_norms_and_biases``)."""
    decay_norms_and_biases: bool = False
    """False (Megatron's rule): no weight decay on 1-D parameters (norm weights, biases). True:
    every parameter decays, as the authors' trainer does (Optimus builds AdamW over
    ``model.parameters()`` with one weight decay: EuroBERT repo, ``optimus/trainer/pretrain.py``);
    the paper recipes set it. Either way the parameter groups are the same, so a run may resume
    with the other setting."""
    clip_grad: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""
    fused: bool = True
    """Torch's fused AdamW kernel where Megatron-Core runs torch's AdamW (without Transformer
    Engine or apex, whose own FusedAdam is used when present)."""

    def __post_init__(self) -> None:
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise UserError(f"optimizer.adam_eps must be > 0, got {self.adam_eps}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            raise UserError("optimizer.weight_decay and optimizer.clip_grad must be >= 0")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Length of the run, seeds, precision and evaluation cadence."""

    train_iters: int
    """Optimizer steps of the whole run (all phases)."""
    seed: int = 1234
    """Seed of parameter initialisation, data order and MLM masking."""
    bf16: bool = False
    """Train in bfloat16 autocast over the parameters of ``model.params_dtype`` (GPU; on CPU only with
    ``model.params_dtype: bfloat16``: Megatron's linear backward is autocast-aware on CUDA only).
    Megatron-LM's ``--bf16`` also stores the parameters in bf16 with fp32 main parameters in the
    optimizer: that is ``--bf16 --params-dtype bfloat16`` here (the dry run says which)."""
    eval_interval: int = 1000
    """Steps between validation passes (both objectives); 0: none during training, only the one
    after the last step, which runs whatever this is (Megatron-LM's ``--eval-interval`` sets the
    cadence only; ``data.eval_iters: 0`` turns validation off)."""
    eval_mask_ratio: float = 0.4
    """Masking ratio of the MLM validation loss, fixed so that runs are comparable."""
    log_interval: int = 10
    """Steps between step log lines."""
    max_nonfinite_steps: int = 5
    """A step whose loss is NaN/inf is skipped and counted; stop after this many in a row (or roll
    back: ``spike_rollbacks``)."""
    hang_timeout_minutes: float | None = None
    """A rank that finishes no step for this long ends the job, in one line naming the rank behind,
    its node and its step, with the resumable exit code 75 that the launchers restart on
    (``training.watchdog``): longer than a step with its validation and save, shorter than
    ``parallel.distributed_timeout_minutes``. None: a hung rank ends the job only when the
    distributed timeout does."""
    loss_spike_factor: float | None = None
    """A step whose loss exceeds this many times the mean of the previous ``loss_spike_window``
    steps of its phase is a loss spike: said in one line and recorded in ``metrics.jsonl``
    (``spike``), and rolled back with ``spike_rollbacks``. None: losses are not watched."""
    loss_spike_window: int = 20
    """Steps of the running mean a loss is compared with (``loss_spike_factor``); a phase's first
    steps are not judged until it holds this many."""
    spike_rollbacks: int = 0
    """How many times the run may roll back (each said in one line, recorded as a ``rollback`` in
    ``metrics.jsonl`` and in the trainer state): on a loss spike, or where the non-finite stop
    (``max_nonfinite_steps`` in a row) would end the run, the model and optimizer are reloaded from
    the newest checkpoint before the bad steps and training goes on after them: the batches read
    since that checkpoint are never trained again (OLMo's and PaLM's restart-and-skip). The state
    is saved at once, so a restart continues after the skipped batches. 0: spikes are only said."""
    fp8_format: Literal["hybrid", "e4m3"] | None = None
    """FP8 matmuls through Transformer Engine (Hopper or newer, ``transformer_impl: te``,
    ``bf16: true``), in these formats: ``hybrid`` = E4M3 forward, E5M2 gradients; ``e4m3`` both.
    As Megatron-LM's ``--fp8-format``, setting it is what turns FP8 on; None trains without FP8."""
    fp8_recipe: Literal["delayed", "tensorwise"] | None = None
    """How FP8 scales (Megatron-LM ``--fp8-recipe``): ``delayed`` scaling (amax history) or
    ``tensorwise`` current scaling. Only with ``fp8_format`` (refused alone: in Megatron-LM it
    does nothing without ``--fp8-format``); unset with ``fp8_format`` set, ``delayed``, Megatron-LM's
    default, so that a run config's ``fp8_recipe`` says whether FP8 is on."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recomputation (Megatron ``--recompute-granularity``): ``selective``
    recomputes the core attention, ``full`` whole layers (see ``recompute_num_layers``)."""
    recompute_num_layers: int = 1
    """With ``full`` recomputation: layers per recomputed chunk (Megatron's uniform method)."""
    bias_activation_fusion: bool = False
    """Megatron's fused SwiGLU (``bias_swiglu_impl``, compiled by ``torch.compile``): one kernel
    for the gate's SiLU and product forward and backward, and half the saved activations of the
    gate/up projection. Megatron-LM fuses it by default (``--no-bias-swiglu-fusion`` turns it
    off there); here it is off unless asked: ``torch.compile`` costs start-up time on CPU."""
    cross_entropy_loss_fusion: bool = False
    """Megatron's native fused vocabulary-parallel cross entropy (``torch.compile``d): the
    softmax statistics and the gradient in fewer passes over the ``[tokens, vocab]`` logits.
    Megatron-LM ``--cross-entropy-loss-fusion`` (which kernel: ``cross_entropy_fusion_impl``)."""
    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    """Which fused cross entropy ``cross_entropy_loss_fusion`` runs (Megatron-LM
    ``--cross-entropy-fusion-impl``): ``native`` is Megatron's own (``torch.compile``d, any
    device); ``te`` is Transformer Engine's Triton kernel (``parallel_cross_entropy``), which keeps
    only per-row softmax statistics between forward and backward instead of an fp32 copy of the
    ``[tokens, vocab]`` logits. Needs Transformer Engine >= 2.20 (its fixes of the gradient's
    precision and of the memory that fix added; docs/performance.md) and a GPU; where
    TE or the GPU is missing the run takes ``native``, announced once. Only with
    ``cross_entropy_loss_fusion: true`` (refused otherwise)."""
    rope_fusion: bool = False
    """Apply RoPE to queries and keys with Transformer Engine's fused kernel
    (``TransformerConfig.apply_rope_fusion``; on by default in Megatron-LM, whose ``--no-rope-fusion``
    is this flag's ``--no-rope-fusion`` too) instead of
    Megatron's unfused ``cat``/``mul`` chain. Needs a GPU and Transformer Engine (either spec); off,
    announced once, where they are missing. TE's kernel takes one position table for the whole
    batch, so it needs ``data.reset_position_ids: false``."""
    gradient_accumulation_fusion: bool = False
    """Transformer Engine's linear layers write their weight gradients straight into Megatron
    DDP's fp32 ``main_grad`` buffers inside the wgrad GEMM (``TransformerConfig.
    gradient_accumulation_fusion``; on by default in Megatron-LM, whose ``--no-gradient-accumulation-fusion``
    is this flag's too) instead of
    adding a separate gradient to them. Megatron's own linear layers (the LM head, the local spec)
    fuse only with apex's ``fused_weight_gradient_mlp_cuda``: without apex the LM head keeps the
    unfused path and the local spec turns the setting off, announced once (also on CPU)."""
    deterministic: bool = False
    """Bit-identical steps from the same inputs, so that a resumed run repeats an uninterrupted one
    exactly on GPU too (CPU runs are deterministic without it): torch's deterministic algorithms and
    cuDNN settings, cuBLAS, Transformer Engine attention and NCCL in deterministic modes
    (``hardware.make_deterministic``), Megatron's ``deterministic_mode``. Slower; without it a GPU
    run's losses differ from another's in the last bits (docs/design.md). Megatron-LM
    ``--deterministic-mode``."""
    lm_head_scored_only: bool = True
    """Run the LM head and the cross entropy only at the positions the loss scores (MLM: the
    masked ones) instead of at every position: same loss and gradients, and on MLM steps
    ``1 - mask_ratio`` of the head's FLOPs and logits memory saved (the head is ~20 % of a
    step's FLOPs at 610M with the 128k vocabulary). ``false``: GPTModel's full head."""
    cuda_graphs: Literal["none", "megatron", "transformer_engine"] = "none"
    """CUDA graphs of the transformer layers (Megatron ``--cuda-graph-impl``; GPU only): each
    layer's forward and backward replayed as one graph, which removes the per-module CPU launch
    cost that leaves the GPU idle when the host is slower than the kernels. Named after who
    captures them. ``megatron`` is Megatron-Core's own ``CudaGraphManager`` (Megatron's value
    ``local``): graphs are captured once, during the run's first
    step, for every attention pattern the run's phases use (CLM causal, MLM bidirectional: one
    graph per layer and pattern, sharing one memory pool), and replayed by pattern after that;
    validation runs eagerly. ``transformer_engine`` (TE's ``make_graphed_callables``) is refused:
    it captures each layer with Megatron's sample arguments (a dense causal mask) and cannot keep
    the per-call attention pattern. Needs a fixed shape (no ``data.reset_attention_mask``), no
    activation recomputation and no pipeline parallelism (``megatron_ext.training.cuda_graphs``)."""

    exit_signal_handler: bool = True
    """SIGTERM and SIGUSR1 (what SLURM sends at a time limit, on preemption and on ``scancel``, and
    ``sbatch --signal`` ahead of the limit) finish the step in flight, save it and exit with code
    75 (``training.stop``). Megatron-LM ``--exit-signal-handler``; off: the signals kill at once."""
    exit_duration_in_mins: float | None = None
    """Stop, save and exit with code 75 once this many minutes have passed since the process
    started (set it below the job's time limit by more than a step and a save). Megatron-LM
    ``--exit-duration-in-mins``."""
    exit_interval: int | None = None
    """Stop, save and exit with code 75 after every step that is a multiple of this. Megatron-LM
    ``--exit-interval``."""

    def __post_init__(self) -> None:
        if self.train_iters < 1:
            raise UserError(f"training.train_iters must be >= 1, got {self.train_iters}")
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise UserError(f"training.exit_duration_in_mins must be > 0, got {self.exit_duration_in_mins}")
        if self.exit_interval is not None and self.exit_interval < 1:
            raise UserError(f"training.exit_interval must be >= 1, got {self.exit_interval}")
        if self.hang_timeout_minutes is not None and not self.hang_timeout_minutes > 0:
            raise UserError(f"training.hang_timeout_minutes must be > 0, got {self.hang_timeout_minutes}")
        if self.loss_spike_factor is not None and not self.loss_spike_factor > 1:
            raise UserError(f"training.loss_spike_factor must be > 1 (a multiple of the running mean loss), "
                            f"got {self.loss_spike_factor}")
        if self.loss_spike_window < 2:
            raise UserError(f"training.loss_spike_window must be >= 2, got {self.loss_spike_window}")
        for name in ("eval_interval", "log_interval", "max_nonfinite_steps", "spike_rollbacks"):
            if getattr(self, name) < 0:
                raise UserError(f"training.{name} must be >= 0, got {getattr(self, name)}")
        try:  # the MLM objective checks its ratio
            validation_objectives(self.eval_mask_ratio)
        except UserError as err:
            raise UserError(f"training.eval_mask_ratio: {err}") from None
        if self.fp8_recipe is not None and self.fp8_format is None:
            raise UserError(f"training.fp8_recipe={self.fp8_recipe!r} chooses how FP8 scales, but FP8 is off: "
                            "training.fp8_format (Megatron-LM's --fp8-format) turns it on; add fp8_format: hybrid")
        if self.fp8_format is not None and self.fp8_recipe is None:
            object.__setattr__(self, "fp8_recipe", "delayed")  # Megatron-LM's default recipe
        if self.fp8_recipe is not None and not self.bf16:
            raise UserError(f"training.fp8_format={self.fp8_format!r} (FP8) needs training.bf16: true "
                            "(FP8 matmuls run inside a bf16 mixed-precision step)")
        if self.recompute_num_layers < 1:
            raise UserError(f"training.recompute_num_layers must be >= 1, got {self.recompute_num_layers}")
        if self.cross_entropy_fusion_impl != "native" and not self.cross_entropy_loss_fusion:
            raise UserError(f"training.cross_entropy_fusion_impl: {self.cross_entropy_fusion_impl} chooses the kernel of "
                            "training.cross_entropy_loss_fusion, which is off: set cross_entropy_loss_fusion: true "
                            "or remove cross_entropy_fusion_impl")
        if self.deterministic and self.cross_entropy_loss_fusion:
            # Megatron-LM refuses the pair too ("Cross Entropy Fusion is currently not deterministic").
            raise UserError("training.deterministic: true cannot run with training.cross_entropy_loss_fusion: true "
                            "(the fused cross entropy is not deterministic); remove one of them")
        from megatron_ext.training.cuda_graphs import training_problem

        if (problem := training_problem(self)) is not None:
            raise UserError(problem)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Model parallelism; data parallelism takes the remaining ranks."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (Megatron-Core column/row-parallel linears)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (Megatron's 1F1B schedule)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer states and fp32 gradients over data parallelism (Megatron's distributed
    optimizer)."""
    overlap_grad_reduce: bool = False
    """Reduce gradient buckets during the backward pass."""
    overlap_param_gather: bool = False
    """All-gather updated parameters during the next forward pass (needs
    ``use_distributed_optimizer``)."""
    distributed_timeout_minutes: int = 10
    """Minutes a collective may wait for a peer before the process group fails (Megatron's
    ``--distributed-timeout-minutes``, same default): a hung or vanished rank ends the run after
    this long instead of holding every node. Longer than the longest blocking step: a synchronous
    checkpoint save or a validation on the slowest rank."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "distributed_timeout_minutes"):
            if getattr(self, name) < 1:
                raise UserError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise UserError("parallel.overlap_param_gather needs parallel.use_distributed_optimizer: true")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Where metrics go."""

    log_dir: str = "runs/encoder"
    """Directory of ``metrics.jsonl`` (every logged step and validation) and W&B files."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """Weights & Biases mode: offline by default (sync later with ``wandb sync``)."""
    wandb_project: str = "megatron_ext"
    """W&B project."""
    wandb_exp_name: str | None = None
    """W&B run name (default: the log_dir's name)."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a run needs, resolved and validated."""

    model: EncoderModelConfig
    tokenizer: TokenizerConfig
    data: DataConfig
    optimizer: OptimizerConfig
    schedule: LRScheduleConfig
    phases: tuple[Phase, ...]
    training: TrainingConfig
    parallel: ParallelConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig

    def __post_init__(self) -> None:
        self._check_across_sections()
        contexts = self._resolve_phases()
        self._check_phase_contexts(contexts)
        from megatron_ext.training.context import step_global_batches

        object.__setattr__(self, "_step_batches", step_global_batches(self.data, self.training.train_iters)
                           if self.data.rampup_batch_size is not None else None)

    def _check_across_sections(self) -> None:
        """The rules that read two sections (each section checked itself when built)."""
        if self.data.seq_length > self.model.seq_length:
            raise ConfigError(
                f"data.seq_length={self.data.seq_length} exceeds model.seq_length={self.model.seq_length}"
            )
        if self.model.params_dtype == "float16":
            raise ConfigError("model.params_dtype: float16 needs loss scaling, which this trainer does not do; "
                              "use bfloat16 (fp32 main parameters in Megatron's optimizer) or float32")
        if self.training.rope_fusion and self.data.reset_position_ids:
            raise ConfigError("training.rope_fusion needs data.reset_position_ids: false (Transformer Engine's fused "
                              "RoPE takes one position table for the whole batch, not positions per sequence)")
        if self.training.fp8_recipe is not None and not self.model.transformer_impl.uses_transformer_engine:
            # Refused rather than switched: a run that asks for the local spec (a flag, a recipe, or the
            # measured bf16 default of benchmarks/results/recipe_defaults.md when it is the local spec)
            # would otherwise run FP8 on the other layer implementation without saying so.
            raise ConfigError(f"training.fp8_format={self.training.fp8_format!r} (FP8) needs model.transformer_impl: te "
                              f"(FP8 matmuls are Transformer Engine layers), got "
                              f"{self.model.transformer_impl!r}: add --transformer-impl te")
        checkpoint, total = self.checkpoint, self.training.train_iters
        hang, timeout = self.training.hang_timeout_minutes, self.parallel.distributed_timeout_minutes
        if hang is not None and hang >= timeout:
            raise ConfigError(f"training.hang_timeout_minutes={hang:g} is not shorter than "
                              f"parallel.distributed_timeout_minutes={timeout}: the collective would fail first, "
                              "naming nobody; lower it or raise the distributed timeout")
        if self.training.spike_rollbacks and not checkpoint.save:
            raise ConfigError(f"training.spike_rollbacks={self.training.spike_rollbacks} rolls back to a checkpoint "
                              "of checkpoint.save, which is unset: give --save DIR")
        past = [step for step in checkpoint.keep_steps if step > total]
        if past:
            raise ConfigError(f"checkpoint.keep_steps {past}: past the run's last step (training.train_iters={total})")
        if checkpoint.branch_step is not None and checkpoint.branch_step >= total:
            raise ConfigError(f"checkpoint.branch_step={checkpoint.branch_step} leaves this run nothing to train "
                              f"(training.train_iters={total})")

    def _resolve_phases(self):
        """The phases' step ranges and contexts at ``training.train_iters`` (kept: ``resolved_phases``,
        ``phase_contexts``), the schedule checked against them; returns the contexts."""
        try:
            resolved = resolve_phases(self.phases, self.training.train_iters)
        except ValueError as err:
            raise ConfigError(f"phases: {err}") from err
        try:  # the schedule validates itself against the run length when evaluated
            lr_at(0, config=self.schedule, total_steps=self.training.train_iters, phases=resolved)
        except ValueError as err:
            raise ConfigError(f"schedule: {err}") from err
        object.__setattr__(self, "_resolved_phases", tuple(resolved))  # frozen: set once, here
        from megatron_ext.training.context import phase_contexts

        try:
            contexts = phase_contexts(resolved, data=self.data, rotary_base=self.model.rotary_base)
        except UserError as err:
            raise ConfigError(str(err)) from err
        object.__setattr__(self, "_phase_contexts", contexts)
        return contexts

    def _check_phase_contexts(self, contexts) -> None:
        """What each phase reads against the run's settings: shared values, ramp-up, lengths, CUDA
        graphs, what each objective (and validation) can select at its length."""
        from megatron_ext.training.context import reads_sources, varies

        if not varies(contexts):
            # One context for the whole run: the run reads data.*, so a value every phase sets alike
            # would be ignored without a word; it is the run's own setting.
            for key in ("seq_length", "micro_batch_size", "global_batch_size"):
                shared, run = getattr(contexts[0], key), getattr(self.data, key)
                if shared != run:
                    raise ConfigError(f"every phase reads {key} {shared} but data.{key} is {run}: a value all phases "
                                      f"share is the run's; set data.{key}: {shared} and drop it from the phases")
        if self.data.rampup_batch_size is not None and reads_sources(contexts):
            raise ConfigError("data.rampup_batch_size needs phases that read data.data_path as one blend (no phase "
                              "data_path or temperature)")
        if self.data.rampup_batch_size is not None and varies(contexts):
            raise ConfigError("data.rampup_batch_size needs phases of one sequence length and batch (no phase "
                              "seq_length, micro_batch_size or global_batch_size)")
        for context in contexts:
            if context.seq_length > self.model.seq_length:
                raise ConfigError(f"phases[{context.phase.index}].seq_length={context.seq_length} exceeds "
                                  f"model.seq_length={self.model.seq_length}")
        from megatron_ext.training.cuda_graphs import run_problem

        if (problem := run_problem(self)) is not None:  # the CUDA-graph rules across sections
            raise ConfigError(problem)
        seq_length = self.data.seq_length
        for index, (phase, context) in enumerate(zip(self.phases, contexts)):
            if problem := phase.objective.selection_problem(context.seq_length,
                                                            lambda field: f"phases[{index}].{field}"):
                raise ConfigError(problem)
        if self.data.eval_iters:  # validation runs (at least after the last step)
            for objective in self.validation_objectives().values():
                if problem := objective.selection_problem(seq_length, lambda field: "training.eval_mask_ratio"):
                    raise ConfigError(problem)

    def data_paths(self) -> dict[str, list[str]]:
        """The prefixes each data setting names: ``data.data_path``'s and each ``phases[i].data_path``'s
        (what the pre-flight checks are present and made with the run's tokenizer)."""
        d = self.data
        out = {f"data.{name}": parse_blend(paths, where=f"data.{name}")[0]
               for name in ("data_path", *PER_SPLIT_PATHS) if (paths := getattr(d, name))}
        if d.data_args_path is not None:
            out[f"data.data_args_path ({d.data_args_path})"] = d.blend[0]
        for index, phase in enumerate(self.phases):
            for name in ("data_path", "valid_data_path"):
                if (paths := getattr(phase, name)) is not None:
                    out[f"phases[{index}].{name}"] = parse_blend(paths, where=f"phases[{index}].{name}")[0]
        return out

    def validation_objectives(self) -> dict[str, Objective]:
        """What each validation measures (``objectives.validation_objectives`` for this run's phases)."""
        return validation_objectives(self.training.eval_mask_ratio, [phase.objective for phase in self.phases])

    @property
    def resolved_phases(self) -> tuple[ResolvedPhase, ...]:
        """The phases with their step ranges at ``training.train_iters``: resolved once, when the
        config is built (every reader of a run's phases takes them from here)."""
        return self._resolved_phases

    @property
    def phase_contexts(self):
        """Each phase's sequence length, RoPE base and batch sizes (``training.context``), resolved
        once, when the config is built."""
        return self._phase_contexts

    def global_batch_size_at(self, step: int) -> int:
        """The global batch of step ``step``: its phase's, or ``data.rampup_batch_size``'s ramp."""
        if self._step_batches is not None:
            return self._step_batches[step]
        from megatron_ext.training.context import context_at

        return context_at(self._phase_contexts, step).global_batch_size

    def consumed_samples(self, step: int) -> int:
        """Megatron's ``consumed_samples`` after ``step`` steps: the sum of their global batches."""
        if self._step_batches is not None:
            return sum(self._step_batches[:step])
        from megatron_ext.training.context import consumed_samples

        return consumed_samples(self._phase_contexts, step)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON-able); :func:`run_config_from_dict` reads it back."""
        out = dataclasses.asdict(self)
        out["phases"] = [p.to_config() for p in self.phases]
        return out


SECTIONS: dict[str, type] = {
    "model": EncoderModelConfig,
    "tokenizer": TokenizerConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "schedule": LRScheduleConfig,
    "training": TrainingConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}
