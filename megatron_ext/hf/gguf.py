"""Load a GGUF decoder (llama.cpp's format) as a ``transformers`` causal LM and tokenizer.

The weights are dequantised to float32 by ``transformers``' GGUF reader (PyPI ``gguf``), which
also undoes llama.cpp's q/k row permutation; the tokenizer is rebuilt from the file's
vocabulary and merges. Why not ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``:
in transformers 5 that path requires ``accelerate`` (for device maps this conversion never
uses) and keeps the weights quantised when GGUF kernels are installed; here the reader is called
directly and the tensors are loaded into a plain float32 model, strictly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_ext.config_loading import UserError


def load_gguf(path: str | Path, *, num_layers: int | None = None) -> tuple[Any, Any]:
    """The causal LM (float32, eval mode, tied embeddings tied) and fast tokenizer of a GGUF file.

    Args:
        path: A ``.gguf`` file of an architecture ``transformers`` reads (llama, mistral, qwen2 ...).
        num_layers: Keep only the first ``num_layers`` transformer layers (the final norm and the
            LM head are kept): a smaller, still real, model for quick tests. Default: all.

    Raises:
        UserError: ``path`` is not a file, or ``num_layers`` is out of range.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    if not path.is_file():
        raise UserError(f"GGUF file {path} does not exist")
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if num_layers is not None:
        if not 1 <= num_layers <= config.num_hidden_layers:
            raise UserError(f"num_layers must be in [1, {config.num_hidden_layers}], got {num_layers}")
        config.num_hidden_layers = num_layers
    config.name_or_path = str(path)
    with torch.device("meta"):  # only its parameter names are read, to map the GGUF tensor names
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=torch.float32)["tensors"]
    kept = {f"model.layers.{i}." for i in range(config.num_hidden_layers)}
    tensors = {k: v for k, v in tensors.items()
               if not k.startswith("model.layers.") or any(k.startswith(p) for p in kept)}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if config.tie_word_embeddings:  # the file stores the shared matrix once
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"{path}: GGUF tensors do not fit {type(model).__name__}: missing "
                           f"{missing[:8]}, unexpected {unexpected[:8]}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


__all__ = ["load_gguf"]
