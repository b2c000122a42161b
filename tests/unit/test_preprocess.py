"""tools/preprocess_data.py: round trips, worker determinism, formats, bad input, Megatron parity."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_ext import assets
from megatron_ext.config_loading import UserError
from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.data.readers import InputError
from megatron_ext.data.sentences import SentenceSplitter, train_punkt
from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer
from megatron_ext.cli import preprocess_data



@pytest.fixture(scope="module")
def sp_model() -> str:
    """A real Llama-2-style SentencePiece model (32k vocab, has </s>)."""
    return str(assets.member("mistral-common", "mistral_common/data/tokenizer.model.v1"))


@pytest.fixture()
def corpus(tmp_path, news_texts) -> Path:
    path = tmp_path / "news.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(news_texts[:120]):
            f.write(json.dumps({"id": i, "text": text, "title": text[:40]}) + "\n")
    return path


def _run(tmp_path: Path, inputs, tokenizer_model: str, **kwargs):
    config = PreprocessConfig(
        inputs=tuple(str(i) for i in inputs),
        output_prefix=str(tmp_path / kwargs.pop("name", "out")),
        tokenizer=TokenizerConfig(tokenizer_model=tokenizer_model),
        progress=False,
        **kwargs,
    )
    return config, preprocess(config)


def _read(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix)


def test_round_trip_equals_tokenizer_output(tmp_path, corpus, sp_model, news_texts):
    config, summary = _run(tmp_path, [corpus], sp_model, append_eod=True)
    tokenizer = build_tokenizer(config.tokenizer)
    ds = _read(config.output_prefix_for("text"))
    assert len(ds) == summary.documents == 120
    for i in (0, 1, 57, 119):
        expected = tokenizer.tokenize(news_texts[i], add_special_tokens=True) + [tokenizer.eod]
        assert ds[i].tolist() == expected
    assert ds.index.dtype == np.uint16  # 32k vocab fits in uint16
    assert summary.tokens == int(ds.sequence_lengths.sum())
    assert tokenizer.detokenize(ds[3].tolist()[:-1]).strip()[:30] == news_texts[3].strip()[:30]


def test_output_identical_for_one_and_two_workers(tmp_path, corpus, minilm_dir):
    a, _ = _run(tmp_path, [corpus], str(minilm_dir), name="w1", workers=1, json_keys=("text", "title"))
    b, _ = _run(tmp_path, [corpus], str(minilm_dir), name="w2", workers=2, json_keys=("text", "title"))
    for key in ("text", "title"):
        for suffix in (".bin", ".idx"):
            left = Path(a.output_prefix_for(key) + suffix).read_bytes()
            right = Path(b.output_prefix_for(key) + suffix).read_bytes()
            assert left == right and len(left) > 0


def test_matches_megatron_core_tokenizer(tmp_path, corpus, sp_model, news_texts):
    """Same documents and tokens as Megatron-LM's tool: Megatron-Core's tokenizer + its EOD rule."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build

    args = argparse.Namespace(
        tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model, chat_template=None,
        tokenizer_sentencepiece_ignore_extra_whitespaces=False, tokenizer_sentencepiece_legacy=False,
        special_tokens=None, metadata_path=None, pad_vocab_size=False, vocab_size=None,
    )
    megatron_tok = megatron_build(args)
    config, _ = _run(tmp_path, [corpus], sp_model, append_eod=True)
    ds = _read(config.output_prefix_for("text"))
    for i in range(0, 120, 7):
        assert ds[i].tolist() == list(megatron_tok.tokenize(news_texts[i])) + [megatron_tok.eod]


def test_gpt_dataset_over_output_yields_requested_length(tmp_path, corpus, sp_model):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config, _ = _run(tmp_path, [corpus], sp_model, append_eod=True)
    tokenizer = build_tokenizer(config.tokenizer)
    gpt_config = GPTDatasetConfig(
        random_seed=1234, sequence_length=128, blend=([config.output_prefix_for("text")], None),
        split="90,10,0", tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"),
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [20, 4, None], lambda: True, gpt_config).build()
    sample = train[0]
    assert sample["tokens"].shape == (128,) and sample["labels"].shape == (128,)
    assert sample["tokens"][1:].tolist() == sample["labels"][:-1].tolist()
    assert len(train) >= 20 and len(valid) >= 4


@pytest.mark.parametrize("fmt", ["jsonl.gz", "text-line", "text-file", "parquet", "hf-disk"])
def test_input_formats_give_the_same_tokens(tmp_path, sp_model, news_texts, fmt):
    texts = news_texts[:20]
    if fmt == "jsonl.gz":
        path = tmp_path / "in.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        kwargs = {}
    elif fmt == "text-line":
        path = tmp_path / "in.txt"
        path.write_text("\n".join(texts) + "\n", encoding="utf-8")
        kwargs = {}
    elif fmt == "text-file":
        path = tmp_path / "docs"
        path.mkdir()
        for i, t in enumerate(texts):
            (path / f"{i:03d}.txt").write_text(t, encoding="utf-8")
        kwargs = {"text_mode": "file"}
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "in.parquet"
        pq.write_table(pa.table({"text": texts, "n": list(range(20))}), path, row_group_size=7)
        kwargs = {}
    else:
        import datasets

        path = tmp_path / "hf"
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
        kwargs = {}
    config, summary = _run(tmp_path, [path], sp_model, **kwargs)
    tokenizer = build_tokenizer(config.tokenizer)
    ds = _read(config.output_prefix_for("text"))
    assert summary.documents == 20
    assert [ds[i].tolist() for i in range(20)] == tokenizer.tokenize_batch(texts, add_special_tokens=True)


def test_invalid_json_names_file_and_line(tmp_path, corpus, sp_model):
    lines = corpus.read_text().splitlines()
    lines.insert(41, '{"text": "unterminated')
    corpus.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"news.jsonl:42: invalid JSON"):
        _run(tmp_path, [corpus], sp_model)
    assert not list(tmp_path.glob("out*"))  # nothing half-written, no temporaries left
    _, summary = _run(tmp_path, [corpus], sp_model, skip_invalid=True)
    assert summary.invalid_skipped == 1 and summary.documents == 120


def test_missing_key_names_the_keys_present(tmp_path, corpus, sp_model):
    with pytest.raises(InputError, match=r"news.jsonl:1: key\(s\) \['body'\] missing; keys present: \['id', 'text', 'title'\]"):
        _run(tmp_path, [corpus], sp_model, json_keys=("body",))


def test_unreadable_and_missing_inputs(tmp_path, corpus, sp_model):
    with pytest.raises(InputError, match="no such file"):
        _run(tmp_path, [tmp_path / "nope.jsonl"], sp_model)
    if os.geteuid() != 0:  # root reads anything
        corpus.chmod(0)
        with pytest.raises(InputError, match="not readable"):
            _run(tmp_path, [corpus], sp_model)


def test_existing_output_needs_overwrite_and_survives_failed_rewrite(tmp_path, corpus, sp_model):
    config, _ = _run(tmp_path, [corpus], sp_model)
    prefix = config.output_prefix_for("text")
    before = Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()
    with pytest.raises(UserError, match=r"out_text_document.bin already exists; pass --overwrite"):
        _run(tmp_path, [corpus], sp_model)
    # A rewrite that dies midway (bad line near the end) leaves the previous pair intact.
    with open(corpus, "a") as f:
        f.write("not json\n")
    with pytest.raises(InputError):
        _run(tmp_path, [corpus], sp_model, overwrite=True)
    assert (Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.glob("out*")) == ["out_text_document.bin", "out_text_document.idx",
                                                             "out_text_document.tokenizer.json"]


def test_empty_documents_are_skipped_and_counted(tmp_path, sp_model):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["Hello world.", "", "Second doc."]) + "\n")
    config, summary = _run(tmp_path, [path], sp_model, add_special_tokens=False)
    assert summary.documents == 2 and summary.empty_skipped == 1
    assert len(_read(config.output_prefix_for("text"))) == 2


def test_sentence_splitting_trains_punkt_and_keeps_newlines(tmp_path, corpus, sp_model, news_texts):
    config, summary = _run(tmp_path, [corpus], sp_model, split_sentences=True, append_eod=True)
    assert config.output_prefix_for("text").endswith("_text_sentence")
    assert summary.splitter.startswith(("trained-on-input", "pretrained"))
    ds = _read(config.output_prefix_for("text"))
    assert len(ds.document_indices) == 121  # still 120 documents ...
    assert len(ds) > 3 * 120  # ... made of several sentences each
    punkt, _ = train_punkt(news_texts)
    text = "Dr. Smith arrived at 9 a.m. on Monday.\nHe left soon after.  Then it rained!\n\nThe end."
    kept = SentenceSplitter(punkt, keep_newlines=True, source="test").split(text)
    assert "".join(kept) == text and len(kept) >= 3
    stripped = SentenceSplitter(punkt, keep_newlines=False, source="test").split(text)
    assert stripped[-1] == "The end." and all(s == s.strip() for s in stripped)


def test_main_cli(tmp_path, corpus, sp_model, capsys):
    prefix = tmp_path / "cli"
    rc = preprocess_data.main([
        "--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer-model", sp_model,
        "--append-eod", "--workers", "2", "--no-progress",
    ])
    out, err = capsys.readouterr()
    assert rc == 0 and "documents written   120" in out and "tokens/s" in out
    assert "preprocess:" not in err  # --no-progress: no bar, no lines
    assert (tmp_path / "cli_text_document.idx").exists()
    assert preprocess_data.main([
        "--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer-model", sp_model,
    ]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_non_utf8_byte_names_file_and_line_and_is_skipped_with_the_flag(tmp_path, corpus, sp_model):
    data = corpus.read_bytes().split(b"\n")
    data[6] = data[6][:20] + b"\xff" + data[6][20:]
    corpus.write_bytes(b"\n".join(data))
    with pytest.raises(InputError, match=r"news.jsonl:7: invalid UTF-8 \(byte 0xff at column 21\)"):
        _run(tmp_path, [corpus], sp_model)
    _, summary = _run(tmp_path, [corpus], sp_model, skip_invalid=True)
    assert summary.invalid_skipped == 1 and summary.documents == 119
    text = tmp_path / "plain.txt"
    text.write_bytes(b"first line\nsecond \xfe line\n")
    with pytest.raises(InputError, match=r"plain.txt:2: invalid UTF-8"):
        _run(tmp_path, [text], sp_model, name="plain")


def test_empty_input_is_refused_naming_the_file(tmp_path, sp_model):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(InputError, match=r"no documents in .*empty.jsonl"):
        _run(tmp_path, [empty], sp_model)
    assert not list(tmp_path.glob("out*"))


def test_stale_temporaries_of_a_killed_run_are_removed(tmp_path, corpus, sp_model, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    stale = [tmp_path / f"out_text_document.bin.tmp{dead.pid}", tmp_path / f"out_text_document.idx.tmp{dead.pid}"]
    other = tmp_path / f"other_text_document.bin.tmp{dead.pid}"  # another output's: left alone
    for path in (*stale, other):
        path.write_bytes(b"partial")
    with caplog.at_level("WARNING"):
        _run(tmp_path, [corpus], sp_model)
    assert not any(p.exists() for p in stale) and other.exists()
    assert "left by an interrupted run" in caplog.text


def test_ctrl_c_prints_one_line_and_keeps_the_previous_output(tmp_path, corpus, sp_model):
    """Interrupted while reading its input: one line, exit 130, no temporaries, and the output of
    an earlier run to the same prefix untouched. The input is a named pipe the test holds open, so
    the run is certainly mid-way (its temporaries exist and it waits for more input) when the
    signal arrives, however loaded the machine."""
    import errno
    import signal
    import subprocess
    import sys
    import time

    _run(tmp_path, [corpus], sp_model)
    previous = {p.name: p.read_bytes() for p in tmp_path.glob("out_text_document.*")}
    assert len(previous) == 3  # .bin, .idx and the tokenizer record
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.Popen([sys.executable, "tools/preprocess_data.py", "--input", str(fifo), "--output-prefix",
                            str(tmp_path / "out"), "--tokenizer-model", sp_model, "--workers", "1", "--no-progress",
                            "--overwrite"], stderr=subprocess.PIPE, text=True, cwd=repo,
                           # A shell's background job ignores SIGINT and children inherit that, in
                           # which case Python installs no Ctrl-C handler: give the run a terminal's.
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while True:  # the pipe opens for writing once the run has opened its input, after start-up
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as error:  # ENXIO: no reader yet
                assert error.errno == errno.ENXIO and run.poll() is None and time.monotonic() < deadline, \
                    run.stderr.read() if run.poll() is not None else "no reader"
                time.sleep(0.05)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "w") as writer:
            writer.write(corpus.read_text())
            writer.flush()
            assert list(tmp_path.glob("out_text_document.bin.tmp*")), "the run has not started writing"
            run.send_signal(signal.SIGINT)
            _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 130, err
    assert err.strip().splitlines()[-1] == "preprocess_data.py: interrupted; no output written"
    assert "Traceback" not in err
    assert {p.name: p.read_bytes() for p in tmp_path.glob("out_text_document.*")} == previous


def test_append_eod_with_a_bert_tokenizer_ends_documents_with_one_sep(tmp_path, corpus, minilm_dir):
    """BERT's EOD is [SEP], which its own special tokens already put last: not appended twice."""
    config, _ = _run(tmp_path, [corpus], str(minilm_dir), append_eod=True)
    tokenizer = build_tokenizer(config.tokenizer)
    dataset = _read(config.output_prefix_for("text"))
    assert len(dataset) == 120
    for i in range(len(dataset)):
        ids = dataset[i].tolist()
        assert ids[0] == tokenizer.bos and ids[-1] == tokenizer.eod and ids[-2] != tokenizer.eod


def test_progress_into_a_log_file_is_lines_at_tenths_and_a_final_line(tmp_path, sp_model, news_texts, capsys):
    """Without --no-progress and stderr not a terminal (a batch job's log): a line at each 10% of
    the input passed, one at the end with the amount, time and rate; nothing redrawn; the summary
    still on stdout."""
    corpus = tmp_path / "news.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in news_texts * 4))  # 5 chunks of work
    assert preprocess_data.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
                                 "--tokenizer-model", sp_model]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err, captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("preprocess: ")]
    percents = [int(re.match(r"preprocess: (\d+)% \(", line)[1]) for line in lines[:-1]]
    # 5 updates of ~21% each (the last short of 100%: characters counted against the bytes of the file)
    assert len(percents) == 5 and percents == sorted(set(percents)) and 15 < percents[0] < 25, lines
    assert re.fullmatch(r"preprocess: [\d.]+MB in \d\d:\d\d, [\d.]+[kM]?B/s", lines[-1]), lines
    assert "documents written   1,200" in captured.out


def test_paragraph_text_mode_makes_one_document_per_paragraph_and_line_mode_says_so(tmp_path, sp_model, news_texts,
                                                                                    caplog):
    """Paragraphs (lines between blank lines): --text-mode paragraph makes each one document; line
    mode still makes one per line, with one notice naming the file and the mode that fits."""
    paragraphs = ["\n".join(text.split(". ")[:3]) for text in news_texts[:12]]
    path = tmp_path / "book.txt"
    path.write_text("\n\n\n".join(paragraphs) + "\n")
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=sp_model))
    config, summary = _run(tmp_path, [path], sp_model, name="para", text_mode="paragraph", add_special_tokens=False)
    dataset = _read(config.output_prefix_for("text"))
    assert summary.documents == len(dataset) == 12
    assert dataset[3].tolist() == tokenizer.tokenize(paragraphs[3])
    assert not [r for r in caplog.records if "separates paragraphs" in r.getMessage()]
    _, summary = _run(tmp_path, [path], sp_model, name="lines", text_mode="line", add_special_tokens=False)
    assert summary.documents == sum(p.count("\n") + 1 for p in paragraphs)
    notices = [r.getMessage() for r in caplog.records if "separates paragraphs" in r.getMessage()]
    assert len(notices) == 1 and str(path) in notices[0] and "--text-mode paragraph" in notices[0]
