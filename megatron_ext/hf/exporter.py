"""Export a Megatron checkpoint as a Hugging Face model directory.

The architecture comes from the ``model`` section of the run config saved with the checkpoint
(``Checkpoint.model_config``), the tokenizer from its ``tokenizer_reference.json`` (or ``tokenizer=``).
The checkpoint is loaded in this one process at tensor-parallel size 1, whatever TP it was saved
at: Megatron's dist checkpoints store whole tensors and reshard on load, so no shards are
gathered by hand.

Output (``hf_format='eurobert'``, the encoder default)::

    config.json, model.safetensors                      EuroBertForMaskedLM (native in transformers 5)
    tokenizer.json, tokenizer_config.json, ...          with mask_token set (pad = eos if unset)
    modules.json, sentence_bert_config.json,            sentence-transformers: the encoder's last
    config_sentence_transformers.json,                  hidden states, mean-pooled
    1_Pooling/config.json

``config.json`` also records what the checkpoint's last step trained, as ``trained_objective``
(``{"name": "mntp-20", "prediction_offset": -1, "causal": false}``): where the output predicting
a masked token sits, which ``tools/fill_mask.py`` reads (None for a checkpoint without phases,
an import from Hugging Face).

``llama`` (``mistral``, ``qwen2``, ``qwen3``) writes that causal LM instead, without the
sentence-transformers files. The vocabulary is the tokenizer's (largest id + 1): Megatron's
padding rows are dropped. Written into a temporary directory, then renamed into place; an
existing directory holding the same files is left as is, one holding anything else is an error
unless ``overwrite``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_ext.config_loading import UserError
from megatron_ext.hf.architectures import FORMATS
from megatron_ext.hf.name_map import Layout, megatron_to_hf, zero_o_proj_biases
from megatron_ext.fileio import is_empty_dir_or_absent, publish_dir, staged_dir
from megatron_ext.checkpoint.single_process import load_megatron_checkpoint, single_process_model_parallel
from megatron_ext.tokenizer import (
    HuggingFaceTokenizer,
    MissingSpecialTokenError,
    TokenizerConfig,
    _load_transformers_tokenizer,
    build_tokenizer,
)
from megatron_ext.checkpoint.reader import TRAINED_OBJECTIVE, Checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _tokenizers(checkpoint: Checkpoint, tokenizer: str | None) -> tuple[HuggingFaceTokenizer, Any]:
    """This project's view of the checkpoint's tokenizer and the ``transformers`` one."""
    if tokenizer is not None:
        config, where = TokenizerConfig(tokenizer_model=tokenizer), f"--tokenizer {tokenizer}"
    else:
        config = checkpoint.tokenizer_config()
        where = f"{checkpoint}/tokenizer_reference.json ({config.tokenizer_model})"
    try:
        encoder_tokenizer = build_tokenizer(config)
    except ValueError as error:
        raise UserError(f"{where}: {error}; pass --tokenizer DIR") from error
    if not isinstance(encoder_tokenizer, HuggingFaceTokenizer):
        raise UserError(f"{where} is a {encoder_tokenizer.name}; export writes Hugging Face "
                        "tokenizer files: pass --tokenizer with a transformers tokenizer directory")
    # The same loading rules (directory, tokenizer.json, hub id) as the tokenizer built above.
    return encoder_tokenizer, _load_transformers_tokenizer(encoder_tokenizer.reference()["tokenizer_model"])


def _sentence_transformers_files(root: Path, hidden_size: int) -> None:
    """sentence-transformers 6 configuration: the encoder's last hidden states, mean-pooled."""
    files = {
        "modules.json": [
            {"idx": 0, "name": "0", "path": "",
             "type": "sentence_transformers.base.modules.transformer.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
        ],
        "sentence_bert_config.json": {
            "transformer_task": "feature-extraction",
            "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
            "module_output_name": "token_embeddings",
        },
        "config_sentence_transformers.json": {
            "model_type": "SentenceTransformer", "prompts": {}, "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
        "1_Pooling/config.json": {
            "embedding_dimension": hidden_size, "pooling_mode": "mean", "include_prompt": True,
        },
    }
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(content, indent=2) + "\n")


def export_checkpoint(
    checkpoint: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    hf_format: str = "eurobert",
    dtype: str = "float32",
    tokenizer: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Write ``checkpoint`` (a checkpoint, or a save directory: its newest) as a HF model.

    Args:
        checkpoint: Saved by ``pretrain_encoder.py`` or ``tools/import_hf_checkpoint.py``.
        output_dir: Created (atomically); see the module docstring for an existing one.
        hf_format: One of ``FORMATS``: ``eurobert`` (encoder), or a causal LM class.
        dtype: ``float32`` or ``bfloat16`` weights.
        tokenizer: A HF tokenizer directory to use instead of the checkpoint's reference.
        overwrite: Replace an existing different export.
        log: Progress lines.

    Returns:
        ``output_dir``, resolved.
    """
    if hf_format not in FORMATS:
        raise UserError(f"--format {hf_format!r}: expected one of {sorted(FORMATS)}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    export_format = FORMATS[hf_format]
    output_dir = Path(output_dir).resolve()
    is_empty_dir_or_absent(output_dir)  # a file there: fail before the work
    try:
        source = Checkpoint.open(checkpoint)
    except UserError as error:
        raise UserError(f"--checkpoint: {error}") from error
    config = source.model_config()
    export_format.check(config)
    encoder_tokenizer, hf_tokenizer = _tokenizers(source, tokenizer)
    vocab = encoder_tokenizer.vocab_size
    if vocab > config.vocab_size:
        raise UserError(f"the tokenizer has {vocab} ids but the model only {config.vocab_size} "
                        "embedding rows: wrong tokenizer (pass --tokenizer)")
    if hf_tokenizer.pad_token is None and hf_tokenizer.eos_token is not None:
        hf_tokenizer.pad_token = hf_tokenizer.eos_token  # Llama-3/EuroBERT convention: pad = eos
    hf_tokenizer.model_max_length = config.seq_length
    token_ids = {"bos": hf_tokenizer.bos_token_id, "eos": hf_tokenizer.eos_token_id,
                 "pad": hf_tokenizer.pad_token_id, "mask": hf_tokenizer.mask_token_id}
    if export_format.encoder:
        try:
            encoder_tokenizer.mask
        except MissingSpecialTokenError as error:
            raise UserError(f"--format {hf_format} needs a mask token: {error}") from error

    log(f"loading {source} (TP=1)")
    with single_process_model_parallel():
        model = load_megatron_checkpoint(source)
        state = model.state_dict()
    hf_state = megatron_to_hf(state, Layout(config=config, hf_vocab_size=vocab))
    del model, state
    if export_format.qkv_bias == "attention_bias" and config.add_qkv_bias:
        hf_state |= zero_o_proj_biases(config)  # the flag also adds an o_proj bias
    hf_state = {k: v.to("cpu", DTYPES[dtype]) for k, v in hf_state.items()}
    hf_config = export_format.hf_config(config, vocab_size=vocab, token_ids=token_ids, dtype=dtype)
    # The same key as a merged checkpoint's run config: config.json records what the weights last trained.
    setattr(hf_config, TRAINED_OBJECTIVE, source.trained_objective())
    _check_against_hf_class(export_format.architecture, hf_config, hf_state)

    from safetensors.torch import save_file

    with staged_dir(output_dir) as tmp:
        log(f"writing {export_format.architecture} ({dtype}, vocab {vocab})")
        hf_config.save_pretrained(tmp)
        save_file(hf_state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_tokenizer.save_pretrained(tmp)
        if export_format.encoder:
            _sentence_transformers_files(tmp, config.hidden_size)
        outcome = publish_dir(tmp, output_dir, overwrite=overwrite, identical_ok=True)
    log(f"{output_dir}: {outcome}")
    return output_dir


def _check_against_hf_class(architecture: str, hf_config: Any, hf_state: dict) -> None:
    """The tensors must be exactly what ``architecture`` expects (built on the meta device)."""
    import transformers

    with torch.device("meta"):
        reference = getattr(transformers, architecture)(hf_config)
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if hf_config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    got = {k: tuple(v.shape) for k, v in hf_state.items()}
    if got != expected:
        wrong = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
        raise RuntimeError(f"exported tensors do not fit {architecture}: {wrong[:8]}")
