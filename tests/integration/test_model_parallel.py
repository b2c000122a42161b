"""Tensor parallelism: the TP=1 model's weights sharded over two gloo ranks give the same
logits, losses and gradients (fp32, CPU)."""

from __future__ import annotations


import torch
from megatron.core import parallel_state

from distributed import run_ranks
from megatron_ext.model.attention import attention_pattern
from megatron_ext import process_group
from megatron_ext.model import build_encoder_model, gather_vocab_parallel_logits, preset

WORLD = 2
EOD = 2
# GQA with one KV group per rank; the document mask exercises the explicit-mask path.
CONFIG = preset("tiny", vocab_size=1000)


def shard(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's slice of a full (TP=1) parameter, following Megatron's layouts."""
    if name.endswith(("embedding.word_embeddings.weight", "output_layer.weight")):
        return full.chunk(tp, dim=0)[rank]  # vocabulary-parallel rows
    if name.endswith("linear_qkv.weight"):
        # Rows are grouped per query group ([q heads, k, v] of group 0, then group 1, ...);
        # each rank owns num_query_groups / tp whole groups.
        by_group = full.view(CONFIG.num_query_groups, -1, full.shape[-1])
        return by_group.chunk(tp, dim=0)[rank].reshape(-1, full.shape[-1])
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)  # each rank holds [its gate rows; its up rows]
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, dim=1)[rank]  # row-parallel: input columns
    if name.endswith("layernorm.weight"):
        return full  # replicated
    raise AssertionError(f"no sharding rule for {name}")


def run(ids: torch.Tensor, model, labels: torch.Tensor, loss_mask: torch.Tensor):
    """Logits in both modes, the causal loss (full LM head), the bidirectional loss with the LM
    head at the scored positions only, and the gradients of both together."""
    model.zero_grad()
    with torch.no_grad():
        logits = {
            causal: gather_vocab_parallel_logits(model(ids, packed_seq_params=attention_pattern(causal=causal, document_ends=ids == EOD)))
            for causal in (True, False)
        }
    loss = model(ids, packed_seq_params=attention_pattern(causal=True, document_ends=ids == EOD), labels=labels)
    scored = model(ids, packed_seq_params=attention_pattern(causal=False, document_ends=ids == EOD), labels=labels,
                       loss_mask=loss_mask)
    (loss.mean() + (scored * loss_mask).sum() / loss_mask.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits, torch.cat([loss.detach(), scored.detach()]), grads


def worker(rank: int, rendezvous: str) -> None:
    process_group.init_process_group_and_model_parallel(
        tensor_parallel_size=1, init_method=rendezvous, rank=rank, world_size=WORLD
    )
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, CONFIG.vocab_size, (2, 32), generator=generator)
    ids[0, 12] = EOD
    labels = torch.roll(ids, -1, dims=1)
    loss_mask = (torch.rand(ids.shape, generator=generator) < 0.4).float()

    torch.manual_seed(1)
    reference = build_encoder_model(CONFIG)
    full_state = reference.state_dict()
    ref_logits, ref_loss, ref_grads = run(ids, reference, labels, loss_mask)

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    torch.manual_seed(2)  # different init: every value must come from the loaded shards
    model = build_encoder_model(CONFIG)
    assert model.output_layer.weight.shape[0] == CONFIG.vocab_size // WORLD
    shards = {n: shard(n, t, rank, WORLD) for n, t in full_state.items() if "_extra" not in n}
    missing, unexpected = model.load_state_dict(shards, strict=False)
    assert not unexpected and not [n for n in missing if "_extra_state" not in n]
    logits, loss, grads = run(ids, model, labels, loss_mask)

    for causal in (True, False):
        torch.testing.assert_close(logits[causal], ref_logits[causal], atol=1e-5, rtol=1e-5)
    assert (logits[True] - logits[False]).abs().amax() > 1e-2
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(
            grad, shard(name, ref_grads[name], rank, WORLD), atol=1e-5, rtol=1e-4, msg=name
        )
    process_group.destroy_process_group_and_model_parallel()


def test_tensor_parallel_matches_single_rank(tmp_path):
    run_ranks(worker, world=WORLD, tmp_path=tmp_path)
