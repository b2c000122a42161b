"""Helpers shared by the test modules (imported as ``helpers``: tests/ is on ``pythonpath``)."""

from __future__ import annotations

from pathlib import Path


def tiny_recipe(corpus: dict[str, str], run_dir: Path, **sections) -> dict:
    """A complete run config (as a dict) for a 2-layer model on ``corpus`` writing under ``run_dir``:
    8 steps, CLM then MLM-40; ``sections`` replace keys of a section (or a whole non-dict section)."""
    recipe = {
        "model": {"preset": "tiny", "vocab_size": 1024, "num_layers": 2, "hidden_size": 64,
                  "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2},
        "tokenizer": {"tokenizer_model": corpus["tokenizer"]},
        "data": {"data_path": [corpus["data"]], "split": "90,10,0", "seq_length": 64,
                 "micro_batch_size": 4, "global_batch_size": 8, "eval_iters": 1,
                 "data_cache_path": str(run_dir / "index_cache")},
        "schedule": {"lr": 3e-3, "lr_decay_style": "wsd", "lr_warmup_iters": 2, "lr_wsd_decay_iters": 2},
        "phases": [{"objective": "clm", "share": 0.5}, {"objective": "mlm", "mask_ratio": 0.4, "share": 0.5}],
        "training": {"train_iters": 8, "eval_interval": 4, "log_interval": 1},
        "checkpoint": {"save": str(run_dir / "ckpt"), "save_interval": 4},
        "logging": {"log_dir": str(run_dir / "log"), "wandb_mode": "disabled"},
    }
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(recipe.get(section), dict):
            recipe[section] = {**recipe[section], **values}
        else:
            recipe[section] = values
    return recipe


def assert_export_has_its_logits(checkpoint, hf_dir: Path, *, batch: int = 2, length: int = 48) -> None:
    """The ``EuroBertForMaskedLM`` exported into ``hf_dir`` computes the Megatron ``checkpoint``'s
    bidirectional logits (one document of ``length`` random ids per row) to 1e-5."""
    import torch
    import transformers

    from megatron_ext.hf import load_megatron_checkpoint, single_process_model_parallel
    from megatron_ext.model.attention import attention_pattern

    hf = transformers.EuroBertForMaskedLM.from_pretrained(hf_dir).eval()
    ids = torch.randint(4, 1024, (batch, length), generator=torch.Generator().manual_seed(0))
    with single_process_model_parallel(), torch.no_grad():
        ours = load_megatron_checkpoint(checkpoint)(ids, packed_seq_params=attention_pattern(causal=False))
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours[..., : theirs.shape[-1]], atol=1e-5, rtol=1e-5)


def unmarked_bpe_dir(texts: list[str], directory: Path) -> Path:
    """A BPE tokenizer directory trained on ``texts`` behind a whitespace pre-tokenizer: its pieces
    carry no word mark ('hello', 'ing'), so its ids do not say where words begin; 1,024 ids with
    [UNK], [SEP] (eos) and [MASK]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.BPEDecoder()
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1024, special_tokens=["[UNK]", "[SEP]", "[MASK]"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[SEP]",
                            mask_token="[MASK]").save_pretrained(directory)
    return directory


RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"
"""The shipped recipes."""


def shipped_recipe_config(recipe: str, **training):
    """A shipped recipe (``RECIPES / recipe``; a size base gets MLM-40 as its one phase) as a
    ``RunConfig``, with ``training`` fields replaced."""
    from megatron_ext.training.recipe import read_recipe, run_config_from_dict

    raw = read_recipe(RECIPES / recipe)
    raw.setdefault("phases", [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}])
    raw.setdefault("training", {}).update(training)
    return run_config_from_dict(raw)
