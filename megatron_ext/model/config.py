"""Encoder architecture configuration and the paper's size presets.

The architecture is EuroBERT's (= Llama's without the causal mask): pre-norm RMSNorm, SwiGLU
MLP, RoPE, grouped-query attention, no biases, untied input/output embeddings, a final norm
then a linear LM head.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_ext.config_loading import UserError
from megatron_ext.transformer_impl import TransformerImpl

LLAMA3_VOCAB_SIZE = 128_256

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True)
class EncoderModelConfig:
    """Shape and numerics of the encoder; parallel sizes come from ``parallel_state``."""

    num_layers: int
    """Number of transformer blocks."""
    hidden_size: int
    """Residual stream width."""
    ffn_hidden_size: int
    """SwiGLU inner width (each of the gate and up projections has this many outputs)."""
    num_attention_heads: int
    """Query heads; without ``kv_channels``, ``hidden_size`` must be divisible by it
    (head dim = hidden / heads)."""
    num_query_groups: int
    """Key/value heads (grouped-query attention); divides ``num_attention_heads``."""
    kv_channels: int | None = None
    """Channels per attention head (Megatron ``--kv-channels``). None: hidden_size /
    num_attention_heads. Set for models whose head dim differs from that (Qwen3)."""
    vocab_size: int
    """Embedding and LM-head rows; must be divisible by the tensor-parallel size. In a recipe, or
    ``from_tokenizer``: the tokenizer's, padded to a multiple of 128 x TP; that is what a recipe
    without it gets, unless its preset (but ``tiny``) carries one."""
    seq_length: int = 2048
    """Longest input sequence accepted (RoPE has no learned table; this is a guard)."""
    rotary_base: float = 10_000.0
    """RoPE theta."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding matrix with the LM head (EuroBERT and the paper: untied)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projections only (Qwen2; Megatron ``--add-qkv-bias``)."""
    qk_layernorm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3; Megatron ``--qk-layernorm``)."""
    transformer_impl: TransformerImpl = TransformerImpl.LOCAL
    """Which implementation of the transformer layer the model is built from (the layer
    ``ModuleSpec``; Megatron-LM's ``--transformer-impl``), given as ``local`` or ``te``
    (:class:`~megatron_ext.transformer_impl.TransformerImpl`). ``local``: Megatron-Core's own modules
    with PyTorch scaled_dot_product_attention, CPU and GPU. ``te``: Transformer Engine's modules
    (fused norm + linear, fused attention, FP8), GPU only; needs ``transformer_engine``. Both hold
    the same weights."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout on embeddings and on each residual branch."""
    init_method_std: float = 0.02
    """Std of the normal init of every matrix (embedding, projections, LM head); norm weights
    start at 1."""
    depth_scaled_init: bool = True
    """True (Megatron's default): the residual branches' output projections (attention
    ``linear_proj``, MLP ``linear_fc2``) start from N(0, init_method_std / sqrt(2 x num_layers)).
    False: from N(0, init_method_std) like every other matrix, as the authors' trainer does
    (Optimus' ``TransformerEncoder._init_weights``: EuroBERT repo, ``optimus/trainer/model/model.py``);
    the paper recipes set it. Only the initialisation differs, so it may change on resume."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of parameters and activations. In training, ``bfloat16`` is Megatron-LM's mixed
    precision (``--bf16``): bf16 weights and activations, fp32 main parameters and gradient
    reduction in Megatron's optimizer (the Megatron engine only); ``float32`` keeps fp32 weights
    (with ``training.bf16``: bf16 autocast of the forward)."""

    def __post_init__(self) -> None:
        positive = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_query_groups", "vocab_size", "seq_length")
        for name in positive:
            if (value := getattr(self, name)) <= 0:
                raise UserError(f"EncoderModelConfig.{name} must be > 0, got {value}")
        if self.kv_channels is not None and self.kv_channels <= 0:
            raise UserError(f"EncoderModelConfig.kv_channels must be > 0, got {self.kv_channels}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"EncoderModelConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads} (or set kv_channels)"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise UserError(
                f"EncoderModelConfig.num_attention_heads={self.num_attention_heads} is not "
                f"divisible by num_query_groups={self.num_query_groups}"
            )
        if self.head_dim % 2:
            raise UserError(f"EncoderModelConfig: RoPE needs an even head dim, got {self.head_dim}")
        self.transformer_impl = TransformerImpl.parse(self.transformer_impl, "EncoderModelConfig.transformer_impl")
        if self.params_dtype not in _DTYPES:
            raise UserError(f"EncoderModelConfig.params_dtype must be one of {sorted(_DTYPES)}, "
                            f"got {self.params_dtype!r}")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"EncoderModelConfig.{name} must be in [0, 1), "
                                 f"got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        """Channels per attention head (``kv_channels``, else hidden / heads)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        """``params_dtype`` as a torch dtype."""
        return _DTYPES[self.params_dtype]


def _llama3(**shape: int) -> EncoderModelConfig:
    return EncoderModelConfig(
        vocab_size=LLAMA3_VOCAB_SIZE, **shape
    )


PRESETS: dict[str, EncoderModelConfig] = {
    # The paper's sizes (Llama-3 tokenizer). Names are the paper's rounded ones; see
    # docs/design.md for the exact parameter counts of these shapes.
    "210m": _llama3(num_layers=12, hidden_size=768, ffn_hidden_size=3072,
                    num_attention_heads=12, num_query_groups=12),
    "610m": _llama3(num_layers=26, hidden_size=1152, ffn_hidden_size=4096,
                    num_attention_heads=18, num_query_groups=6),
    # 1b: the authors' shape, EuroBERT repository (the paper's training code) commit 6e9d6b2 "Add
    # 1.2b model size", optimus/trainer/model/encoder/eurobert.py: 981M without the LM head.
    "1b": _llama3(num_layers=26, hidden_size=1728, ffn_hidden_size=4096,
                  num_attention_heads=18, num_query_groups=6),
    # CPU development shape. vocab_size is a placeholder: a recipe that does not set it takes the
    # tokenizer's (VOCAB_FROM_TOKENIZER_PRESETS).
    "tiny": EncoderModelConfig(num_layers=4, hidden_size=128, ffn_hidden_size=384,
                               num_attention_heads=4, num_query_groups=2, vocab_size=32_000,
                               seq_length=512),
}


VOCAB_FROM_TOKENIZER_PRESETS = frozenset({"tiny"})
"""Presets whose ``vocab_size`` is a placeholder: a recipe naming one without ``model.vocab_size``
gets the tokenizer's (``vocab_size: from_tokenizer``), never the placeholder's 32,000 rows."""


def preset(name: str, **overrides: object) -> EncoderModelConfig:
    """A copy of ``PRESETS[name]`` with fields replaced, e.g. ``preset("tiny", vocab_size=n)``."""
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


VOCAB_PADDING_MULTIPLE = 128
"""Megatron-LM's ``--make-vocab-size-divisible-by`` default."""


def padded_vocab_size(rows: int, tensor_parallel_size: int) -> int:
    """``rows`` (the tokenizer's ids) rounded up to a multiple of ``VOCAB_PADDING_MULTIPLE`` x
    ``tensor_parallel_size``, as Megatron pads the embedding and LM head: every tensor-parallel
    rank then holds an equal, aligned slice of the vocabulary."""
    multiple = VOCAB_PADDING_MULTIPLE * tensor_parallel_size
    return math.ceil(rows / multiple) * multiple


def tensor_parallel_problem(config: EncoderModelConfig, tensor_parallel_size: int) -> str | None:
    """Why ``config`` cannot be split over ``tensor_parallel_size`` ranks, or None. The one rule
    (the plan, the model builder and the Hugging Face importer ask it): every rank holds whole
    query heads, and whole KV groups or a replica of one (Megatron replicates KV heads when the
    TP size is a multiple of the groups). The vocabulary is padded to fit elsewhere."""
    tp, heads, groups = tensor_parallel_size, config.num_attention_heads, config.num_query_groups
    if heads % tp or (groups % tp and tp % groups):
        return (f"tensor_model_parallel_size={tp} must divide num_attention_heads={heads} and divide or be a "
                f"multiple of num_query_groups={groups}")
    return None


def layer_matmul_parameters(config: EncoderModelConfig) -> int:
    """Weights of one block's matmuls: fused QKV, output projection, gate/up and down."""
    h, kv = config.hidden_size, config.num_query_groups * config.head_dim
    q = config.num_attention_heads * config.head_dim
    return h * (q + 2 * kv) + q * h + 3 * h * config.ffn_hidden_size


def parameter_count(config: EncoderModelConfig) -> int:
    """Exact number of parameters of the full (unsharded) model with this config."""
    kv = config.num_query_groups * config.head_dim
    q = config.num_attention_heads * config.head_dim
    extras = (q + 2 * kv) * config.add_qkv_bias + 2 * config.head_dim * config.qk_layernorm
    layer = layer_matmul_parameters(config) + extras + 2 * config.hidden_size  # + two RMSNorm weights
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_embeddings else 2)
    return embeddings + config.num_layers * layer + config.hidden_size  # + final norm
