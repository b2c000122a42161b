"""The encoder on Megatron-Core (one CPU process, gloo): sizes, attention patterns, HF parity."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ext import hardware, process_group
from megatron_ext.model import (
    EncoderModelConfig,
    build_encoder_model,
    parameter_count,
    preset,
)
from megatron_ext.model.attention import AttentionPattern, attention_pattern, explicit_document_mask

EOD = 2
TINY = preset("tiny", vocab_size=1000)


@pytest.fixture(scope="module", autouse=True)
def model_parallel(tmp_path_factory):
    process_group.init_process_group_and_model_parallel(
        init_method=f"file://{tmp_path_factory.mktemp('pg')}/rendezvous", rank=0, world_size=1
    )
    yield
    process_group.destroy_process_group_and_model_parallel()


def build(config: EncoderModelConfig = TINY, seed: int = 0):
    torch.manual_seed(seed)
    return build_encoder_model(config).eval()


def random_ids(length: int, *, seed: int) -> torch.Tensor:
    """``[1, length]`` ids avoiding EOD, so only explicitly placed EODs split documents."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY.vocab_size, (1, length), generator=generator)


def perturbed(ids: torch.Tensor, j: int) -> torch.Tensor:
    out = ids.clone()
    out[0, j] = 3 + (out[0, j] - 3 + 17) % (TINY.vocab_size - 3)
    return out


def run(model, ids: torch.Tensor, *, causal: bool, document_end_id: int | None = None, **kwargs) -> torch.Tensor:
    """``model`` on ``ids`` with the pattern of ``causal``, documents isolated at ``document_end_id``."""
    ends = None if document_end_id is None else ids == document_end_id
    return model(ids, packed_seq_params=attention_pattern(causal=causal, document_ends=ends), **kwargs)


def changed_positions(model, ids: torch.Tensor, j: int, *, causal: bool, document_end_id: int | None = None
                      ) -> torch.Tensor:
    """Per position: did perturbing token j change its logits?"""
    with torch.no_grad():
        a = run(model, ids, causal=causal, document_end_id=document_end_id)[0]
        b = run(model, perturbed(ids, j), causal=causal, document_end_id=document_end_id)[0]
    return (a - b).abs().amax(dim=-1) > 1e-5


def expected_parameters(c: EncoderModelConfig) -> int:
    """Independent count, module by module, of the EuroBERT/Llama architecture."""
    head_dim = c.hidden_size // c.num_attention_heads
    q = c.hidden_size * c.num_attention_heads * head_dim
    k = v = c.hidden_size * c.num_query_groups * head_dim
    o = c.num_attention_heads * head_dim * c.hidden_size
    gate = up = c.hidden_size * c.ffn_hidden_size
    down = c.ffn_hidden_size * c.hidden_size
    norms = 2 * c.hidden_size
    per_layer = q + k + v + o + gate + up + down + norms
    embed = c.vocab_size * c.hidden_size
    head = 0 if c.tie_embeddings else c.vocab_size * c.hidden_size
    return embed + c.num_layers * per_layer + c.hidden_size + head


# The paper names these 210M/610M/1B: that is the count without the LM head (or tied).
PAPER_COUNTS = {
    "210m": (310_266_624, 211_766_016),
    "610m": (755_625_600, 607_874_688),
    "1b": (1_202_447_808, 980_821_440),  # 981M without the head: the paper's "1B"
}


@pytest.mark.parametrize("name", sorted(PAPER_COUNTS))
def test_paper_preset_parameter_counts(name):
    untied, tied = PAPER_COUNTS[name]
    for config, expected in ((preset(name), untied), (preset(name, tie_embeddings=True), tied)):
        assert expected_parameters(config) == expected == parameter_count(config)
        with torch.device("meta"):  # real allocation would need up to 5.6 GB
            model = build_encoder_model(config)
        assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize("tie", [False, True])
def test_tiny_parameter_count_and_names(tie):
    config = dataclasses.replace(TINY, tie_embeddings=tie)
    model = build(config)
    assert sum(p.numel() for p in model.parameters()) == expected_parameters(config)
    assert parameter_count(config) == expected_parameters(config)
    names = {n for n, _ in model.named_parameters()}
    assert {
        "embedding.word_embeddings.weight",
        "decoder.layers.3.input_layernorm.weight",
        "decoder.layers.3.self_attention.linear_qkv.weight",
        "decoder.layers.3.mlp.linear_fc1.weight",
        "decoder.final_layernorm.weight",
    } <= names
    assert ("output_layer.weight" in names) is not tie
    assert not [n for n in names if "bias" in n]


@pytest.mark.parametrize("j", [0, 5, 11, 23])
def test_causal_mode_hides_later_tokens(j):
    model = build()
    changed = changed_positions(model, random_ids(24, seed=1), j, causal=True)
    assert not changed[:j].any()
    assert changed[j:].all()


@pytest.mark.parametrize("j", [0, 11, 23])
def test_bidirectional_mode_sees_every_token(j):
    model = build()
    assert changed_positions(model, random_ids(24, seed=1), j, causal=False).all()


def test_same_weights_differ_between_modes():
    model = build()
    ids = random_ids(24, seed=2)
    with torch.no_grad():
        causal, bidirectional = run(model, ids, causal=True), run(model, ids, causal=False)
        causal_again = run(model, ids, causal=True)
    assert (causal - bidirectional).abs().amax() > 1e-2
    torch.testing.assert_close(causal, causal_again, rtol=0, atol=0)


def test_attention_pattern_encoding():
    ids = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9], [EOD, 5, 6, 7, 8, 9, 5, EOD]])
    document = [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]  # EOD ends its document
    for causal in (False, True):
        mask = explicit_document_mask(ids == EOD, causal=causal)
        expected = torch.tensor([
            [[(document[b][q] != document[b][k]) or (causal and k > q) for k in range(8)]
             for q in range(8)]
            for b in range(2)
        ])
        assert torch.equal(mask, expected[:, None])
    # Without documents no s x s mask and no cu_seqlens: the direction alone, in Megatron's
    # PackedSeqParams channel (qkv_format sbhd: the layers keep [s, b, h]).
    for causal in (False, True):
        pattern = attention_pattern(causal=causal)
        assert isinstance(pattern, PackedSeqParams) and pattern.qkv_format == "sbhd"
        assert pattern.causal == causal and pattern.documents is None and pattern.cu_seqlens_kv is None
    # Isolated documents: their starts in the [b * s] stream, the same for queries and keys.
    starts = [0, 3, 5, 6, 8, 9]
    for causal in (False, True):
        pattern = attention_pattern(causal=causal, document_ends=ids == EOD)
        assert pattern.causal == causal and pattern.cu_seqlens_kv is pattern.documents
        assert pattern.documents.dtype == torch.int32 and pattern.documents.tolist() == [*starts, 16]


def test_core_attention_refuses_what_it_would_misread():
    """Megatron's plain packed-sequence parameters (no direction: which one was meant?) and an
    explicit mask beside a causal or documented pattern are refused, not guessed at."""
    model = build()
    ids = random_ids(8, seed=6)
    plain = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32))
    with torch.no_grad(), pytest.raises(ValueError, match="takes model.attention.AttentionPattern.*not PackedSeqParams"):
        model(ids, packed_seq_params=plain)
    mask = explicit_document_mask(ids == EOD, causal=True)
    with torch.no_grad(), pytest.raises(ValueError, match="explicit attention_mask says alone"):
        model(ids, packed_seq_params=attention_pattern(causal=True), attention_mask=mask)
    with torch.no_grad():  # the explicit causal mask with a bidirectional pattern is the causal pattern
        torch.testing.assert_close(model(ids, packed_seq_params=AttentionPattern(), attention_mask=mask),
                                   run(model, ids, causal=True))


def test_the_rotary_base_is_an_argument_of_the_call_not_a_state_of_the_model():
    """A call's ``rotary_base`` gives the logits of a model built with that ``rotary_base``, and leaves
    the model as it was (a phase's base reaches the model per call)."""
    model = build()
    raised = build(dataclasses.replace(TINY, rotary_base=160_000.0))
    ids = random_ids(32, seed=7)
    with torch.no_grad():
        default = run(model, ids, causal=False)
        at_raised = run(model, ids, causal=False, rotary_base=160_000.0)
        torch.testing.assert_close(at_raised, run(raised, ids, causal=False), rtol=0, atol=0)
        assert (at_raised - default).abs().amax() > 1e-3
        torch.testing.assert_close(run(model, ids, causal=False), default, rtol=0, atol=0)
    assert model.encoder_config.rotary_base == TINY.rotary_base


def changed_in_documents(model, ids, j, *, causal):
    return changed_positions(model, ids, j, causal=causal, document_end_id=EOD)


def test_isolated_documents_attend_only_within_themselves():
    model = build()
    ids = random_ids(24, seed=3)
    ids[0, 7] = ids[0, 15] = EOD  # documents: [0, 7], [8, 15], [16, 23]
    docs = [slice(0, 8), slice(8, 16), slice(16, 24)]
    for causal in (False, True):
        for doc, j in ((0, 3), (1, 10), (2, 20)):
            changed = changed_in_documents(model, ids, j, causal=causal)
            inside = torch.zeros(24, dtype=torch.bool)
            inside[docs[doc]] = True
            assert not changed[~inside].any(), (causal, doc)
            assert changed[docs[doc]][(j - docs[doc].start) if causal else 0 :].all(), (causal, doc)


def test_isolated_documents_equal_running_documents_alone():
    """RoPE is relative, so an isolated document's logits do not depend on where it is packed."""
    model = build()
    ids = random_ids(24, seed=4)
    ids[0, 9] = EOD  # documents: [0, 9], [10, 23]
    with torch.no_grad():
        for causal in (False, True):
            packed = run(model, ids, causal=causal, document_end_id=EOD)
            torch.testing.assert_close(packed[:, :10], run(model, ids[:, :10], causal=causal))
            torch.testing.assert_close(packed[:, 10:], run(model, ids[:, 10:], causal=causal))


def test_position_ids():
    model = build()
    ids = random_ids(16, seed=5).repeat(2, 1)
    arange = torch.arange(16).repeat(2, 1)
    with torch.no_grad():
        default = run(model, ids, causal=False)
        torch.testing.assert_close(run(model, ids, causal=False, position_ids=arange), default)
        # Per-row positions; RoPE sees only differences, so a constant shift changes nothing.
        shifted = run(model, ids, causal=False, position_ids=arange + torch.tensor([[0], [100]]))
        torch.testing.assert_close(shifted, default, atol=1e-4, rtol=1e-4)
        reversed_ = run(model, ids, causal=False, position_ids=arange.flip(1))
    assert (reversed_ - default).abs().amax() > 1e-2


def test_labels_give_per_token_cross_entropy_and_gradients():
    model = build().train()
    ids = random_ids(24, seed=6).repeat(2, 1)
    labels = torch.roll(ids, -1, dims=1)
    labels[1, :5] = -100  # ignored positions: finite values, removed by the caller's loss mask
    loss = run(model, ids, causal=True, labels=labels)
    logits = run(model, ids, causal=True)
    assert loss.shape == (2, 24) and loss.dtype == torch.float32 and loss.isfinite().all()
    reference = F.cross_entropy(
        logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none"
    )
    keep = (labels >= 0).flatten()
    torch.testing.assert_close(loss.flatten()[keep], reference[keep])
    loss[labels >= 0].mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("tie", [False, True])
def test_lm_head_at_scored_positions_only_gives_the_same_loss_and_gradients(tie):
    """``loss_mask`` runs the head on the scored rows only: equal losses there, 0 elsewhere, and
    equal gradients of the masked loss sum for every parameter (tied embedding included)."""
    model = build(dataclasses.replace(TINY, tie_embeddings=tie), seed=3).train()
    ids = random_ids(24, seed=7).repeat(3, 1)
    labels = torch.roll(ids, -1, dims=1)
    gen = torch.Generator().manual_seed(0)
    loss_mask = (torch.rand(ids.shape, generator=gen) < 0.3).float()
    loss_mask[2] = 0.0  # a row with nothing scored

    def loss_and_grads(**kwargs):
        model.zero_grad(set_to_none=True)
        per_token = run(model, ids, causal=False, labels=labels, **kwargs)
        (per_token * loss_mask).sum().backward()
        return per_token.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    full, full_grads = loss_and_grads()
    keep = loss_mask > 0
    most = int(keep.sum(1).max())
    # Rows per sequence read from the mask (a host sync), a host-side bound above the largest
    # count (training: ObjectiveBatch.max_scored_per_sequence), and every position.
    for bound in (None, most + 3, ids.shape[1]):
        scored, scored_grads = loss_and_grads(loss_mask=loss_mask, max_scored_per_sequence=bound)
        assert scored.shape == full.shape and keep.sum() > 5
        torch.testing.assert_close(scored[keep], full[keep])
        assert (scored[~keep] == 0).all()
        for name, grad in full_grads.items():
            torch.testing.assert_close(scored_grads[name], grad, msg=f"{name}, bound {bound}")

    with torch.no_grad():  # nothing scored at all: an empty head, zero loss
        empty = run(model, ids, causal=False, labels=labels, loss_mask=torch.zeros_like(loss_mask))
    assert empty.shape == ids.shape and (empty == 0).all()


def test_matches_hugging_face_eurobert_and_llama():
    """Same weights: bidirectional == EuroBertForMaskedLM, causal == LlamaForCausalLM."""
    import transformers

    from megatron_ext.hf.name_map import Layout, megatron_to_hf

    model = build()
    c = TINY
    # The name map shared with the HF import/export tools (fused QKV per query group, [gate; up]).
    hf_state = megatron_to_hf(model.state_dict(), Layout(config=c, hf_vocab_size=c.vocab_size))
    shape = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_query_groups, rms_norm_eps=c.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": c.rotary_base},
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=EOD,
    )
    ids = random_ids(24, seed=7).repeat(2, 1)
    with torch.no_grad():
        for hf_class, config_class, causal in (
            (transformers.EuroBertForMaskedLM, transformers.EuroBertConfig, False),
            (transformers.LlamaForCausalLM, transformers.LlamaConfig, True),
        ):
            extra = {"mask_token_id": 3} if config_class is transformers.EuroBertConfig else {}
            hf = hf_class(config_class(**shape, **extra)).eval()
            missing, unexpected = hf.load_state_dict(hf_state, strict=False)
            assert not unexpected and not [k for k in missing if "rotary" not in k]
            torch.testing.assert_close(
                run(model, ids, causal=causal), hf(input_ids=ids).logits, atol=2e-5, rtol=1e-4
            )


def test_config_validation():
    with pytest.raises(ValueError, match="num_query_groups"):
        preset("tiny", num_query_groups=3)
    with pytest.raises(ValueError, match="transformer_impl"):
        preset("tiny", transformer_impl="flash")
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("7b")
    with pytest.raises(ValueError, match="seq_length"):
        run(build(), random_ids(TINY.seq_length + 1, seed=0), causal=False)


@pytest.mark.skipif(hardware.on_gpu(), reason="checks the CPU-only error paths")
def test_te_backend_errors_are_actionable():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    config = dataclasses.replace(TINY, transformer_impl="te")
    error = ImportError if not HAVE_TE else ValueError
    with pytest.raises(error, match="transformer_impl='local'"):
        build_encoder_model(config)


def test_one_tensor_parallel_rule_for_plan_builder_and_importer():
    """Whole query heads per rank, and whole KV groups or replicas of one (heads 4, groups 2)."""
    from megatron_ext.model.config import tensor_parallel_problem

    config = preset("tiny")
    assert [tp for tp in (1, 2, 3, 4, 8) if tensor_parallel_problem(config, tp) is None] == [1, 2, 4]
    assert "must divide num_attention_heads=4" in tensor_parallel_problem(config, 8)


@pytest.mark.parametrize("depth_scaled", [True, False])
def test_depth_scaled_init_only_shrinks_the_residual_output_projections(depth_scaled):
    """Megatron's default draws linear_proj and linear_fc2 from N(0, std / sqrt(2 L)); the authors'
    trainer (``depth_scaled_init: false``) draws every matrix from N(0, std). Norms start at 1."""
    layers, std = 8, 0.02
    config = dataclasses.replace(TINY, num_layers=layers, init_method_std=std, depth_scaled_init=depth_scaled)
    model = build(config)
    output_std = std / (2 * layers) ** 0.5 if depth_scaled else std
    for name, param in model.named_parameters():
        if param.dim() == 1:
            assert torch.equal(param, torch.ones_like(param)), name
            continue
        expected = output_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
        assert param.mean().item() == pytest.approx(0.0, abs=4 * expected / param.numel() ** 0.5), name
        assert param.std().item() == pytest.approx(expected, rel=0.05), name
