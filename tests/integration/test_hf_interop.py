"""Hugging Face interop (CPU, fp32): tiny random Llama, Mistral, Qwen2 (q/k/v biases), Qwen3
(q/k norm, head_dim != hidden/heads) and SmolLM-like (tied embeddings) decoders and a EuroBERT
encoder (bidirectional) imported into Megatron checkpoints and exported back, logits compared at
atol = rtol = 1e-5; round trips, tensor-parallel loading, continued pretraining from an import
(a decoder with MLM; EuroBERT with a CLM detour then MLM), sentence-transformers, errors."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from distributed import run_ranks
from megatron_ext.model.attention import attention_pattern
from megatron_ext import hardware, process_group
from megatron_ext.hf import (
    FORMATS,
    UnsupportedArchitectureError,
    encoder_config_from_hf,
    export_checkpoint,
    import_hf_model,
    load_megatron_checkpoint,
    single_process_model_parallel,
)
from megatron_ext.model import build_encoder_model, gather_vocab_parallel_logits, parameter_count
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.config_loading import UserError
from megatron_ext.cli import export_hf_checkpoint, import_hf_checkpoint

TOL = {"atol": 1e-5, "rtol": 1e-5}
RESERVED = "<|reserved_special_token_0|>"


@dataclass(frozen=True)
class Family:
    config_class: str
    model_class: str
    config: dict
    export_format: str
    tokenizer: str
    """``plain`` (no mask token: one is added), ``reserved`` (Llama-3's reserved token is
    reused), ``mask`` (the tokenizer already has one)."""
    causal: bool = True
    """The HF model's attention (False: an encoder, compared with the bidirectional logits)."""


FAMILIES = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM",
                    {"rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0},
                     "rms_norm_eps": 1e-5}, "llama", "reserved"),
    "mistral": Family("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}, "mistral", "plain"),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", {}, "qwen2", "mask"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}, "qwen3", "plain"),
    "smollm": Family("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}, "llama", "plain"),
    # mask_token_id: the "mask" tokenizer's <mask> (its 320 BPE ids, then <mask>); pad: EuroBERT's
    # default (128001) is no id of this vocabulary.
    "eurobert": Family("EuroBertConfig", "EuroBertForMaskedLM",
                       {"mask_token_id": 320, "pad_token_id": 1, "rms_norm_eps": 1e-6,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 250_000.0}},
                       "eurobert", "mask", causal=False),
}
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


@dataclass
class Imported:
    family: Family
    hf: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerFast
    result: object  # ImportResult

    @property
    def hf_rows(self) -> int:
        return self.hf.config.vocab_size


@pytest.fixture(scope="module")
def base_tokenizer_json(news_texts) -> str:
    """A byte-level BPE (320 ids, <s> prepended like Llama) trained on real news articles."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(news_texts, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok.to_str()


def make_tokenizer(base_json: str, kind: str) -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(base_json), bos_token="<s>", eos_token="</s>")
    if kind == "reserved":
        tok.add_tokens([RESERVED], special_tokens=True)
    elif kind == "mask":
        tok.add_special_tokens({"mask_token": "<mask>"})
    return tok


def make_hf_model(family: Family, vocab_size: int, seed: int = 0) -> transformers.PreTrainedModel:
    config = getattr(transformers, family.config_class)(
        vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, **SHAPE, **family.config)
    model = getattr(transformers, family.model_class)(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every tensor random (HF zero-initialises biases, ones norms)
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return model


@pytest.fixture(scope="module")
def imports(tmp_path_factory, base_tokenizer_json):
    """``imports(name)``: the family's HF model imported (once per module)."""
    cache: dict[str, Imported] = {}

    def get(name: str) -> Imported:
        if name not in cache:
            family = FAMILIES[name]
            tokenizer = make_tokenizer(base_tokenizer_json, family.tokenizer)
            hf = make_hf_model(family, len(tokenizer))
            out = tmp_path_factory.mktemp("imports") / name
            result = import_hf_model(hf, tokenizer, out, log=lambda _: None)
            cache[name] = Imported(family, hf, tokenizer, result)
        return cache[name]

    return get


def random_ids(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


def megatron_logits(checkpoint: Path, ids: torch.Tensor) -> dict[bool, torch.Tensor]:
    """{causal: logits} of the checkpoint, loaded at TP=1."""
    with single_process_model_parallel(), torch.no_grad():
        model = load_megatron_checkpoint(checkpoint)
        assert sum(p.numel() for p in model.parameters()) == parameter_count(model.encoder_config)
        ids = ids.to(hardware.device())
        return {causal: model(ids, packed_seq_params=attention_pattern(causal=causal)).cpu()
                for causal in (True, False)}


def expected_vocab_rows(original: torch.Tensor, imp: Imported, rows: int) -> torch.Tensor:
    """What the import promises: the HF rows, then mean rows; a new mask token's row = mean."""
    mean = original.mean(dim=0)
    out = torch.cat([original, mean.expand(rows - original.shape[0], -1)])
    if imp.result.mask_token_origin != "kept":
        out[imp.result.mask_token_id] = mean
    return out


def assert_vocab_rows(got: torch.Tensor, original: torch.Tensor, imp: Imported) -> None:
    expected = expected_vocab_rows(original, imp, got.shape[0])
    untouched = torch.ones(got.shape[0], dtype=torch.bool)
    untouched[original.shape[0]:] = False
    if imp.result.mask_token_origin != "kept":
        untouched[imp.result.mask_token_id] = False
    assert torch.equal(got[untouched], expected[untouched])
    torch.testing.assert_close(got[~untouched], expected[~untouched], atol=1e-7, rtol=0)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_import_then_export_matches_hugging_face(name, imports, tmp_path):
    imp = imports(name)
    result, rows = imp.result, imp.hf_rows
    config = result.model_config
    assert config.vocab_size % 128 == 0 and config.vocab_size >= rows
    assert (config.add_qkv_bias, config.qk_layernorm) == (name == "qwen2", name == "qwen3")
    assert config.kv_channels == (32 if name == "qwen3" else None)
    assert config.tie_embeddings == (name == "smollm")
    assert result.mask_token_origin == {"plain": "added", "reserved": "reused", "mask": "kept"}[
        imp.family.tokenizer]
    saved_tokenizer = transformers.AutoTokenizer.from_pretrained(result.tokenizer_dir)
    assert saved_tokenizer.mask_token_id == result.mask_token_id
    assert imp.tokenizer.mask_token is None or name in ("qwen2", "eurobert")  # caller's copy unchanged
    assert config.rotary_base == imp.hf.config.rope_parameters["rope_theta"]
    assert config.norm_epsilon == imp.hf.config.rms_norm_eps

    # HF -> Megatron: causal (EuroBERT: bidirectional) logits equal HF's over the HF vocabulary,
    # except a reused mask token's (its rows were reset to the mean; kept out of the inputs too).
    ids = random_ids(rows)
    same = torch.ones(rows, dtype=torch.bool)
    if result.mask_token_origin == "reused":
        same[result.mask_token_id] = False
        ids[ids == result.mask_token_id] = 5
    with torch.no_grad():
        reference = imp.hf(input_ids=ids).logits
    logits = megatron_logits(result.output_dir, ids)
    torch.testing.assert_close(logits[imp.family.causal][..., :rows][..., same], reference[..., same],
                               **TOL)
    assert (logits[True] - logits[False]).abs().amax() > 1e-2

    # Megatron -> HF: EuroBERT = bidirectional, a causal LM = causal; the padding is dropped.
    vocab = len(saved_tokenizer)
    exports = {"eurobert": (transformers.EuroBertForMaskedLM, False),
               "llama": (transformers.LlamaForCausalLM, True),
               imp.family.export_format: (getattr(transformers, imp.family.model_class),
                                          imp.family.causal)}
    for hf_format, (cls, causal) in exports.items():
        out = tmp_path / hf_format
        if name == "qwen3" and hf_format != "qwen3":
            with pytest.raises(UnsupportedArchitectureError, match=r"qk_layernorm=True .* --format qwen3"):
                export_checkpoint(result.output_dir, out, hf_format=hf_format, log=lambda _: None)
            assert not out.exists()
            continue
        export_checkpoint(result.output_dir, out, hf_format=hf_format, log=lambda _: None)
        exported = cls.from_pretrained(out).eval()
        assert exported.config.vocab_size == vocab
        with torch.no_grad():
            torch.testing.assert_close(exported(input_ids=ids).logits, logits[causal][..., :vocab], **TOL)

    # HF -> Megatron -> HF (same family): every tensor as it was; new vocab rows = mean.
    original, back = imp.hf.state_dict(), exported.state_dict()
    assert back.keys() == original.keys()
    for key, tensor in original.items():
        if key in ("model.embed_tokens.weight", "lm_head.weight"):
            assert_vocab_rows(back[key], tensor, imp)
        else:
            assert torch.equal(back[key], tensor), key


def test_sentence_transformers_mean_pooling(imports, tmp_path):
    from sentence_transformers import SentenceTransformer

    imp = imports("llama")
    out = tmp_path / "encoder"
    assert export_hf_checkpoint.main(["--checkpoint", str(imp.result.output_dir),
                                      "--output-dir", str(out)]) == 0
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                 "1_Pooling/config.json"):
        assert (out / name).is_file(), name
    sentences = ["The cat sat on the mat.", "Australia's prime minister said on Tuesday that the "
                 "talks would continue into next week."]
    embeddings = SentenceTransformer(str(out), device="cpu").encode(sentences, convert_to_tensor=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token == "</s>" and tokenizer.mask_token == RESERVED
    encoder = transformers.EuroBertModel.from_pretrained(out).eval()
    with torch.no_grad():  # one sentence at a time: no padding involved
        expected = torch.stack([
            encoder(**tokenizer(s, return_tensors="pt")).last_hidden_state[0].mean(dim=0)
            for s in sentences])
    assert embeddings.shape == (2, 64)
    torch.testing.assert_close(embeddings, expected, **TOL)


def _tp2_worker(rank: int, rendezvous: str, checkpoint: str, ids: torch.Tensor,
                reference: torch.Tensor) -> None:
    torch.set_num_threads(1)
    process_group.init_process_group_and_model_parallel(
        tensor_parallel_size=2, init_method=rendezvous, rank=rank, world_size=2)
    saved = Checkpoint.open(checkpoint)
    model = build_encoder_model(saved.model_config()).eval()
    saved.load(model=model)
    with torch.no_grad():
        logits = gather_vocab_parallel_logits(model(ids, packed_seq_params=attention_pattern(causal=True)))
    torch.testing.assert_close(logits[..., :reference.shape[-1]], reference, **TOL)
    process_group.destroy_process_group_and_model_parallel()


def test_import_at_tp1_loads_at_tp2(tmp_path, base_tokenizer_json):
    """Qwen2 (q/k/v biases, 2 KV groups: one per rank), vocab padded for TP 2."""
    family = FAMILIES["qwen2"]
    tokenizer = make_tokenizer(base_tokenizer_json, family.tokenizer)
    hf = make_hf_model(family, len(tokenizer), seed=3)
    result = import_hf_model(hf, tokenizer, tmp_path / "qwen2", tensor_parallel_size=2,
                             log=lambda _: None)
    assert result.model_config.vocab_size % 256 == 0
    ids = random_ids(len(tokenizer), seed=4)
    with torch.no_grad():
        reference = hf(input_ids=ids).logits
    run_ranks(_tp2_worker, str(result.checkpoint), ids, reference, world=2, tmp_path=tmp_path)


def _cpt_recipe(imported: Imported, tmp_path: Path, news_texts) -> Path:
    """A 2-step MLM recipe continuing from ``imported`` (its recipe_model.yaml as the base)."""
    from megatron_ext.data.preprocess import PreprocessConfig, preprocess
    from megatron_ext.tokenizer import TokenizerConfig

    jsonl = tmp_path / "news.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in news_texts[:80]))
    preprocess(PreprocessConfig(
        inputs=(str(jsonl),), output_prefix=str(tmp_path / "news"), append_eod=True,
        tokenizer=TokenizerConfig(tokenizer_model=str(imported.result.tokenizer_dir)), progress=False))
    recipe = {
        "base": str(imported.result.recipe),
        "data": {"data_path": [str(tmp_path / "news_text_document")], "split": "90,10,0",
                 "seq_length": 32, "micro_batch_size": 4, "global_batch_size": 4, "eval_iters": 1,
                 "data_cache_path": str(tmp_path / "cache")},
        "schedule": {"lr": 1e-3, "lr_decay_style": "constant"},
        "phases": [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}],
        "training": {"train_iters": 2, "eval_interval": 0, "log_interval": 1},
        "checkpoint": {"save": str(tmp_path / "cpt")},
        "logging": {"log_dir": str(tmp_path / "log"), "wandb_mode": "disabled"},
    }
    path = tmp_path / "cpt.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_continued_pretraining_from_an_import(imports, tmp_path, news_texts):
    """pretrain_encoder's loop loads the import (finetune) through recipe_model.yaml; a recipe of
    another shape is refused: against the run's own checkpoint as another model, against the
    import with the mismatching tensors listed."""
    from megatron_ext.training.recipe import read_recipe, run_config_from_dict
    from megatron_ext.training.loop import pretrain

    imp = imports("smollm")
    raw = read_recipe(_cpt_recipe(imp, tmp_path, news_texts))
    assert raw["checkpoint"] == {"load": str(imp.result.output_dir), "finetune": True,
                                 "save": str(tmp_path / "cpt")}
    result = pretrain(run_config_from_dict(raw))
    assert result.start_step == 0 and result.final_step == 2
    assert all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())

    raw["model"]["ffn_hidden_size"] = 96
    # Its own checkpoint comes first (an interrupted continued pretraining resumes itself): refused.
    with pytest.raises(ValueError, match=r"changes what its weights mean:\n  model.ffn_hidden_size: 128 -> 96"):
        pretrain(run_config_from_dict(raw))
    raw["checkpoint"]["save"] = str(tmp_path / "cpt_other_shape")  # a new run: the import's weights do not fit
    with pytest.raises(ValueError, match=r"does not fit the model(.|\n)*linear_fc1"):
        pretrain(run_config_from_dict(raw))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not hardware.transformer_engine_available(),
                    reason="needs Transformer Engine")
def test_continued_pretraining_from_an_import_with_transformer_engine(imports, tmp_path, news_texts):
    """The import (a local-spec checkpoint, no TE ``_extra_state``) continues under the ``te``
    spec: its weights load, and the first step's loss is the local spec's within bf16 rounding
    (the same weights, batch and masks; only the kernels differ)."""
    from megatron_ext.training.recipe import read_recipe, run_config_from_dict
    from megatron_ext.training.loop import pretrain

    imp = imports("llama")
    raw = read_recipe(_cpt_recipe(imp, tmp_path, news_texts))
    first = {}
    for backend in ("local", "te"):
        raw["model"]["transformer_impl"] = backend
        raw["training"]["bf16"] = True
        raw["checkpoint"]["save"] = str(tmp_path / f"cpt_{backend}")
        result = pretrain(run_config_from_dict(raw))
        assert result.final_step == 2 and all(math.isfinite(v) for v in result.losses.values())
        first[backend] = result.losses[1]
    assert first["te"] == pytest.approx(first["local"], rel=2e-2)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
HF_CONFIG_ERRORS = {  # id: (config, expected message)
    "gpt2": (lambda: transformers.GPT2Config(),
             r"model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3, eurobert"),
    "moe": (lambda: transformers.Qwen2MoeConfig(**SHAPE),
            r"model_type 'qwen2_moe' is not supported \(mixture-of-experts"),
    "rope_scaling": (lambda: transformers.LlamaConfig(**SHAPE, rope_parameters=LLAMA3_ROPE),
                     r"rope_parameters.rope_type 'llama3' \(RoPE scaling"),
    "activation": (lambda: transformers.LlamaConfig(**SHAPE, hidden_act="gelu"), r"hidden_act 'gelu'"),
    "mlp_bias": (lambda: transformers.LlamaConfig(**SHAPE, mlp_bias=True),
                 r"mlp_bias=True \(biases in the MLP\)"),
    "eurobert_mlp_bias": (lambda: transformers.EuroBertConfig(**SHAPE, mlp_bias=True),
                          r"mlp_bias=True \(biases in the MLP and on EuroBERT's lm_head\)"),
    "o_proj_bias": (lambda: transformers.Qwen3Config(**SHAPE, attention_bias=True),
                    r"attention_bias=True \(biases on q/k/v and o_proj"),
    "sliding_window": (lambda: transformers.MistralConfig(**SHAPE, sliding_window=32),
                       r"sliding_window=32 is shorter than the sequence length 64"),
}


@pytest.mark.parametrize("case", sorted(HF_CONFIG_ERRORS))
def test_unsupported_architectures_are_named(case):
    make_config, message = HF_CONFIG_ERRORS[case]
    with pytest.raises(UnsupportedArchitectureError, match=message):
        encoder_config_from_hf(make_config(), vocab_size=384, seq_length=64)


def test_import_cli_errors(tmp_path, capsys, monkeypatch, base_tokenizer_json):
    import huggingface_hub.constants

    def run(*argv: str) -> str:
        assert import_hf_checkpoint.main(["--output-dir", str(tmp_path / "out"), *argv]) == 2
        return capsys.readouterr().err

    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config().save_pretrained(gpt2)  # config only: refused before any weights
    assert "model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3, eurobert" in run(
        "--hf-model", str(gpt2))
    assert "no such directory" in run("--hf-model", str(tmp_path / "missing" / "model"))
    (tmp_path / "empty").mkdir()
    assert "cannot load the config (config.json)" in run("--hf-model", str(tmp_path / "empty"))
    llama = tmp_path / "llama"
    transformers.LlamaConfig(**SHAPE).save_pretrained(llama)
    assert "cannot load the tokenizer" in run("--hf-model", str(llama))
    make_tokenizer(base_tokenizer_json, "plain").save_pretrained(llama)
    assert "cannot load the weights" in run("--hf-model", str(llama))
    assert "sliding_window=32 is shorter than the sequence length 48" in run(
        "--hf-model", str(_saved_mistral(tmp_path, base_tokenizer_json)), "--seq-length", "48")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no 30 s of retries
    err = run("--hf-model", "some-org/some-model")
    assert "from the Hugging Face hub" in err and "pass that local directory to --hf-model" in err
    assert not (tmp_path / "out").exists()


def _saved_mistral(tmp_path: Path, base_tokenizer_json: str) -> Path:
    path = tmp_path / "mistral"
    make_hf_model(Family("MistralConfig", "MistralForCausalLM", {"sliding_window": 32},
                         "mistral", "plain"), 320).save_pretrained(path)
    make_tokenizer(base_tokenizer_json, "plain").save_pretrained(path)
    return path


def test_import_cli_end_to_end(tmp_path, base_tokenizer_json, capsys):
    path = _saved_mistral(tmp_path, base_tokenizer_json)
    out = tmp_path / "imported"
    argv = ["--hf-model", str(path), "--output-dir", str(out), "--seq-length", "32",
            "--tensor-model-parallel-size", "2", "--mask-token", "[MASK]"]
    assert import_hf_checkpoint.main(argv) == 0
    assert "mask token '[MASK]' (id 320, added)" in capsys.readouterr().out
    snippet = yaml.safe_load((out / "recipe_model.yaml").read_text())
    assert snippet["model"]["vocab_size"] == 512 and snippet["model"]["seq_length"] == 32
    assert snippet["tokenizer"]["tokenizer_model"] == str(out / "tokenizer")
    assert import_hf_checkpoint.main(argv) == 2  # not empty any more
    assert "pass --overwrite" in capsys.readouterr().err
    assert import_hf_checkpoint.main([*argv, "--overwrite"]) == 0
    assert "--tensor-model-parallel-size 3 does not fit" in _err(capsys, import_hf_checkpoint.main(
        ["--hf-model", str(path), "--output-dir", str(tmp_path / "tp3"), "--seq-length", "32",
         "--tensor-model-parallel-size", "3"]))


def _err(capsys, rc: int) -> str:
    assert rc == 2
    return capsys.readouterr().err


def test_export_directory_rules_and_checkpoint_errors(imports, tmp_path, capsys):
    llama, smollm = imports("llama"), imports("smollm")
    out = tmp_path / "export"

    def export(checkpoint: Path, *extra: str, to: Path = out) -> int:
        return export_hf_checkpoint.main(["--checkpoint", str(checkpoint), "--output-dir", str(to), *extra])

    assert export(llama.result.output_dir) == 0
    first = (out / "model.safetensors").read_bytes()
    assert export(llama.result.output_dir) == 0  # same model again: nothing changes
    assert capsys.readouterr().out.rstrip().endswith(f"{out}: unchanged")
    assert "already holds a different model" in _err(capsys, export(smollm.result.output_dir))
    assert (out / "model.safetensors").read_bytes() == first
    assert export(smollm.result.output_dir, "--overwrite") == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left

    assert "bfloat16" in _bf16_dtype(llama, tmp_path)
    assert "no complete checkpoint" in _err(capsys, export(tmp_path / "nothing"))
    # The tokenizer the checkpoint references has moved: say so, and --tokenizer fixes it.
    moved = tmp_path / "moved"
    shutil.copytree(llama.result.checkpoint, moved)
    reference = json.loads((moved / "tokenizer_reference.json").read_text())
    (moved / "tokenizer_reference.json").write_text(
        json.dumps({**reference, "tokenizer_model": str(tmp_path / "gone")}))
    assert "pass --tokenizer DIR" in _err(capsys, export(moved, to=tmp_path / "moved_out"))
    assert export(moved, "--tokenizer", str(llama.result.tokenizer_dir), to=tmp_path / "moved_out") == 0
    # A checkpoint whose model config describes another model (here: Qwen3's shapes).
    mixed = tmp_path / "mixed"
    shutil.copytree(llama.result.checkpoint, mixed)
    qwen3_model = json.loads((imports("qwen3").result.checkpoint / "model_config.json").read_text())
    (mixed / "model_config.json").write_text(json.dumps(qwen3_model))
    err = _err(capsys, export(mixed, "--format", "qwen3", to=tmp_path / "mixed_out"))
    assert "does not fit the model" in err and "linear_qkv.weight" in err and "q_layernorm" in err


def _bf16_dtype(imp: Imported, tmp_path: Path) -> str:
    from safetensors import safe_open

    out = tmp_path / "bf16"
    assert export_hf_checkpoint.main(["--checkpoint", str(imp.result.output_dir), "--output-dir",
                                      str(out), "--format", "llama", "--dtype", "bfloat16"]) == 0
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    return json.loads((out / "config.json").read_text())["dtype"]


def test_tools_help_and_format_choices(capsys):
    assert tuple(FORMATS) == export_hf_checkpoint.FORMAT_CHOICES
    for tool in (import_hf_checkpoint, export_hf_checkpoint):
        with pytest.raises(SystemExit) as exit_info:
            tool.main(["--help"])
        assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--hf-model" in out and "--tensor-model-parallel-size" in out and "--dtype" in out


def megatron_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    with single_process_model_parallel():
        return {k: v.cpu() for k, v in load_megatron_checkpoint(checkpoint).state_dict().items()
                if not k.endswith("._extra_state")}


def test_eurobert_export_then_import_gives_the_same_checkpoint(imports, tmp_path, capsys):
    """Megatron -> EuroBERT directory -> Megatron (the CLI, loading with AutoModelForMaskedLM):
    every tensor as it was. Qwen2's q/k/v biases travel as EuroBERT's attention_bias, whose
    o_proj biases export writes as zeros and import accepts only as zeros."""
    qwen2 = imports("qwen2")
    exported = tmp_path / "eurobert"
    export_checkpoint(qwen2.result.output_dir, exported, log=lambda _: None)
    assert json.loads((exported / "config.json").read_text())["attention_bias"] is True
    out = tmp_path / "reimported"
    assert import_hf_checkpoint.main(["--hf-model", str(exported), "--output-dir", str(out)]) == 0
    assert "mask token '<mask>' (id 320, kept)" in capsys.readouterr().out
    before, after = megatron_state(qwen2.result.output_dir), megatron_state(out)
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    snippet = yaml.safe_load((out / "recipe_model.yaml").read_text())
    assert snippet["model"] == yaml.safe_load(qwen2.result.recipe.read_text())["model"]


def test_eurobert_import_refusals(base_tokenizer_json, tmp_path, capsys):
    """What the encoder cannot hold, or a mask token it was not trained with, is refused by name."""
    from safetensors.torch import load_file, save_file

    family = FAMILIES["eurobert"]
    tokenizer = make_tokenizer(base_tokenizer_json, family.tokenizer)

    def refused(model, message: str, **kwargs) -> None:
        out = tmp_path / "out"
        with pytest.raises(UserError, match=message):
            import_hf_model(model, tokenizer, out, log=lambda _: None, **kwargs)
        assert not out.exists()

    biased = make_hf_model(replace(
        family, config={**family.config, "attention_bias": True}), len(tokenizer))
    refused(biased, r"model.layers.0.self_attn.o_proj.bias is not zero .* no o_proj bias")
    model = make_hf_model(family, len(tokenizer))
    # Stored tensors EuroBertForMaskedLM has no place for (an MLM head transform) are named.
    saved = tmp_path / "with_head_transform"
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    weights = load_file(saved / "model.safetensors")
    save_file({**weights, "head.dense.weight": torch.zeros(64, 64)}, saved / "model.safetensors",
              metadata={"format": "pt"})
    assert import_hf_checkpoint.main(["--hf-model", str(saved), "--output-dir", str(tmp_path / "out")]) == 2
    assert "has no place for ['head.dense.weight']" in capsys.readouterr().err
    refused(model, r"--mask-token '\[MASK\]': this encoder was trained with mask token '<mask>' "
                   r"\(config.json mask_token_id=320\)", mask_token="[MASK]")
    model.config.mask_token_id = 5
    refused(model, r"config.json mask_token_id=5 .* but the tokenizer's mask token '<mask>' is id 320")
    model.config.mask_token_id = 321
    refused(model, r"config.json mask_token_id=321 is not an id of the tokenizer \(321 ids\)")
    # A tokenizer without a mask token takes the config's (trained: its rows stay as they were).
    model.config.mask_token_id = 7
    plain = make_tokenizer(base_tokenizer_json, "plain")
    result = import_hf_model(model, plain, tmp_path / "plain", log=lambda _: None)
    assert (result.mask_token_id, result.mask_token_origin) == (7, "config")
    assert plain.mask_token is None
    embedding = megatron_state(result.output_dir)["embedding.word_embeddings.weight"]
    assert torch.equal(embedding[:321], model.model.embed_tokens.weight.detach())


CPT_ENCODER_STUDY = Path(__file__).resolve().parents[2] / "examples" / "studies" / "cpt_encoder.yaml"


def test_cpt_encoder_study_at_ci_size(imports, tmp_path, news_texts):
    """examples/studies/cpt_encoder.yaml with a tiny imported EuroBERT as its size and 5 steps:
    MLM-40 vs the CLM detour (4 CLM steps at the stable rate, MLM over the 1-step decay), both
    from the import's weights. The detour's recipe trains through pretrain_encoder's loop (the
    baseline's path, MLM from an import, is test_continued_pretraining_from_an_import's) and the
    result exports back as EuroBERT."""
    from megatron_ext.study.plan import plan_study
    from megatron_ext.study.spec import read_study
    from megatron_ext.training.recipe import run_config_from_dict
    from megatron_ext.training.loop import pretrain

    imp = imports("eurobert")
    size_base = _cpt_recipe(imp, tmp_path, news_texts)
    recipe = yaml.safe_load(size_base.read_text())
    del recipe["phases"], recipe["checkpoint"], recipe["logging"]["log_dir"]
    recipe["schedule"] = {"lr": 1e-3, "lr_decay_style": "wsd", "lr_warmup_iters": 1,
                          "lr_wsd_decay_iters": 1}
    size_base.write_text(yaml.safe_dump(recipe))
    study = yaml.safe_load(CPT_ENCODER_STUDY.read_text())
    study["sizes"][0]["base"] = str(size_base)
    study["budgets"] = [5]
    study["output"] = {"save": str(tmp_path / "pretrain" / "{run}" / "checkpoints"),
                       "log_dir": str(tmp_path / "pretrain" / "{run}")}
    path = tmp_path / "cpt_encoder_ci.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))

    plan = plan_study(read_study(path), path)
    runs = {run.name: run for run in plan.runs}
    assert sorted(runs) == ["eurobert_210m_biphasic_80_20_5", "eurobert_210m_mlm_40_5"]
    assert all(s.start_from == "scratch" for s in plan.segments)  # they differ from step 0
    for run in runs.values():
        assert run.recipe["checkpoint"]["load"] == str(imp.result.output_dir)
        assert run.recipe["checkpoint"]["finetune"] is True and run.train_iters == 5
    detour = runs["eurobert_210m_biphasic_80_20_5"]
    assert [(p.objective.tag, p.start, p.end) for p in detour.config.resolved_phases] == [
        ("clm", 0, 4), ("mlm", 4, 5)]

    result = pretrain(run_config_from_dict(detour.recipe))
    assert result.start_step == 0 and result.final_step == 5
    assert all(math.isfinite(v) for v in result.losses.values())
    out = tmp_path / "detour_eurobert"
    export_checkpoint(detour.recipe["checkpoint"]["save"], out, log=lambda _: None)
    continued, original = transformers.EuroBertForMaskedLM.from_pretrained(out), imp.hf.state_dict()
    assert continued.state_dict().keys() == original.keys()
    assert not torch.equal(continued.model.layers[0].mlp.up_proj.weight,
                           original["model.layers.0.mlp.up_proj.weight"])  # it trained
