"""Throughput accounting: FLOPs per token and model FLOPs utilisation (MFU).

Convention (stated next to every MFU figure): FLOPs/token = 6 * N + 12 * L * h * s, where N
counts the parameters of every matmul INCLUDING the LM head (computed over all positions) and
excluding the embedding lookup and norms, and the attention term is for FULL (bidirectional)
attention. Megatron-LM's own formula halves attention for causal masks; for an encoder that
undercounts, and we use the full term for CLM steps too so that figures are comparable across
phases (the kernels do skip the masked half for causal steps, so CLM MFU reads slightly high).
"""

from __future__ import annotations

from megatron_ext.model.config import EncoderModelConfig, layer_matmul_parameters

MFU_CONVENTION = "6*N(matmul params incl. LM head) + 12*L*h*s (full bidirectional attention)"

PEAK_TFLOPS = {
    # dense, no sparsity: (bf16, fp8)
    "H100": (989.0, 1979.0),
    "H200": (989.0, 1979.0),
    "A100": (312.0, None),
}


def matmul_parameters(config: EncoderModelConfig) -> int:
    """Parameters that take part in matmuls per token (LM head included, embedding lookup not)."""
    return config.num_layers * layer_matmul_parameters(config) + config.vocab_size * config.hidden_size


def flops_per_token(config: EncoderModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward), see the module docstring."""
    return 6.0 * matmul_parameters(config) + 12.0 * config.num_layers * config.hidden_size * seq_length


def peak_flops_per_device(device_name: str, *, fp8: bool = False) -> float | None:
    """Dense peak FLOP/s of a known GPU by (substring of) its name, else None."""
    for key, (bf16, f8) in PEAK_TFLOPS.items():
        if key in device_name:
            value = f8 if fp8 else bf16
            return value * 1e12 if value else None
    return None
