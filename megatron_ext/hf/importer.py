"""Import a Hugging Face Llama-layout causal LM, or a EuroBERT encoder, as a Megatron checkpoint
for continued pretraining.

Output directory (``import_hf_model``; ``tools/import_hf_checkpoint.py`` wraps it)::

    <out>/iter_0000000/            Megatron dist checkpoint of the weights, saved at TP=1 (it loads
                                   at any tensor-parallel size), with run_config.json (``model``,
                                   ``tokenizer`` and ``hf_source`` sections) and
                                   tokenizer_reference.json
    <out>/latest_checkpointed_iteration.txt
    <out>/tokenizer/               the HF tokenizer, with its mask token set
    <out>/recipe_model.yaml        ``model``/``tokenizer``/``checkpoint`` sections for a CPT
                                   recipe: ``base: <out>/recipe_model.yaml``

Mask token of an encoder (``EuroBertForMaskedLM``): the one it was trained with, config.json's
``mask_token_id``; its rows are kept as trained. The tokenizer's mask token, if it has one, must be
that id (else the import is refused, naming both); a tokenizer without one gets the token at that
id (origin ``config``). ``mask_token=`` may only name that same token.

Mask token of a decoder (MLM needs one; decoders have none). Kept if the tokenizer has one. Else, if the vocab
has Llama-3's unused ``<|reserved_special_token_0|>`` (id 128002, EuroBERT's and the paper's mask
id), that token becomes the mask token; else a new special token ``<|mask|>`` is added. Either
way (not when kept) the mask token's embedding row, and its LM-head row, start as the mean of
the model's embedding (LM-head) rows: the reserved Llama-3 rows were never trained.

Vocabulary: ``vocab_size`` = max(HF embedding rows, tokenizer ids) padded to a multiple of
128 x ``tensor_parallel_size`` (Megatron's rule); every added row is the mean of the HF rows.
Export drops the padding again. Paths written into the files are absolute: after moving the
directory, edit ``tokenizer_model`` in recipe_model.yaml (and pass ``--tokenizer`` to export).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from megatron_ext.config_loading import UserError
from megatron_ext.hf.architectures import (
    ENCODER_MODEL_TYPES,
    UnsupportedArchitectureError,
    encoder_config_from_hf,
)
from megatron_ext.hf.name_map import Layout, drop_zero_o_proj_biases, hf_to_megatron
from megatron_ext.fileio import is_empty_dir_or_absent, publish_dir, staged_dir
from megatron_ext.checkpoint.single_process import save_weights, single_process_model_parallel
from megatron_ext.model import EncoderModelConfig
from megatron_ext.model.config import padded_vocab_size, tensor_parallel_problem
from megatron_ext.tokenizer import HUGGINGFACE, TokenizerConfig, build_tokenizer

LLAMA3_MASK_TOKEN = "<|reserved_special_token_0|>"
NEW_MASK_TOKEN = "<|mask|>"
TOKENIZER_DIR = "tokenizer"
RECIPE_SNIPPET = "recipe_model.yaml"
# EncoderModelConfig fields the snippet leaves to the user's recipe (how to train, not what).
_RUNTIME_FIELDS = ("transformer_impl", "attention_dropout", "hidden_dropout", "params_dtype")


@dataclass(frozen=True, kw_only=True)
class ImportResult:
    """What ``import_hf_model`` wrote."""

    output_dir: Path
    """The directory to give ``checkpoint.load`` (with ``finetune: true``)."""
    checkpoint: Path
    """The checkpoint itself (``<output_dir>/iter_0000000``)."""
    model_config: EncoderModelConfig
    """The derived architecture."""
    tokenizer_dir: Path
    """The saved tokenizer (mask token set)."""
    recipe: Path
    """The recipe snippet."""
    mask_token: str
    """The mask token."""
    mask_token_id: int
    """Its id."""
    mask_token_origin: str
    """``kept`` (the tokenizer had one), ``config`` (an encoder's, from its config's
    ``mask_token_id``), ``reused`` (an existing token) or ``added`` (new). Only ``reused`` and
    ``added`` tokens had their embedding (and LM-head) rows reset to the mean."""


def _set_encoder_mask_token(tokenizer: Any, hf_config: Any, requested: str | None) -> tuple[str, str]:
    """The trained mask token of an encoder (see the module docstring); returns (token, origin)."""
    mask_id = getattr(hf_config, "mask_token_id", None)
    if mask_id is None:
        raise UserError(f"the {hf_config.model_type} config has no mask_token_id: an encoder's "
                        "config.json must say which token it was trained to predict")
    if not 0 <= mask_id < len(tokenizer):
        raise UserError(f"config.json mask_token_id={mask_id} is not an id of the tokenizer "
                        f"({len(tokenizer)} ids): wrong tokenizer (pass --tokenizer)")
    token = tokenizer.convert_ids_to_tokens(mask_id)
    if tokenizer.mask_token is not None and tokenizer.mask_token_id != mask_id:
        raise UserError(
            f"config.json mask_token_id={mask_id} ({token!r}) but the tokenizer's mask token "
            f"{tokenizer.mask_token!r} is id {tokenizer.mask_token_id}: the encoder was trained with "
            "one of them; fix whichever is wrong (or pass the right --tokenizer)")
    if requested not in (None, token):
        raise UserError(f"--mask-token {requested!r}: this encoder was trained with mask token "
                        f"{token!r} (config.json mask_token_id={mask_id}); it cannot be changed")
    if tokenizer.mask_token is not None:
        return token, "kept"
    tokenizer.add_special_tokens({"mask_token": token})
    return token, "config"


def _set_mask_token(tokenizer: Any, requested: str | None) -> tuple[str, str]:
    """Give a decoder's ``tokenizer`` a mask token (see the module docstring); returns
    (token, origin)."""
    if tokenizer.mask_token is not None and requested in (None, tokenizer.mask_token):
        return tokenizer.mask_token, "kept"
    vocab = tokenizer.get_vocab()
    token = requested or (LLAMA3_MASK_TOKEN if LLAMA3_MASK_TOKEN in vocab else NEW_MASK_TOKEN)
    origin = "reused" if token in vocab else "added"
    tokenizer.add_special_tokens({"mask_token": token})
    return token, origin


def check_architecture(hf_config: Any, seq_length: int | None = None) -> int:
    """Raise :class:`UnsupportedArchitectureError` unless ``hf_config`` converts; returns the
    sequence length (``seq_length``, default the model's ``max_position_embeddings``)."""
    seq_length = seq_length or getattr(hf_config, "max_position_embeddings", None)
    if not seq_length:
        raise UserError("the model config has no max_position_embeddings: pass --seq-length")
    encoder_config_from_hf(hf_config, vocab_size=1, seq_length=seq_length)
    return seq_length


def _check_tensor_parallel(config: EncoderModelConfig, tp: int) -> None:
    if (problem := tensor_parallel_problem(config, tp)) is not None:
        raise UserError(f"--tensor-model-parallel-size {tp} does not fit this model: {problem}")


def _recipe_snippet(config: EncoderModelConfig, tokenizer_dir: Path, output_dir: Path,
                    source: str) -> str:
    model = {k: v for k, v in dataclasses.asdict(config).items()
             if k not in _RUNTIME_FIELDS and not (k == "kv_channels" and v is None)}
    body = {"model": model,
            "tokenizer": {"tokenizer_type": HUGGINGFACE, "tokenizer_model": str(tokenizer_dir)},
            "checkpoint": {"load": str(output_dir), "finetune": True}}
    header = (
        f"# Model, tokenizer and starting checkpoint of {source}, imported by\n"
        "# tools/import_hf_checkpoint.py. Continued pretraining: a recipe with\n"
        f"#   base: {output_dir / RECIPE_SNIPPET}\n"
        "# plus data, phases, schedule, training, checkpoint.save and logging. vocab_size is the\n"
        "# tokenizer's padded for the tensor-parallel size given at import (a multiple of 128 x TP);\n"
        "# seq_length is the longest input allowed (data.seq_length must not exceed it).\n"
    )
    return header + yaml.safe_dump(body, sort_keys=False)


def import_hf_model(
    model: Any,
    tokenizer: Any,
    output_dir: str | Path,
    *,
    tensor_parallel_size: int = 1,
    seq_length: int | None = None,
    mask_token: str | None = None,
    overwrite: bool = False,
    source: str | None = None,
    log: Callable[[str], None] = print,
) -> ImportResult:
    """Convert a loaded ``transformers`` causal LM or EuroBERT encoder and its tokenizer into a
    Megatron checkpoint.

    Args:
        model: A ``LlamaForCausalLM``-layout model (llama, mistral, qwen2, qwen3 model types) or
            an ``EuroBertForMaskedLM`` (eurobert), however it was loaded (directory, hub,
            GGUF ...). Not modified.
        tokenizer: Its ``transformers`` fast tokenizer. Not modified (a copy gets the mask).
        output_dir: Created; must be absent or empty unless ``overwrite``. Written atomically.
        tensor_parallel_size: Largest TP the run will use: pads the vocabulary to a multiple of
            128 x this and checks the head counts divide.
        seq_length: ``EncoderModelConfig.seq_length``; default the model's
            ``max_position_embeddings``.
        mask_token: The mask token to use (an existing token or a new one); default: see the
            module docstring. An encoder keeps its own (this may only name it).
        overwrite: Replace a non-empty ``output_dir``.
        source: Where the model came from, for the written metadata (default
            ``model.config.name_or_path``).
        log: Progress lines.

    Raises:
        UnsupportedArchitectureError: the architecture cannot be converted (names the field).
        UserError: a bad argument or output directory.
    """
    if tensor_parallel_size < 1:
        raise UserError(f"--tensor-model-parallel-size must be >= 1, got {tensor_parallel_size}")
    output_dir = Path(output_dir).resolve()
    if not overwrite and not is_empty_dir_or_absent(output_dir):
        raise UserError(f"output directory {output_dir} is not empty; pass --overwrite "
                        "(overwrite=True) to replace it")
    hf_config = model.config
    source = source or getattr(hf_config, "name_or_path", None) or type(model).__name__
    seq_length = check_architecture(hf_config, seq_length)

    tokenizer = copy.deepcopy(tokenizer)
    if hf_config.model_type in ENCODER_MODEL_TYPES:
        token, origin = _set_encoder_mask_token(tokenizer, hf_config, mask_token)
    else:
        token, origin = _set_mask_token(tokenizer, mask_token)
    with staged_dir(output_dir) as tmp:
        tokenizer.save_pretrained(tmp / TOKENIZER_DIR)
        encoder_tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=str(tmp / TOKENIZER_DIR)))
        mask_id = encoder_tokenizer.mask
        log(f"mask token {token!r} (id {mask_id}, {origin})")
        hf_rows = model.get_input_embeddings().weight.shape[0]
        vocab_size = padded_vocab_size(max(hf_rows, encoder_tokenizer.vocab_size),
                                       tensor_parallel_size)
        config = encoder_config_from_hf(hf_config, vocab_size=vocab_size, seq_length=seq_length)
        _check_tensor_parallel(config, tensor_parallel_size)
        log(f"{hf_config.model_type}: {config.num_layers} layers, hidden {config.hidden_size}, "
            f"heads {config.num_attention_heads}/{config.num_query_groups}, vocab {hf_rows} -> "
            f"{vocab_size} (padded for TP {tensor_parallel_size})")

        state = _megatron_state(model, config, hf_rows=hf_rows, mask_id=mask_id, mask_origin=origin)
        final_tokenizer = output_dir / TOKENIZER_DIR
        tokenizer_reference = dataclasses.asdict(
            TokenizerConfig(tokenizer_type=HUGGINGFACE, tokenizer_model=str(final_tokenizer)))
        run_config = {
            "model": dataclasses.asdict(config),
            "tokenizer": tokenizer_reference,
            "hf_source": {"source": str(source), "model_type": hf_config.model_type,
                          "architecture": type(model).__name__, "hf_vocab_size": hf_rows,
                          "mask_token": token, "mask_token_id": mask_id,
                          "mask_token_origin": origin},
        }
        log("saving the Megatron checkpoint")
        with single_process_model_parallel():
            checkpoint = save_weights(tmp, config, state, run_config=run_config, model_config=run_config["model"],
                                      tokenizer_reference=tokenizer_reference)
        (tmp / RECIPE_SNIPPET).write_text(
            _recipe_snippet(config, final_tokenizer, output_dir, str(source)))
        publish_dir(tmp, output_dir, overwrite=overwrite, identical_ok=False)
    log(f"wrote {output_dir} (checkpoint {checkpoint.name}, tokenizer, {RECIPE_SNIPPET})")
    return ImportResult(
        output_dir=output_dir, checkpoint=output_dir / checkpoint.name, model_config=config,
        tokenizer_dir=final_tokenizer, recipe=output_dir / RECIPE_SNIPPET, mask_token=token,
        mask_token_id=mask_id, mask_token_origin=origin,
    )


def _megatron_state(model: Any, config: EncoderModelConfig, *, hf_rows: int, mask_id: int,
                    mask_origin: str) -> dict[str, torch.Tensor]:
    """``model``'s weights in fp32 under the encoder's names (``hf_to_megatron``), the vocabulary
    padded; a mask token reused or added gets the mean of the real rows, as the padded rows do."""
    hf_config = model.config
    hf_state = {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()
                if "rotary_emb" not in k}  # RoPE buffers: the encoder computes its own
    if hf_config.model_type == "eurobert" and config.add_qkv_bias:
        hf_state = drop_zero_o_proj_biases(hf_state, config)
    state = hf_to_megatron(hf_state, Layout(config=config, hf_vocab_size=hf_rows))
    del hf_state
    if mask_origin in ("reused", "added"):
        for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if key in state:
                state[key][mask_id] = state[key][:hf_rows].mean(dim=0)
    return state


_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def _load_error(reference: str, what: str, error: Exception, flag: str) -> UserError:
    path = Path(reference).expanduser()
    if path.is_dir():
        return UserError(f"{flag} {reference}: cannot load the {what} from this directory: "
                         f"{error}")
    if path.exists():
        return UserError(f"{flag} {reference} is a file; expected a directory "
                         "(config.json, weights, tokenizer files) or a hub id")
    if _HUB_ID.match(reference) and not reference.startswith("."):
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return UserError(
            f"could not load the {what} of {reference!r} from the Hugging Face hub ({first_line}; "
            "no local directory of that name exists either). "
            "The hub may be unreachable from here: download the model where it is reachable "
            f"(e.g. `hf download {reference} --local-dir DIR`) and pass that local directory "
            f"to {flag}")
    return UserError(f"{flag} {reference}: no such directory")


_LOAD_ERRORS = (OSError, ValueError, KeyError)


def load_hf_config(reference: str, *, flag: str = "--hf-model") -> Any:
    """The ``transformers`` config of a model directory or hub id (errors name ``flag`` and say
    what to pass instead)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(reference)
    except _LOAD_ERRORS as error:
        raise _load_error(reference, "config (config.json)", error, flag) from error


def load_hf_model(reference: str, *, flag: str = "--hf-model") -> Any:
    """The causal LM (the masked LM of an encoder: ``ENCODER_MODEL_TYPES``) of a model directory
    or hub id, in its stored dtype.

    Raises:
        UnsupportedArchitectureError: stored tensors the class has no place for, or lacks (named).
        UserError: the weights cannot be loaded.
    """
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    model_type = load_hf_config(reference, flag=flag).model_type
    auto_class = AutoModelForMaskedLM if model_type in ENCODER_MODEL_TYPES else AutoModelForCausalLM
    try:
        model, info = auto_class.from_pretrained(reference, dtype="auto", output_loading_info=True)
    except _LOAD_ERRORS as error:
        raise _load_error(reference, "weights", error, flag) from error
    # transformers only warns about these: a tensor the class has no place for (e.g. an MLM head
    # with a dense + norm transform) would be dropped, a missing one randomly initialised.
    unexpected, missing = sorted(info["unexpected_keys"]), sorted(info["missing_keys"])
    if unexpected or missing:
        raise UnsupportedArchitectureError(
            f"{flag} {reference}: the stored weights do not fit {type(model).__name__}: tensors it "
            f"has no place for {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}, tensors "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return model.eval()


def load_hf_tokenizer(reference: str, *, flag: str = "--hf-model") -> Any:
    """The fast tokenizer of a model/tokenizer directory or hub id."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(reference)
    except _LOAD_ERRORS as error:
        raise _load_error(reference, "tokenizer", error, flag) from error


__all__ = ["ImportResult", "UnsupportedArchitectureError", "check_architecture", "import_hf_model",
           "load_hf_config", "load_hf_model", "load_hf_tokenizer"]
