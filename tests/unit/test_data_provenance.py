"""The tokenizer that made a dataset (``data.provenance``): recorded beside the index by
preprocessing, and a run or ``--dry-run`` whose tokenizer differs (even with the same vocabulary
size) refused in one line naming both; data without a record gets one notice."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from megatron_ext.config_loading import UserError
from megatron_ext.data.provenance import SUFFIX, check_data_tokenizer
from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer
from megatron_ext.cli import train_tokenizer
from helpers import tiny_recipe

from megatron_ext.cli import pretrain_encoder


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory, news_texts) -> str:
    """A tokenizer of the same size (1,024 ids) trained on other text: other ids for the same words."""
    root = tmp_path_factory.mktemp("other_tok")
    jsonl = root / "half.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in news_texts[::-1][:120]))
    assert train_tokenizer.main(["--input", str(jsonl), "--output-dir", str(root / "tok"),
                                 "--vocab-size", "1024", "--no-progress"]) == 0
    return str(root / "tok")


def test_preprocessing_records_the_tokenizer_beside_the_index(tiny_corpus):
    record = json.loads(open(tiny_corpus["data"] + SUFFIX).read())
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=tiny_corpus["tokenizer"]))
    assert record["fingerprint"] == tokenizer.fingerprint()
    assert record["class"] == type(tokenizer).__name__ and record["vocab_size"] == tokenizer.vocab_size
    assert record["reference"]["tokenizer_model"] == tiny_corpus["tokenizer"]
    assert record["special_tokens"]["eod"] is not None
    assert check_data_tokenizer([tiny_corpus["data"]], tokenizer) is None


def _dry_run(tmp_path, tiny_corpus, capsys, **sections) -> tuple[int, str, str]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tiny_corpus, tmp_path, **sections)))
    code = pretrain_encoder.main(["--config", str(recipe), "--dry-run"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_another_tokenizer_of_the_same_size_is_refused_at_dry_run_and_start_up(tmp_path, tiny_corpus, other_tokenizer,
                                                                                capsys):
    other = build_tokenizer(TokenizerConfig(tokenizer_model=other_tokenizer))
    made = build_tokenizer(TokenizerConfig(tokenizer_model=tiny_corpus["tokenizer"]))
    assert other.vocab_size == made.vocab_size and other.fingerprint() != made.fingerprint()
    code, out, err = _dry_run(tmp_path, tiny_corpus, capsys, tokenizer={"tokenizer_model": other_tokenizer})
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"{tiny_corpus['data']} was tokenized by" in lines[0]
    assert made.fingerprint() in lines[0] and other.fingerprint() in lines[0]
    assert repr(tiny_corpus["tokenizer"]) in lines[0] and repr(other_tokenizer) in lines[0]

    from megatron_ext.training.recipe import run_config_from_dict
    from megatron_ext.training.loop import pretrain

    config = run_config_from_dict(tiny_recipe(tiny_corpus, tmp_path / "run", tokenizer={"tokenizer_model": other_tokenizer}))
    with pytest.raises(UserError, match=f"was tokenized by .*{made.fingerprint()}.*{other.fingerprint()}"):
        pretrain(config)
    assert not (tmp_path / "run" / "ckpt").exists() or not any((tmp_path / "run" / "ckpt").glob("iter_*"))


def test_data_without_a_record_gets_one_notice(tmp_path, tiny_corpus, capsys):
    old = tmp_path / "old_text_document"
    for suffix in (".bin", ".idx"):
        shutil.copy(tiny_corpus["data"] + suffix, str(old) + suffix)
    code, out, err = _dry_run(tmp_path, tiny_corpus, capsys, data={"data_path": [str(old)]})
    assert code == 0, err
    notices = [line for line in (out + err).splitlines() if "tokenizer.json" in line]
    assert len(notices) == 1 and str(old) in notices[0] and "not checked" in notices[0], out + err
