"""The one Megatron <-> Hugging Face parameter map, shared by import and export.

Megatron names are ``EncoderModel.state_dict()`` names at tensor-parallel size 1 with the
``local`` spec, which are also the dist-checkpoint keys of both specs (``spec.py``). Tensor-
parallel shards never reach this module: import saves at TP=1 and export loads at TP=1, and
Megatron's dist checkpoints reshard on load. HF names are the layout that ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and ``EuroBertForMaskedLM``
share (``model.layers.<i>.self_attn.q_proj`` ...).

Each :class:`Rule` ties one Megatron tensor to one or more HF tensors through a named
:class:`Transform`; :func:`megatron_to_hf` applies ``to_hf`` and :func:`hf_to_megatron` applies
``to_megatron`` of the same rules. Transforms:

- ``qkv``: Megatron's ``linear_qkv`` rows (and bias) are grouped per query group, each group
  holding its ``heads / groups`` query heads, then one key head, then one value head; HF keeps
  ``q_proj``, ``k_proj``, ``v_proj`` apart, query head ``i`` reading KV head
  ``i // (heads / groups)``, which is the same grouping.
- ``gate_up``: ``linear_fc1`` is ``[gate; up]`` (SwiGLU).
- ``vocab``: embedding and LM-head rows. Megatron pads the vocabulary to ``vocab_size``
  (a multiple of 128 x TP); HF has ``Layout.hf_vocab_size`` rows. Export drops the padding;
  import fills new rows with the mean of the existing rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_ext.config_loading import UserError
from megatron_ext.model.config import EncoderModelConfig


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What the transforms need besides the tensors."""

    config: EncoderModelConfig
    """The Megatron model's architecture (its ``vocab_size`` is the padded one)."""
    hf_vocab_size: int
    """Embedding/LM-head rows on the Hugging Face side."""

    def __post_init__(self) -> None:
        if not 0 < self.hf_vocab_size <= self.config.vocab_size:
            raise UserError(f"Hugging Face vocabulary of {self.hf_vocab_size} rows does not fit "
                            f"EncoderModelConfig.vocab_size={self.config.vocab_size}")


@dataclass(frozen=True)
class Transform:
    """A named pair of inverse functions between one Megatron tensor and its HF tensors."""

    name: str
    """For messages and readers of the table."""
    to_hf: Callable[[Tensor, Layout], tuple[Tensor, ...]]
    """Megatron tensor -> the HF tensors, in the order of ``Rule.hf``."""
    to_megatron: Callable[[tuple[Tensor, ...], Layout], Tensor]
    """The inverse."""


def _qkv_groups(layout: Layout) -> tuple[int, int, int]:
    c = layout.config
    return c.num_query_groups, c.num_attention_heads // c.num_query_groups, c.head_dim


def _split_qkv(t: Tensor, layout: Layout) -> tuple[Tensor, ...]:
    groups, per_group, d = _qkv_groups(layout)
    rest = t.shape[1:]  # (hidden,) for the weight, () for the bias
    grouped = t.reshape(groups, per_group + 2, d, *rest)
    return (grouped[:, :per_group].reshape(-1, *rest), grouped[:, per_group].reshape(-1, *rest),
            grouped[:, per_group + 1].reshape(-1, *rest))


def _merge_qkv(parts: tuple[Tensor, ...], layout: Layout) -> Tensor:
    groups, per_group, d = _qkv_groups(layout)
    q, k, v = parts
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(groups, per_group, d, *rest), k.reshape(groups, 1, d, *rest),
         v.reshape(groups, 1, d, *rest)], dim=1
    ).reshape(-1, *rest)


def mean_padded(t: Tensor, rows: int) -> Tensor:
    """``t`` with rows appended up to ``rows``, each the mean of ``t``'s rows (in float32)."""
    if rows == t.shape[0]:
        return t
    mean = t.float().mean(dim=0, keepdim=True).to(t.dtype)
    return torch.cat([t, mean.expand(rows - t.shape[0], -1)])


IDENTITY = Transform("identity", lambda t, _: (t,), lambda parts, _: parts[0])
QKV = Transform("qkv", _split_qkv, _merge_qkv)
GATE_UP = Transform(
    "gate_up", lambda t, _: tuple(t.chunk(2)), lambda parts, _: torch.cat(parts)
)
VOCAB = Transform(
    "vocab",
    lambda t, layout: (t[: layout.hf_vocab_size],),
    lambda parts, layout: mean_padded(parts[0], layout.config.vocab_size),
)


@dataclass(frozen=True)
class Rule:
    """One row of the map (positional fields keep the table readable)."""

    megatron: str
    """Megatron parameter name; ``{i}`` is the layer index."""
    hf: tuple[str, ...]
    """The HF parameter names it corresponds to."""
    transform: Transform = IDENTITY
    """How the tensors convert."""
    when: str | None = None
    """The ``EncoderModelConfig`` flag the tensors exist under; ``untied``: only without tied
    embeddings; None: always."""


_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB),
    Rule(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",)),
    Rule(_L + "self_attention.linear_qkv.weight",
         tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"), QKV),
    Rule(_L + "self_attention.linear_qkv.bias",
         tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"), QKV, when="add_qkv_bias"),
    Rule(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",),
         when="qk_layernorm"),
    Rule(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",),
         when="qk_layernorm"),
    Rule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",)),
    Rule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",)),
    Rule(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
         GATE_UP),
    Rule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), VOCAB, when="untied"),
)


O_PROJ_BIAS = _H + "self_attn.o_proj.bias"
"""Written by export, as zeros, where the HF class's ``attention_bias`` flag that gives q/k/v
their biases also gives ``o_proj`` one (the encoder has none); import accepts it only as zeros."""


def zero_o_proj_biases(config: EncoderModelConfig) -> dict[str, Tensor]:
    """The all-zero ``o_proj`` biases of every layer (export, ``attention_bias`` formats)."""
    return {O_PROJ_BIAS.format(i=i): torch.zeros(config.hidden_size)
            for i in range(config.num_layers)}


def drop_zero_o_proj_biases(state: dict[str, Tensor], config: EncoderModelConfig) -> dict[str, Tensor]:
    """``state`` without its ``o_proj`` biases, which must all be exactly zero (import).

    Raises:
        UserError: naming the first non-zero bias (the encoder has no ``o_proj`` bias to put it
            in) or a missing one.
    """
    names = [O_PROJ_BIAS.format(i=i) for i in range(config.num_layers)]
    for name in names:
        if name not in state:
            raise UserError(f"Hugging Face weights have no {name} (attention_bias=True expects it)")
        if torch.count_nonzero(state[name]):
            raise UserError(
                f"{name} is not zero (max |value| {state[name].abs().max().item():.3g}): the "
                "encoder has no o_proj bias to hold it; only attention_bias=True models whose "
                "o_proj biases are all zero (as export writes them) can be imported")
    return {k: v for k, v in state.items() if k not in set(names)}


def expanded_rules(config: EncoderModelConfig) -> list[tuple[str, tuple[str, ...], Transform]]:
    """The rules that apply to ``config``, one entry per layer for per-layer rules."""
    out = []
    for rule in RULES:
        if rule.when == "untied":
            if config.tie_embeddings:
                continue
        elif rule.when is not None and not getattr(config, rule.when):
            continue
        layers = range(config.num_layers) if "{i}" in rule.megatron else [None]
        for i in layers:
            out.append((rule.megatron.format(i=i), tuple(k.format(i=i) for k in rule.hf),
                        rule.transform))
    return out


def _check_keys(given: set[str], expected: set[str], side: str) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise UserError(f"{side} weights do not match the expected layout: missing {missing[:8]}"
                        f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                        f"{' ...' if len(unexpected) > 8 else ''}")


def megatron_to_hf(state: dict[str, Tensor], layout: Layout) -> dict[str, Tensor]:
    """HF tensors (fresh, contiguous) from a TP=1 ``EncoderModel.state_dict()``."""
    state = {k: v for k, v in state.items() if not k.endswith("._extra_state")}
    rules = expanded_rules(layout.config)
    _check_keys(set(state), {m for m, _, _ in rules}, "Megatron")
    out: dict[str, Tensor] = {}
    for megatron, hf, transform in rules:
        for name, tensor in zip(hf, transform.to_hf(state[megatron], layout), strict=True):
            out[name] = tensor.clone(memory_format=torch.contiguous_format)
    return out


def hf_to_megatron(state: dict[str, Tensor], layout: Layout) -> dict[str, Tensor]:
    """A TP=1 ``EncoderModel`` state dict from HF tensors (``lm_head.weight`` is ignored when
    the embeddings are tied: HF's state dict lists the shared tensor under both names)."""
    if layout.config.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    rules = expanded_rules(layout.config)
    _check_keys(set(state), {h for _, hf, _ in rules for h in hf}, "Hugging Face")
    return {
        megatron: transform.to_megatron(tuple(state[h] for h in hf), layout).clone(
            memory_format=torch.contiguous_format)
        for megatron, hf, transform in rules
    }
