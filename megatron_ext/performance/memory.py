"""The memory model: bytes per rank a run needs, estimated from its config before anything is
allocated. Whether a run fits (``--dry-run``'s memory lines, judged against a GPU of ``--gpu KIND`` or
this machine; ``pretrain``'s refusal of a config whose estimate exceeds the memory this process can
use, naming the settings that reduce it; the largest micro-batch that fits) is
``training/memory_fit.py``'s.

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
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_ext.model.config import EncoderModelConfig, layer_matmul_parameters
from megatron_ext.performance.flops import peak_lm_head_share
from megatron_ext.phases import ResolvedPhase

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


def rank_memory(config, *, data_parallel: int, data, phases: Sequence[ResolvedPhase]) -> MemoryEstimate:
    """Peak bytes per rank of ``phases`` of ``config`` (a ``training.config.RunConfig``) read as ``data``
    (its ``DataConfig``, or one phase's) on ``data_parallel`` data-parallel ranks (module docstring)."""
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
