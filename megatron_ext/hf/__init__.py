"""Hugging Face interop: import Llama-layout decoders and EuroBERT encoders, export encoders (and
decoders).

- ``import_hf_model`` (``tools/import_hf_checkpoint.py``): a ``transformers`` causal LM of model
  type llama (incl. SmolLM), mistral, qwen2 or qwen3, or an ``EuroBertForMaskedLM`` (eurobert,
  its trained mask token kept) -> a Megatron checkpoint plus the derived
  ``model`` recipe section and a tokenizer with a mask token, ready for continued pretraining
  (``checkpoint: {load: DIR, finetune: true}``).
- ``export_checkpoint`` (``tools/export_hf_checkpoint.py``): a checkpoint -> ``EuroBertForMaskedLM``
  with sentence-transformers files, or ``LlamaForCausalLM`` (or Mistral/Qwen2/Qwen3).
- ``name_map``: the one declarative parameter map both directions use.
- ``mlm_loss`` (import it from ``megatron_ext.hf.mlm_loss``): held-out MLM loss of a Hugging Face
  masked LM or a Megatron checkpoint, on the same masked inputs for both.

Conversions run in one process at tensor-parallel size 1; Megatron's dist checkpoints reshard
on load, so an import loads at any TP and an export reads a checkpoint saved at any TP.
"""

from megatron_ext.hf.architectures import (
    ENCODER_MODEL_TYPES,
    FORMATS,
    SUPPORTED_MODEL_TYPES,
    UnsupportedArchitectureError,
    encoder_config_from_hf,
)
from megatron_ext.hf.exporter import export_checkpoint
from megatron_ext.hf.importer import (
    ImportResult,
    check_architecture,
    import_hf_model,
    load_hf_config,
    load_hf_model,
    load_hf_tokenizer,
)
from megatron_ext.hf.name_map import Layout, hf_to_megatron, megatron_to_hf
from megatron_ext.checkpoint.single_process import load_megatron_checkpoint, single_process_model_parallel

__all__ = [
    "ENCODER_MODEL_TYPES",
    "FORMATS",
    "SUPPORTED_MODEL_TYPES",
    "ImportResult",
    "Layout",
    "UnsupportedArchitectureError",
    "check_architecture",
    "encoder_config_from_hf",
    "export_checkpoint",
    "hf_to_megatron",
    "import_hf_model",
    "load_hf_config",
    "load_hf_model",
    "load_hf_tokenizer",
    "load_megatron_checkpoint",
    "megatron_to_hf",
    "single_process_model_parallel",
]
