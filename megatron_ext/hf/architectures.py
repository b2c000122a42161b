"""Which Hugging Face architectures convert, and their configs in both directions.

Import reads a Llama-layout causal LM config (``llama``, incl. SmolLM; ``mistral``; ``qwen2``
with its q/k/v biases; ``qwen3`` with per-head q/k RMSNorm and an explicit ``head_dim``) or an
encoder's (``eurobert``: ``EuroBertForMaskedLM``, the layout export writes) into an
:class:`EncoderModelConfig`, refusing what the encoder cannot compute exactly. Export writes the
config of one of :data:`FORMATS`.

EuroBERT is Llama's layout with bidirectional attention and an MLM head that is one linear layer
(``lm_head``, no dense + norm transform in front of it), so the same name map serves it. What
the encoder cannot hold: ``mlp_bias=True`` (MLP and ``lm_head`` biases); ``attention_bias=True``
adds q/k/v biases (kept: ``add_qkv_bias``) and an ``o_proj`` bias, which imports only when it
is exactly zero (what export writes; :func:`megatron_ext.hf.name_map.drop_zero_o_proj_biases`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megatron_ext.config_loading import UserError
from megatron_ext.model.config import EncoderModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "eurobert")
ENCODER_MODEL_TYPES = ("eurobert",)
"""Bidirectional masked LMs: loaded with ``AutoModelForMaskedLM``; their mask token is the one
they were trained with (``mask_token_id`` in config.json)."""
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


class UnsupportedArchitectureError(UserError):
    """The Hugging Face model (or the export format) cannot represent this architecture."""


def encoder_config_from_hf(
    hf_config: Any, *, vocab_size: int, seq_length: int
) -> EncoderModelConfig:
    """The encoder config of an HF causal LM or EuroBERT config (a ``transformers``
    ``PreTrainedConfig``).

    Args:
        hf_config: The model's config.
        vocab_size: Padded Megatron vocabulary (>= the HF embedding rows and the tokenizer).
        seq_length: Longest sequence the encoder will see (``EncoderModelConfig.seq_length``).

    Raises:
        UnsupportedArchitectureError: naming every unsupported field.
    """
    model_type = getattr(hf_config, "model_type", None)
    moe = [f for f in _MOE_FIELDS if getattr(hf_config, f, None)]
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = f" (mixture-of-experts: {', '.join(moe)})" if moe else ""
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported{hint}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    problems = []
    if moe:
        problems.append(f"mixture-of-experts ({', '.join(moe)})")
    if (act := getattr(hf_config, "hidden_act", "silu")) != "silu":
        problems.append(f"hidden_act {act!r} (only SwiGLU with 'silu')")
    if getattr(hf_config, "mlp_bias", False):
        problems.append("mlp_bias=True (biases in the MLP" +
                        (" and on EuroBERT's lm_head)" if model_type == "eurobert" else ")"))
    if getattr(hf_config, "attention_bias", False) and model_type != "eurobert":
        problems.append("attention_bias=True (biases on q/k/v and o_proj; only Qwen2's q/k/v "
                        "biases, and EuroBERT's with a zero o_proj bias, are supported)")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if (rope_type := rope.get("rope_type", "default")) != "default":
        problems.append(f"rope_parameters.rope_type {rope_type!r} (RoPE scaling, e.g. Llama-3.1's "
                        "'llama3'; only unscaled RoPE is supported)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']}")
    if "rope_theta" not in rope:
        problems.append("rope_parameters has no rope_theta")
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and window < seq_length:
        problems.append(f"sliding_window={window} is shorter than the sequence length {seq_length} "
                        f"(the encoder attends over the whole sequence; use a sequence length "
                        f"<= {window})")
    if problems:
        raise UnsupportedArchitectureError(
            f"cannot convert this {model_type} model: " + "; ".join(problems)
        )
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return EncoderModelConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=None if head_dim * heads == hf_config.hidden_size else head_dim,
        vocab_size=vocab_size,
        seq_length=seq_length,
        rotary_base=float(rope["rope_theta"]),
        norm_epsilon=hf_config.rms_norm_eps,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        # Qwen2's q/k/v projections always have biases; EuroBERT's under attention_bias (its
        # o_proj bias too, which the importer requires to be zero).
        add_qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_layernorm=model_type == "qwen3",
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
    )


@dataclass(frozen=True, kw_only=True)
class ExportFormat:
    """A Hugging Face model class the encoder's weights can be written as."""

    name: str
    """``--format`` value."""
    architecture: str
    """``transformers`` model class."""
    config_class: str
    """``transformers`` config class."""
    qkv_bias: Literal["attention_bias", "always", "never"]
    """How q/k/v biases are expressed: ``attention_bias`` (a flag that also adds an o_proj bias,
    written as zeros), ``always`` present, or ``never``."""
    qk_layernorm: bool
    """The class always applies per-head q/k RMSNorm (so the model must have it)."""
    encoder: bool
    """Bidirectional encoder: needs a mask token, gets sentence-transformers files."""

    def check(self, config: EncoderModelConfig) -> None:
        """Raise :class:`UnsupportedArchitectureError` if ``config`` does not fit this class."""
        plain = "--format eurobert or --format llama"
        if config.qk_layernorm and not self.qk_layernorm:
            raise UnsupportedArchitectureError(
                f"qk_layernorm=True (per-head query/key RMSNorm) has no equivalent in "
                f"{self.architecture}; export this model with --format qwen3 (a causal LM)")
        if self.qk_layernorm and not config.qk_layernorm:
            raise UnsupportedArchitectureError(
                f"{self.architecture} always normalises queries and keys but this model has no "
                f"qk_layernorm; use {plain}")
        if config.add_qkv_bias and self.qkv_bias == "never":
            raise UnsupportedArchitectureError(
                f"add_qkv_bias=True (q/k/v biases) has no equivalent in {self.architecture}; use "
                f"{plain} or --format qwen2")
        if not config.add_qkv_bias and self.qkv_bias == "always":
            raise UnsupportedArchitectureError(
                f"{self.architecture} always has q/k/v biases but this model has none "
                f"(add_qkv_bias=False); use {plain}")

    def hf_config(self, config: EncoderModelConfig, *, vocab_size: int,
                  token_ids: dict[str, int | None], dtype: str) -> Any:
        """The ``transformers`` config of ``config`` with ``vocab_size`` rows."""
        import transformers

        kwargs: dict[str, Any] = dict(
            vocab_size=vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_query_groups, head_dim=config.head_dim,
            hidden_act="silu", rms_norm_eps=config.norm_epsilon,
            rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base},
            max_position_embeddings=config.seq_length, tie_word_embeddings=config.tie_embeddings,
            initializer_range=config.init_method_std, bos_token_id=token_ids["bos"],
            eos_token_id=token_ids["eos"], pad_token_id=token_ids["pad"],
        )
        if self.qkv_bias == "attention_bias":
            kwargs["attention_bias"] = config.add_qkv_bias
        if self.name == "eurobert":
            # The paper fine-tunes with mean pooling (SC and IR).
            kwargs |= {"mask_token_id": token_ids["mask"], "classifier_pooling": "mean"}
        if self.name == "mistral":
            kwargs["sliding_window"] = None  # the encoder attends over the whole sequence
        hf_config = getattr(transformers, self.config_class)(**kwargs)
        hf_config.architectures = [self.architecture]
        hf_config.dtype = dtype
        return hf_config


FORMATS: dict[str, ExportFormat] = {f.name: f for f in (
    ExportFormat(name="eurobert", architecture="EuroBertForMaskedLM", config_class="EuroBertConfig",
                 qkv_bias="attention_bias", qk_layernorm=False, encoder=True),
    ExportFormat(name="llama", architecture="LlamaForCausalLM", config_class="LlamaConfig",
                 qkv_bias="attention_bias", qk_layernorm=False, encoder=False),
    ExportFormat(name="mistral", architecture="MistralForCausalLM", config_class="MistralConfig",
                 qkv_bias="never", qk_layernorm=False, encoder=False),
    ExportFormat(name="qwen2", architecture="Qwen2ForCausalLM", config_class="Qwen2Config",
                 qkv_bias="always", qk_layernorm=False, encoder=False),
    ExportFormat(name="qwen3", architecture="Qwen3ForCausalLM", config_class="Qwen3Config",
                 qkv_bias="attention_bias", qk_layernorm=True, encoder=False),
)}
