"""Isolated documents on the Transformer Engine spec (``gpu``: skipped without CUDA and TE): the
THD route (``cu_seqlens``, no ``[s, s]`` mask) against the explicit-mask route and against each
document run alone, in bf16, causal and bidirectional; and its gradients against the mask's."""

from __future__ import annotations

import pytest
import torch

from megatron_ext import hardware, process_group
from megatron_ext.model.attention import attention_pattern, explicit_document_mask

pytestmark = pytest.mark.gpu
needs_te = pytest.mark.skipif(not torch.cuda.is_available() or not hardware.transformer_engine_available(),
                              reason="needs a CUDA GPU and Transformer Engine")
EOD = 2


@pytest.fixture(scope="module")
def te_model(tmp_path_factory):
    from megatron_ext.model import build_encoder_model, preset

    process_group.init_process_group_and_model_parallel(
        init_method=f"file://{tmp_path_factory.mktemp('pg')}/rendezvous", rank=0, world_size=1)
    torch.manual_seed(0)
    yield build_encoder_model(preset("tiny", vocab_size=1024, transformer_impl="te",
                                     params_dtype="bfloat16")).cuda().eval()
    process_group.destroy_process_group_and_model_parallel()


def _rows() -> torch.Tensor:
    ids = torch.randint(3, 1024, (3, 256), generator=torch.Generator().manual_seed(0))
    ids[0, [40, 41, 150]] = EOD  # a one-token document at 41, the last one cut by the row edge
    ids[1, 255] = EOD  # ends with its document
    return ids.cuda()  # row 2: no end of document


def _explicit(model, ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """The same forward with the ``[b, 1, s, s]`` mask (TE's ``arbitrary`` kernel) instead of THD."""
    return model(ids, packed_seq_params=attention_pattern(causal=False),
                 attention_mask=explicit_document_mask(ids == EOD, causal=causal))


@needs_te
@pytest.mark.parametrize("causal", [True, False], ids=["clm", "mlm"])
def test_thd_equals_the_explicit_mask_and_each_document_alone(te_model, causal):
    ids = _rows()
    with torch.no_grad():
        thd = te_model(ids, packed_seq_params=attention_pattern(causal=causal, document_ends=ids == EOD))
        torch.testing.assert_close(thd.float(), _explicit(te_model, ids, causal).float(), atol=3e-2, rtol=3e-2)
        for b, slices in enumerate([[slice(0, 41), slice(41, 42), slice(42, 151), slice(151, 256)],
                                    [slice(0, 256)], [slice(0, 256)]]):
            for document in slices:
                alone = te_model(ids[b:b + 1, document], packed_seq_params=attention_pattern(causal=causal))
                torch.testing.assert_close(thd[b:b + 1, document].float(), alone.float(), atol=3e-2, rtol=3e-2)


@needs_te
def test_thd_gradients_equal_the_explicit_masks(te_model):
    ids = _rows()
    grads = []
    for forward in (lambda: te_model(ids, packed_seq_params=attention_pattern(causal=False, document_ends=ids == EOD)),
                    lambda: _explicit(te_model, ids, False)):
        te_model.zero_grad()
        forward().float().square().mean().backward()
        grads.append(torch.cat([p.grad.float().flatten() for p in te_model.parameters() if p.grad is not None]))
    assert ((grads[0] - grads[1]).norm() / grads[1].norm()) < 2e-2
