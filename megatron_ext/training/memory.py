"""Memory per rank a run needs, estimated from its config before anything is allocated.

``--dry-run`` prints the estimate, judged against a GPU of ``--gpu KIND``, else against this
machine where it runs the plan's processes (``hardware.runs_elsewhere``; a 64-process plan made on a CPU login
node is not judged by the login node's memory: the dry run says memory was not checked and names
``--gpu KIND``); ``pretrain`` refuses a config whose estimate exceeds the
memory this process can use (``hardware.usable_memory_bytes``), naming the estimate and the
settings that reduce it, instead of hanging or dying in the allocator an hour in.

The estimate is for the largest pipeline stage (the first holds the embedding and most
micro-batches in flight, the last the LM head) and counts:

- parameters, gradients and optimizer state per byte width of the engine's mixed precision
  (parameters in ``model.params_dtype``; fp32 gradients; Adam's two fp32 moments, plus fp32
  main parameters for bf16 ones, divided over data-parallel ranks by the distributed optimizer);
- activations saved for the backward pass, per token and layer (``layer_activation_bytes``):
  ``6 h`` values in the residual stream's dtype (norm inputs and outputs) plus
  ``3 q + 3 kv + 5 ffn`` values in the compute dtype (bf16 under autocast: attention inputs
  after RoPE and its output, the gate/up projection, SwiGLU's product; ``3 ffn`` with Megatron's
  fused SwiGLU, ``training.bias_activation_fusion``). The coefficients were
  measured with ``torch.autograd.graph.saved_tensors_hooks`` on the local spec and are checked
  within 10 % over several shapes by ``tests/unit/test_memory.py``. Attention never stores the
  ``s x s`` scores (SDPA's flash / memory-efficient kernels, cuDNN or TE); a document mask stores
  one boolean ``[b, 1, s, s]`` tensor per micro-batch;
- the LM head's logits and cross-entropy at the positions it runs (all positions for CLM, the
  masked share for MLM with ``training.lm_head_scored_only``): the fp32 softmax kept for the
  backward pass plus the logits alive at the forward/backward turn, when every activation is
  still held.

Calibration against peak memory measured on an H100 (``torch.cuda.max_memory_allocated``,
bf16 autocast, seq 2,048, MLM-40, micro-batch 4; ../shared/gpu at commit bf033a0): 610m
29.1 GiB estimated vs 27.4 measured, 1b 46.2 vs 43.5, i.e. about 6 % above; with the LM head
at every position 32.6 vs 30.9 and 49.7 vs 47.0.

With layer CUDA graphs (``training.cuda_graphs``) a private memory pool, reserved from the first
step to the end of the run, holds what the graphed layers save for their backward pass (one
micro-batch's layer activations: the patterns' graphs share the pool) and their static inputs,
outputs and gradients (``cuda_graph_pool_bytes``: at most two ``[s, b, h]`` buffers per layer and
pattern). Counted on top of the activations above, because the first step records the layers
eagerly before Megatron captures them, and the caching allocator keeps those blocks for the rest
of the run: an upper bound. Measured on an H200 (1b, seq 2,048, 6 micro-batches of 3, local spec,
fp32 parameters under bf16 autocast, ``benchmarks/throughput.py``, 2026-11-26): peak allocated
23.3 GB with graphs against 32.3 GB without (``torch.cuda.max_memory_allocated``, which leaves out
the allocator's cached blocks), so the term only keeps the check on the safe side.

Not counted: the CUDA context and allocator fragmentation (a few hundred MB to a few GB); the
refusal therefore only triggers when the estimate alone exceeds the usable memory, and the plan
says how close a config comes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron_ext.model.config import EncoderModelConfig, layer_matmul_parameters
from megatron_ext.training.config import RunConfig

GiB = 1024**3


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one rank holds at the peak of a step (its largest pipeline stage)."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    """Activations and LM-head transients at the run's recomputation setting."""
    activations_no_recompute: int
    activations_full_recompute: int
    """With ``recompute_granularity: full`` and ``recompute_num_layers: 1`` (GPU only)."""
    micro_batches_in_flight: int
    """Micro-batches whose activations are held at once (pipeline warm-up of 1F1B)."""
    cuda_graph_pool: int = 0
    """The layer graphs' memory pool (``training.cuda_graphs``; module docstring), 0 without."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.cuda_graph_pool

    def describe(self) -> str:
        """One line, in GiB."""
        g = lambda n: f"{n / GiB:.2f}"  # noqa: E731
        return (f"params {g(self.parameters)} + grads {g(self.gradients)} + optimizer {g(self.optimizer_state)} + "
                f"activations {g(self.activations)} "
                + (f"+ CUDA graph pool {g(self.cuda_graph_pool)} " if self.cuda_graph_pool else "")
                + f"= {g(self.total)} GiB per rank "
                f"(activations without recomputation {g(self.activations_no_recompute)}, with full "
                f"recomputation {g(self.activations_full_recompute)}; "
                f"{self.micro_batches_in_flight} micro-batch(es) in flight)")


def layer_activation_bytes(config: EncoderModelConfig, *, residual_bytes: int, compute_bytes: int,
                           tensor_parallel: int = 1, swiglu_fused: bool = False) -> float:
    """Bytes one transformer layer saves for its backward pass, per token (module docstring).

    ``swiglu_fused`` (``training.bias_activation_fusion``): Megatron's fused SwiGLU keeps only its
    ``[gate; up]`` input, where torch's keeps the gate's SiLU input and output too: ``3 ffn``
    instead of ``5 ffn`` (measured the same way)."""
    q = config.num_attention_heads * config.head_dim // tensor_parallel
    kv = config.num_query_groups * config.head_dim // tensor_parallel
    ffn = config.ffn_hidden_size // tensor_parallel
    ffn_saved = 3 if swiglu_fused else 5
    return 6 * config.hidden_size * residual_bytes + (3 * q + 3 * kv + ffn_saved * ffn) * compute_bytes


def lm_head_bytes_per_scored_token(config: EncoderModelConfig, *, compute_bytes: int, tensor_parallel: int = 1) -> float:
    """The fp32 softmax saved by the cross entropy, plus the logits (compute dtype) alive at the
    forward/backward turn, for one position where the head runs."""
    return config.vocab_size / tensor_parallel * (4 + compute_bytes)


def cuda_graph_pool_bytes(config: EncoderModelConfig, *, tokens: int, layers: int, patterns: int,
                          per_layer_activation: float, residual_bytes: int) -> int:
    """The layer graphs' pool (module docstring): one micro-batch's saved activations of
    ``layers`` layers (``per_layer_activation`` bytes per token) plus, per layer and attention
    pattern, two ``[s, b, h]`` static buffers (the graph's output and its input gradient; inputs
    alias the previous layer's output)."""
    io = 2 * config.hidden_size * residual_bytes * layers * patterns
    return math.ceil(tokens * (layers * per_layer_activation + io))


def stage_parameters(config: EncoderModelConfig, *, tensor_parallel: int, pipeline_parallel: int) -> int:
    """Parameters held by the largest pipeline stage's rank (matmuls split over TP, norms replicated)."""
    h = config.hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_query_groups * config.head_dim
    layer = (layer_matmul_parameters(config) + (q + 2 * kv) * config.add_qkv_bias) // tensor_parallel
    layer += 2 * h + 2 * config.head_dim * config.qk_layernorm
    layers = config.num_layers // pipeline_parallel * layer
    table = config.vocab_size * h // tensor_parallel
    first = layers + table
    # The last stage holds the LM head (a copy of the embedding when tied across stages) + final norm.
    head = table if (not config.tie_embeddings or pipeline_parallel > 1) else 0
    last = layers + head + h if pipeline_parallel > 1 else first + head + h
    return max(first, last)


def estimate_memory(config: RunConfig, *, world_size: int) -> MemoryEstimate:
    """Peak bytes per rank of ``config`` at ``world_size`` processes (module docstring): of its
    most demanding phase when phases read other lengths or batches (``training.context``)."""
    return max(phase_memory(config, world_size=world_size), key=lambda estimate: estimate.total)


def phase_memory(config: RunConfig, *, world_size: int) -> list[MemoryEstimate]:
    """Peak bytes per rank of each phase at its own sequence length and micro-batch
    (``training.context``); one estimate for all when no phase changes them."""
    from megatron_ext.training.context import varies

    contexts = config.phase_contexts
    if not varies(contexts):
        return [_estimate(config, world_size=world_size, data=config.data, phases=config.resolved_phases)] * len(contexts)
    return [_estimate(config, world_size=world_size, data=c.data_config(config.data), phases=(c.phase,))
            for c in contexts]


def _estimate(config: RunConfig, *, world_size: int, data, phases) -> MemoryEstimate:
    """Peak bytes per rank of ``phases`` of ``config`` read as ``data`` (a ``DataConfig``)."""
    from megatron_ext.training.metrics import peak_lm_head_share
    from megatron_ext.training.dry_run import check_layout

    data_parallel = check_layout(config, world_size)
    m, d, t, p = config.model, data, config.training, config.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    params = stage_parameters(m, tensor_parallel=tp, pipeline_parallel=pp)
    param_bytes = m.torch_dtype.itemsize
    distributed = p.use_distributed_optimizer and data_parallel > 1
    # Adam: two fp32 moments, plus an fp32 main copy of parameters stored in lower precision.
    optimizer_per_param = 8 + (4 if param_bytes < 4 else 0)
    optimizer = params * optimizer_per_param / (data_parallel if distributed else 1)

    residual_bytes = param_bytes  # the residual stream keeps the parameters' dtype under autocast
    compute_bytes = 2 if t.bf16 or param_bytes == 2 else 4
    per_layer = layer_activation_bytes(m, residual_bytes=residual_bytes, compute_bytes=compute_bytes,
                                       tensor_parallel=tp, swiglu_fused=t.bias_activation_fusion)
    tokens = d.micro_batch_size * d.seq_length
    layers = m.num_layers // pp
    head_share = max(peak_lm_head_share(phase, seq_length=d.seq_length, scored_only=t.lm_head_scored_only)
                     for phase in phases)
    head = tokens * head_share * lm_head_bytes_per_scored_token(m, compute_bytes=compute_bytes, tensor_parallel=tp)
    outside_layers = tokens * 2 * m.hidden_size * residual_bytes  # embedding output, final norm input
    in_flight = min(pp, d.global_batch_size // (d.micro_batch_size * data_parallel))

    def activations(kept_layers: float, full_layers: int) -> int:
        held = tokens * (kept_layers * m.hidden_size * residual_bytes + full_layers * per_layer)
        return math.ceil(in_flight * (held + outside_layers) + head)

    no_recompute = activations(0, layers)
    full = activations(layers, 1)  # each layer's input kept, one layer rebuilt at a time
    if t.recompute_granularity == "full":
        k = t.recompute_num_layers
        current = activations(math.ceil(layers / k), k)
    elif t.recompute_granularity == "selective":  # core attention recomputed: its output is not kept
        q = m.num_attention_heads * m.head_dim // tp
        current = no_recompute - math.ceil(in_flight * tokens * layers * q * compute_bytes)
    else:
        current = no_recompute
    graph_pool = 0
    if t.cuda_graphs != "none":
        patterns = len({phase.objective.causal for phase in phases})
        graph_pool = cuda_graph_pool_bytes(m, tokens=tokens, layers=layers, patterns=patterns,
                                           per_layer_activation=per_layer, residual_bytes=residual_bytes)
    return MemoryEstimate(
        parameters=params * param_bytes, gradients=params * 4,  # gradients reduce into fp32 buffers
        optimizer_state=math.ceil(optimizer), activations=current,
        activations_no_recompute=no_recompute, activations_full_recompute=full,
        micro_batches_in_flight=in_flight, cuda_graph_pool=graph_pool,
    )


def reduce_memory_advice(config: RunConfig, *, on_gpu: bool = True, phase: int | None = None) -> str:
    """What reduces the memory of ``config``: only the settings it does not have already (recomputation
    and CUDA graphs only where they apply: on a GPU). For phase ``phase`` of a run whose phases read
    other lengths or batches, its own keys (``phases[i].micro_batch_size``, and ``phases[i].seq_length``
    where it sets one): the run's ``data.*`` would change every phase, or none where it sets its own."""
    t, p = config.training, config.parallel
    if phase is None:
        micro, length = config.data.micro_batch_size, "data.seq_length"
        keys = [f"data.micro_batch_size (now {micro})"] if micro > 1 else []
    else:
        micro = config.phase_contexts[phase].micro_batch_size
        keys = [f"phases[{phase}].micro_batch_size (now {micro})"] if micro > 1 else []
        length = f"phases[{phase}].seq_length" if config.phases[phase].seq_length is not None else "data.seq_length"
    advice = ["lower " + " or ".join(keys + [length])]  # a micro-batch of 1 cannot be lowered
    if t.recompute_granularity != "full" and on_gpu:
        advice.append("set training.recompute_granularity: full")
    if not t.lm_head_scored_only:
        advice.append("set training.lm_head_scored_only: true")
    if not p.use_distributed_optimizer:
        advice.append("use parallel.use_distributed_optimizer")
    advice.append("raise tensor/pipeline_model_parallel_size")
    if t.cuda_graphs != "none":
        advice.append("set training.cuda_graphs: none")
    return ", ".join(advice[:-1]) + ", or " + advice[-1]


GPU_MEMORY_GIB = {
    # Memory per device (GiB as the vendors' datasheets state GB of HBM), by PEAK_TFLOPS's kinds.
    "H100": 80, "H200": 141, "B200": 180, "A100": 80, "L40S": 48, "MI300X": 192, "MI250X": 128,
}
"""What ``--dry-run --gpu KIND`` checks the estimate against (A100: the 80 GB model)."""


def check_fits(estimate: MemoryEstimate, usable_bytes: int, where: str, *, advice: str) -> None:
    """Raise ``UserError`` when ``estimate`` exceeds ``usable_bytes``, naming what reduces it."""
    from megatron_ext.config_loading import UserError

    if estimate.total > usable_bytes:
        raise UserError(f"this run needs about {estimate.total / GiB:.1f} GiB per rank but {where} has "
                        f"{usable_bytes / GiB:.1f} GiB usable ({estimate.describe()}); {advice}")


def memory_report(config: RunConfig, *, world_size: int, gpu_kind: str | None = None) -> str:
    """``--dry-run``'s memory lines: the estimate and whether it fits a GPU of ``gpu_kind`` (``--gpu``:
    a plan made on a login node is for the compute nodes' GPUs), else this machine's device where this
    machine runs the plan's processes (``hardware.runs_elsewhere``); elsewhere the estimate alone, saying
    that memory was not checked and how to check it (a verdict about this machine would be about the
    wrong one)."""
    from megatron_ext import hardware
    from megatron_ext.training.context import varies

    if gpu_kind in GPU_MEMORY_GIB:
        usable, where, on = GPU_MEMORY_GIB[gpu_kind] * GiB, f"a {gpu_kind} ({GPU_MEMORY_GIB[gpu_kind]} GiB)", f"on a {gpu_kind}"
        gpu, run_there = True, f"a run on a {gpu_kind}"
    elif (reason := hardware.runs_elsewhere(world_size)) is not None:
        return _unchecked_memory_report(config, world_size=world_size, reason=reason)
    else:
        (usable, where), gpu = hardware.usable_memory_bytes(), hardware.on_gpu()
        on, run_there = "on this machine", "a run here"
    if varies(config.phase_contexts):
        return _phase_memory_report(config, world_size=world_size, usable=usable, where=where, on=on, on_gpu=gpu)
    estimate = estimate_memory(config, world_size=world_size)
    if estimate.total <= usable:
        verdict = f"fits {where}: {usable / GiB:.1f} GiB usable"
    else:
        verdict = (f"NOT READY, {run_there} would stop: {usable / GiB:.1f} GiB usable in {where}; "
                   f"{reduce_memory_advice(config, on_gpu=gpu)}")
    largest = largest_micro_batch(config, world_size=world_size, usable_bytes=usable)
    choice = (f"{largest} (data.micro_batch_size; {config.data.micro_batch_size} in this config)" if largest
              else "none, even 1 exceeds it")
    same = "same global batch" + (" and ramp-up batches" if config.data.rampup_batch_size is not None else "")
    return (f"memory/rank       {estimate.describe()}\n                  {on}: {verdict}\n"
            f"                  largest micro-batch within {100 * (1 - MICRO_BATCH_HEADROOM):.0f} % of that memory, "
            f"{same}: {choice}")


def _unchecked_memory_report(config: RunConfig, *, world_size: int, reason: str) -> str:
    """The memory lines of a plan this machine does not run (``hardware.runs_elsewhere``): the estimate,
    and the flag that checks it."""
    from megatron_ext.training.context import varies

    check = (f"memory not checked ({reason}): give --gpu KIND ({', '.join(GPU_MEMORY_GIB)}) to check it "
             "against that GPU's memory")
    if not varies(config.phase_contexts):
        estimate = estimate_memory(config, world_size=world_size)
        return f"memory/rank       {estimate.describe()}\n                  {check}"
    lines = [f"memory/rank       per phase; {check}:"]
    for context, estimate in zip(config.phase_contexts, phase_memory(config, world_size=world_size)):
        lines.append(f"  phases[{context.phase.index}] {context.phase.name:<8} seq {context.seq_length} x micro "
                     f"{context.micro_batch_size}: {estimate.describe()}")
    return "\n".join(lines)


MICRO_BATCH_HEADROOM = 0.25
"""Share of the usable memory a chosen micro-batch leaves free: the CUDA context, the allocator's
fragmentation and the estimate's own error (about 6 % high at 1B on an H100, 5 % on an H200) live
there, and a longer validation batch or a new phase's larger LM head must not end a run days in."""


def largest_micro_batch(config: RunConfig, *, world_size: int, usable_bytes: int,
                        headroom: float = MICRO_BATCH_HEADROOM, sequences_per_rank: int | None = None) -> int | None:
    """The largest ``data.micro_batch_size`` whose estimate at ``world_size`` processes stays within
    ``(1 - headroom) * usable_bytes``, among the sizes that split ``sequences_per_rank`` evenly (by
    default one data-parallel rank's share of the global batch at ``world_size``: the global batch,
    and with it the training, is unchanged, only the number of micro-batches per step changes) and
    that the run accepts (:func:`_candidate`: a batch-size ramp-up's smaller batches must split into
    whole micro-batches too); ``None`` when even one sequence does not fit. Never raises for a config
    that ``dry_run.check_layout`` accepts. Larger
    micro-batches mean fewer, bigger kernels per step and fewer host calls per token, which is what a
    host-bound step (Transformer Engine at small micro-batches) lacks."""
    from megatron_ext.training.dry_run import check_layout

    per_rank = sequences_per_rank or config.data.global_batch_size // check_layout(config, world_size)
    for micro in sorted((n for n in range(1, per_rank + 1) if per_rank % n == 0), reverse=True):
        candidate = _candidate(config, world_size, lambda c: replace(c, data=replace(c.data, micro_batch_size=micro)))
        if candidate is not None and \
                estimate_memory(candidate, world_size=world_size).total <= (1 - headroom) * usable_bytes:
            return micro
    return None


def _candidate(config: RunConfig, world_size: int, change) -> RunConfig | None:
    """``change(config)`` when the run could train with it (the config's own checks and
    ``dry_run.check_layout``'s: every global batch of the run, a batch-size ramp-up's included,
    divisible by micro-batch x data-parallel size), else None: a micro-batch search proposes only
    settings the run accepts."""
    from megatron_ext.config_loading import UserError
    from megatron_ext.training.dry_run import layout_problem

    try:
        candidate = change(config)
    except UserError:
        return None
    return candidate if layout_problem(candidate, world_size) is None else None


def check_run_fits(config: RunConfig, *, world_size: int, usable_bytes: int, where: str) -> None:
    """:func:`check_fits` of every phase; a phase at another length or batch that does not fit is
    named, with the largest micro-batch that does (``phases[i].micro_batch_size``)."""
    from megatron_ext import hardware
    from megatron_ext.config_loading import UserError
    from megatron_ext.training.context import varies

    contexts = config.phase_contexts
    if not varies(contexts):
        return check_fits(estimate_memory(config, world_size=world_size), usable_bytes, where,
                          advice=reduce_memory_advice(config, on_gpu=hardware.on_gpu()))
    for context, estimate in zip(contexts, phase_memory(config, world_size=world_size)):
        if estimate.total > usable_bytes:
            i = context.phase.index
            largest = largest_phase_micro_batch(config, i, world_size=world_size, usable_bytes=usable_bytes)
            fix = (f"set phases[{i}].micro_batch_size: {largest}" if largest
                   else reduce_memory_advice(config, on_gpu=hardware.on_gpu(), phase=i))
            raise UserError(f"phases[{i}] ({context.seq_length} tokens x micro-batch {context.micro_batch_size}) needs "
                            f"about {estimate.total / GiB:.1f} GiB per rank but {where} has {usable_bytes / GiB:.1f} "
                            f"GiB usable ({estimate.describe()}); {fix}")


def _phase_memory_report(config: RunConfig, *, world_size: int, usable: int, where: str, on: str,
                         on_gpu: bool) -> str:
    """``--dry-run``'s memory lines of a run whose phases read other lengths or batches: each
    phase's estimate, and for one that does not fit, the largest micro-batch that does (``on``: on
    this machine, or on the GPU kind of ``--gpu``)."""
    lines = [f"memory/rank       per phase, {on} ({where}: {usable / GiB:.1f} GiB usable):"]
    for context, estimate in zip(config.phase_contexts, phase_memory(config, world_size=world_size)):
        i = context.phase.index
        line = (f"  phases[{i}] {context.phase.name:<8} seq {context.seq_length} x micro {context.micro_batch_size}: "
                f"{estimate.describe()}")
        if estimate.total > usable:
            largest = largest_phase_micro_batch(config, i, world_size=world_size, usable_bytes=usable)
            line += (f"; NOT READY, this phase would not fit: set phases[{i}].micro_batch_size: {largest}"
                     if largest else f"; NOT READY, this phase would not fit, and no micro-batch fits within "
                     f"{100 * (1 - MICRO_BATCH_HEADROOM):.0f} % of that memory: "
                     f"{reduce_memory_advice(config, on_gpu=on_gpu, phase=i)}")
        lines.append(line)
    return "\n".join(lines)


def largest_phase_micro_batch(config: RunConfig, index: int, *, world_size: int, usable_bytes: int,
                              headroom: float = MICRO_BATCH_HEADROOM) -> int | None:
    """:func:`largest_micro_batch` for phase ``index`` (its ``micro_batch_size``, same global batch)."""
    from megatron_ext.training.dry_run import check_layout

    context = config.phase_contexts[index]
    per_rank = context.global_batch_size // check_layout(config, world_size)
    for micro in sorted((n for n in range(1, per_rank + 1) if per_rank % n == 0), reverse=True):
        candidate = _candidate(config, world_size, lambda c: replace(c, phases=tuple(
            replace(phase, micro_batch_size=micro) if i == index else phase for i, phase in enumerate(c.phases))))
        if candidate is not None and \
                phase_memory(candidate, world_size=world_size)[index].total <= (1 - headroom) * usable_bytes:
            return micro
    return None
