"""tools/preprocess_data.py --shard-size: a corpus in shards equals the single-process output token
for token (blend and merge), resumes without redoing finished shards nor reading a partial one, and
refuses a changed tokenizer or input; the streamed index writes Megatron's bytes."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from megatron_ext import assets
from megatron_ext.claims import Owner
from megatron_ext.cli import preprocess_data
from megatron_ext.config_loading import UserError
from megatron_ext.data import index_checks, indexed_writer, shards
from megatron_ext.data.blend_file import read_blend
from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.tokenizer import TokenizerConfig


@pytest.fixture()
def corpus(tmp_path, news_texts) -> list[str]:
    """Three inputs of real news text: a JSONL file cut into byte ranges, a Parquet file of
    several row groups (cut between them), a gzipped JSONL file (one shard)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = tmp_path / "a.jsonl"
    first.write_text("".join(json.dumps({"text": t}) + "\n" for t in news_texts[:120]), encoding="utf-8")
    pq.write_table(pa.table({"text": news_texts[120:220]}), tmp_path / "b.parquet", row_group_size=20)
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in news_texts[220:])
    return [str(first), str(tmp_path / "b.parquet"), str(tmp_path / "c.jsonl.gz")]


def _config(tmp_path: Path, inputs, tokenizer_model, name: str = "out", **kwargs) -> PreprocessConfig:
    return PreprocessConfig(inputs=tuple(inputs), output_prefix=str(tmp_path / name),
                            tokenizer=TokenizerConfig(tokenizer_model=str(tokenizer_model)), progress=False,
                            append_eod=True, **kwargs)


def _documents(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_indexed_writer_writes_megatrons_bytes_and_merges_in_blocks(tmp_path, monkeypatch):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    monkeypatch.setattr(indexed_writer, "BLOCK", 7)  # many blocks: the streaming paths run
    rng = np.random.default_rng(0)
    documents = [[rng.integers(0, 30000, size=int(n)) for n in rng.integers(1, 9, size=rng.integers(1, 4))]
                 for _ in range(50)]
    documents[30] = [rng.integers(0, 30000, size=3) for _ in range(10)]  # more sentences than a block
    reference = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for sentences in documents:
        reference.add_document(np.concatenate(sentences), [len(s) for s in sentences])
    reference.finalize(str(tmp_path / "ref.idx"))
    for name, part in (("all", documents), ("head", documents[:23]), ("tail", documents[23:])):
        writer = indexed_writer.IndexedWriter(str(tmp_path / f"{name}.bin"), str(tmp_path / f"{name}.idx"), np.uint16)
        for sentences in part:
            writer.add_document(np.concatenate(sentences), [len(s) for s in sentences])
        writer.finalize()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"all{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if "lengths" in p.name or "documents" in p.name) == []
    assert indexed_writer.merge_indexed([str(tmp_path / "head"), str(tmp_path / "tail")], str(tmp_path / "m.bin"),
                                        str(tmp_path / "m.idx")) == (50, sum(sum(map(len, d)) for d in documents))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"m{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()


def test_dtype_table_is_megatrons():
    from megatron.core.datasets.indexed_dataset import DType

    assert index_checks.DTYPE_CODES == {d.value: getattr(np, d.name) for d in DType}
    for vocab in (100, 65499, 65500, 200_000):
        assert indexed_writer.optimal_dtype(vocab) == DType.optimal_dtype(vocab)


def test_a_blend_file_reads_back_as_data_path_entries_and_an_empty_one_is_refused(tmp_path):
    from megatron_ext.data.blend_file import write_blend

    write_blend(tmp_path / "a.blend", [(120, "out.shards/00000_text_document"), (7, "out.shards/00002_text_document")])
    assert read_blend(tmp_path / "a.blend") == ("120", "out.shards/00000_text_document", "7",
                                                 "out.shards/00002_text_document")
    (tmp_path / "empty.blend").write_text("\n")
    with pytest.raises(UserError, match=r"data.data_args_path='x': the file holds no data_path entries"):
        read_blend(tmp_path / "empty.blend", where="data.data_args_path='x'")
    with pytest.raises(UserError, match=r"nowhere.blend: No such file"):
        read_blend(tmp_path / "nowhere.blend")


def test_sharded_run_equals_the_single_process_output_token_for_token(tmp_path, corpus, minilm_dir, capsys):
    single = _config(tmp_path, corpus, minilm_dir, name="single")
    preprocess(single)
    argv = ["--input", *corpus, "--output-prefix", str(tmp_path / "out"), "--tokenizer-model", str(minilm_dir),
            "--append-eod", "--shard-size", "40KB", "--workers", "2", "--merge", "--launcher", "local"]
    assert preprocess_data.main(argv + ["--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert "plan: 3 input(s)" in dry and "row groups 0-" in dry and "bytes 0-" in dry, dry
    assert "launcher local: 2 worker(s)" in dry and "-m megatron_ext.cli.preprocess_worker --shard-dir" in dry
    assert not (tmp_path / "out.shards").exists()  # a dry run writes nothing

    assert preprocess_data.main(argv) == 0
    out = capsys.readouterr().out
    plan = shards.ShardDir.for_prefix(str(tmp_path / "out")).read_plan()
    assert len(plan.shards) >= 6 and {s.format for s in plan.shards} == {"jsonl", "parquet"}
    assert f"shards {len(plan.shards)}/{len(plan.shards)}, 300 documents" in out, out
    # The merge is the single-process dataset, byte for byte.
    for suffix in (".bin", ".idx", ".tokenizer.json"):
        assert Path(str(tmp_path / "out_text_document") + suffix).read_bytes() == \
            Path(single.output_prefix_for("text") + suffix).read_bytes()
    # The blend: the shards in order are the single output's documents; weights are their tokens.
    entries = read_blend(tmp_path / "out_text_document.blend")
    weights, prefixes = [int(w) for w in entries[0::2]], entries[1::2]
    documents = [doc for prefix in prefixes for doc in _documents(prefix)]
    assert documents == _documents(single.output_prefix_for("text"))
    assert weights == [sum(map(len, _documents(p))) for p in prefixes]
    # Both workers took part (each copy's log names the shards it tokenized).
    logs = sorted((tmp_path / "out.shards" / "logs").glob("worker.worker*.log"))
    assert len(logs) == 2


def _dead_owner() -> Owner:
    """A claim's owner whose process has ended (a killed worker of this host)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return replace(Owner.this_process(), pid=process.pid)


def test_a_killed_shard_is_done_again_and_its_partial_files_are_never_read(tmp_path, corpus, minilm_dir, caplog):
    single = _config(tmp_path, corpus, minilm_dir, name="single")
    preprocess(single)
    plan = shards.plan_corpus(_config(tmp_path, corpus, minilm_dir), 40 << 10)
    shard_dir = shards.prepare(plan)
    first = shards.run_worker(shard_dir, max_shards=2)
    assert first.done == [0, 1]
    finished = {i: shard_dir.marker(i).stat().st_mtime_ns for i in (0, 1)}
    # Shard 2 was being written when its worker was killed: its claim, and partial files of garbage.
    owner = _dead_owner()
    (shard_dir.root / "00002.claim-0").write_text(json.dumps({"owner": asdict(owner)}))
    partial = shard_dir.root / f"00002_text_document.bin.tmp{owner.pid}"
    partial.write_bytes(b"\xff" * 1000)
    (shard_dir.root / f"00002_text_document.idx.tmp{owner.pid}.lengths").write_bytes(b"\xff" * 64)
    with pytest.raises(UserError, match=r"shard\(s\) not done"):
        shards.finish(shard_dir)

    again = shards.run_worker(shard_dir)
    assert again.done == list(range(2, len(plan.shards))) and again.held_elsewhere == []
    assert {i: shard_dir.marker(i).stat().st_mtime_ns for i in (0, 1)} == finished  # not redone
    assert not list(shard_dir.root.glob("*.tmp*")) and not list(shard_dir.root.glob("*.claim-*"))
    assert "left by an interrupted worker" in caplog.text
    shards.finish(shard_dir)
    prefixes = read_blend(shards.blend_path(plan, "text"))[1::2]
    assert [d for p in prefixes for d in _documents(p)] == _documents(single.output_prefix_for("text"))
    # Everything done: a third worker does nothing.
    assert shards.run_worker(shard_dir).done == []


def test_a_changed_tokenizer_input_or_option_is_refused_naming_it(tmp_path, corpus, minilm_dir):
    config = _config(tmp_path, corpus, minilm_dir)
    shards.prepare(shards.plan_corpus(config, 40 << 10))
    shards.prepare(shards.plan_corpus(config, 40 << 10))  # the same plan: resumed
    sp_model = assets.member("mistral-common", "mistral_common/data/tokenizer.model.v1")
    other = replace(config, tokenizer=TokenizerConfig(tokenizer_model=str(sp_model)))
    with pytest.raises(UserError, match=r"changed: the tokenizer \(HFTokenizer|changed: the tokenizer \("):
        shards.prepare(shards.plan_corpus(other, 40 << 10))
    with pytest.raises(UserError, match=r"option append_eod \(True -> False\)"):
        shards.prepare(shards.plan_corpus(replace(config, append_eod=False), 40 << 10))
    with pytest.raises(UserError, match=r"--shard-size \(40960 -> 81920 bytes\)"):
        shards.prepare(shards.plan_corpus(config, 80 << 10))
    with open(corpus[0], "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    with pytest.raises(UserError, match=rf"input {corpus[0]} changed \(size \d+ -> \d+ bytes"):
        shards.prepare(shards.plan_corpus(config, 40 << 10))
    # A fresh plan does not replace the outputs of a run without shards.
    preprocess(_config(tmp_path, corpus[1:2], minilm_dir, name="plain"))
    with pytest.raises(UserError, match=r"plain_text_document.bin already exists \(not made from a shard plan\)"):
        shards.prepare(shards.plan_corpus(_config(tmp_path, corpus[1:2], minilm_dir, name="plain"), 40 << 10))
    # --overwrite starts over with the new plan.
    shard_dir = shards.prepare(shards.plan_corpus(replace(config, overwrite=True), 40 << 10), overwrite=True)
    assert shard_dir.read_plan().inputs[0]["size"] == os.path.getsize(corpus[0])


def test_sharding_refuses_sentence_splitting_and_a_bad_size(tmp_path, corpus, minilm_dir):
    with pytest.raises(UserError, match="--split-sentences with --shard-size"):
        shards.plan_corpus(_config(tmp_path, corpus, minilm_dir, split_sentences=True), 1 << 20)
    assert shards.parse_size("2GB") == 2 << 30 and shards.parse_size("512M") == 512 << 20
    assert shards.parse_size("1000") == 1000
    with pytest.raises(UserError, match="--shard-size: expected a size such as 512MB"):
        shards.parse_size("lots")
