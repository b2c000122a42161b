"""tools/preprocess_data.py --shard-size --launcher slurm on the private test cluster (tests/slurm_cluster.py):
the shards are tokenized by a SLURM job array, the blend by a job after it, and the result equals
the single-process output; the same command again submits nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.data import shards
from megatron_ext.data.blend_file import read_blend
from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.tokenizer import TokenizerConfig

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_ENV = ("OMP_NUM_THREADS", "PYTHON", "MEGATRON_EXT_EXIT_STATUS_FILE")


def _documents(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_slurm_array_tokenizes_the_shards_and_the_rerun_submits_nothing(slurm_cluster, tmp_path, news_texts,
                                                                          minilm_dir):
    for name, texts in (("a", news_texts[:150]), ("b", news_texts[150:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    inputs = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    single = PreprocessConfig(inputs=tuple(inputs), output_prefix=str(tmp_path / "single"), append_eod=True,
                              tokenizer=TokenizerConfig(tokenizer_model=str(minilm_dir)), progress=False)
    preprocess(single)
    env = {**{k: v for k, v in slurm_cluster.env.items() if k not in LAUNCH_ENV}, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "megatron_ext.cli.preprocess_data", "--input", *inputs, "--output-prefix",
               str(tmp_path / "out"), "--tokenizer-model", str(minilm_dir), "--append-eod", "--shard-size", "60KB",
               "--workers", "2", "--launcher", "slurm", "--sbatch-arg=--time=10", "--sbatch-arg=--cpus-per-task=1",
               "--wait", "--poll-interval", "1"]
    dry = subprocess.run(command + ["--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "sbatch --parsable --array=0-1 --job-name=preprocess.out" in dry.stdout, dry.stdout
    assert "--dependency=afterok:<workers>" in dry.stdout and "program.sbatch -m megatron_ext.cli.preprocess_worker" \
        in dry.stdout

    first = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "shards 6/6, 300 documents" in first.stdout, first.stdout
    logs = sorted(p.name for p in (tmp_path / "out.shards" / "logs").glob("worker-*_*.out"))
    assert len(logs) == 2, logs  # the array's two tasks
    plan = shards.ShardDir.for_prefix(str(tmp_path / "out")).read_plan()
    prefixes = read_blend(shards.blend_path(plan, "text"))[1::2]
    assert [d for p in prefixes for d in _documents(p)] == _documents(single.output_prefix_for("text"))

    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "slurm job" not in again.stdout and "shards 6/6" in again.stdout, again.stdout
