"""Training FLOPs per token and the convention model FLOPs utilisation (MFU) is stated in.

Convention (stated next to every MFU figure): FLOPs/token = 6 * N + 12 * L * h * s, where N
counts the parameters of every matmul INCLUDING the LM head, excluding the embedding lookup and
norms, and the attention term is for FULL (bidirectional) attention. The LM head (V * h) counts
where it is computed: at every position, or with ``training.lm_head_scored_only`` on MLM steps
at the scored (masked) share of positions only, so MFU is not inflated by FLOPs never run.
Megatron-LM's own formula halves attention for causal masks; for an encoder that undercounts,
and we use the full term for CLM steps too so that figures are comparable across phases (the
kernels do skip the masked half for causal steps, so CLM MFU reads slightly high).

With isolated documents (``data.reset_attention_mask``) a row's attention is computed per document:
a document of ``d`` tokens costs ``d^2``, so the row's attention term is ``12 * L * h * sum(d^2) / s``
per token instead of ``12 * L * h * s``. ``flops_per_token(attended=)`` takes that mean number of
keys per query (:func:`packed_attention` of the documents' lengths); ``--dry-run`` and the cost model
estimate it from the data (``training.dry_run.document_attention``) and state
:data:`ISOLATED_DOCUMENTS_CONVENTION`. The step
log's MFU keeps :data:`MFU_CONVENTION` (full rows), like the throughput measurements.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_ext.model.config import EncoderModelConfig, layer_matmul_parameters
from megatron_ext.phases import ResolvedPhase

_MATMUL_CONVENTION = "6*N(matmul params incl. LM head, the head counted at the positions where it runs)"
MFU_CONVENTION = _MATMUL_CONVENTION + " + 12*L*h*s (full bidirectional attention)"
ISOLATED_DOCUMENTS_CONVENTION = (_MATMUL_CONVENTION + " + 12*L*h*sum(d^2)/s (attention within each document d "
                                 "of a row of s tokens: data.reset_attention_mask)")


def flops_per_token(config: EncoderModelConfig, seq_length: int, *, lm_head_share: float = 1.0,
                    attended: float | None = None) -> float:
    """Training FLOPs per token (forward + backward), see the module docstring.

    ``lm_head_share``: share of the positions at which the LM head runs (see ``lm_head_share``).
    ``attended``: keys each query attends to, on average (default ``seq_length``: full rows; with
    isolated documents ``sum(d^2) / s`` over a row's documents, which is at most ``seq_length``).
    """
    body = config.num_layers * layer_matmul_parameters(config)
    head = config.vocab_size * config.hidden_size
    keys = seq_length if attended is None else attended
    return 6.0 * (body + lm_head_share * head) + 12.0 * config.num_layers * config.hidden_size * keys


def lm_head_share(phase: ResolvedPhase, step: int, *, seq_length: int, scored_only: bool) -> float:
    """Share of ``step``'s positions at which the LM head runs in ``phase``: all of them, unless
    ``training.lm_head_scored_only`` limits the head to the positions the objective scores."""
    return phase.objective.lm_head_share(phase.progress(step), seq_length=seq_length) if scored_only else 1.0


def mean_lm_head_share(phase: ResolvedPhase, *, seq_length: int, scored_only: bool,
                       steps: range | None = None) -> float:
    """:func:`lm_head_share` averaged over the steps of ``phase`` (its total FLOPs), or over
    ``steps`` of it (a segment of a run that trains part of the phase)."""
    steps = steps if steps is not None else range(phase.start, phase.end)
    ends = {lm_head_share(phase, step, seq_length=seq_length, scored_only=scored_only) for step in (steps[0], steps[-1])}
    if ends == {peak_lm_head_share(phase, seq_length=seq_length, scored_only=scored_only)}:
        return ends.pop()  # a constant share (schedules are monotone): no need to visit every step
    shares = [lm_head_share(phase, step, seq_length=seq_length, scored_only=scored_only)
              for step in steps]
    if len(set(shares)) == 1:  # a constant share as it is (a mean of equal floats may move its last bit)
        return shares[0]
    return math.fsum(shares) / len(shares)


def peak_lm_head_share(phase: ResolvedPhase, *, seq_length: int, scored_only: bool) -> float:
    """The largest :func:`lm_head_share` of any step of ``phase`` (what memory must hold)."""
    return phase.objective.peak_lm_head_share(seq_length=seq_length) if scored_only else 1.0


def packed_attention(document_lengths: np.ndarray, seq_length: int, tokens: int) -> tuple[float, float, int]:
    """``(keys per query, mean segment, tokens packed)`` of rows of ``seq_length`` cut from
    ``document_lengths`` laid end to end (GPTDataset's packing: a document may start in one row and
    end in the next; a row's edge ends its piece), each piece attending only within itself: per row,
    ``sum(d^2)`` over its pieces, divided by the tokens. Whole rows, at most ``tokens`` of them, one at
    least (a corpus shorter than a row repeats, as Megatron's epochs do). Equal to ``seq_length``
    when every row holds one document."""
    lengths = np.asarray(document_lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    total = int(lengths.sum())
    if total == 0:
        raise ValueError("no tokens")
    span = max(1, min(tokens, total) // seq_length) * seq_length
    ends = np.cumsum(np.tile(lengths, -(-span // total)))
    cuts = np.union1d(ends[ends < span], np.arange(seq_length, span, seq_length))
    pieces = np.diff(np.concatenate([[0], cuts, [span]])).astype(np.float64)
    return float(np.square(pieces).sum() / span), span / pieces.size, span
