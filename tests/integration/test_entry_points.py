"""One error path (``megatron_ext.cli.entry``): every console script of pyproject.toml, run as a
user runs it (a fresh process) with one bad input, prints exactly one stderr line
``<tool>: error: ...`` naming that input, no traceback, and exits with 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from megatron_ext.cli.entry import error_line
from megatron_ext.exit_codes import USER_ERROR_EXIT_CODE
from helpers import tiny_recipe

REPO = Path(__file__).resolve().parents[2]
PAPER_STUDY = REPO / "examples" / "studies" / "paper_610m.yaml"
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def _pretrain(tmp: Path, corpus: dict) -> tuple[list[str], str]:
    recipe = tiny_recipe(corpus, tmp, training={"train_itrs": 5})
    (tmp / "recipe.json").write_text(json.dumps(recipe))
    return ["--config", str(tmp / "recipe.json")], "unknown key(s) ['train_itrs']"


BAD_INPUTS = {
    # console script: (tmp dir, tiny corpus) -> (argv, what the line must name)
    "megatron-ext-pretrain": _pretrain,
    "megatron-ext-preprocess-data": lambda tmp, corpus: (
        ["--input", str(tmp / "missing.jsonl"), "--output-prefix", str(tmp / "out"),
         "--tokenizer-model", corpus["tokenizer"]], f"--input '{tmp / 'missing.jsonl'}': no such file"),
    "megatron-ext-train-tokenizer": lambda tmp, corpus: (
        ["--input", str(tmp / "missing.jsonl"), "--output-dir", str(tmp / "tok")],
        f"--input '{tmp / 'missing.jsonl'}': no such file"),
    "megatron-ext-fetch-sample-data": lambda tmp, corpus: (
        ["--valid-fraction", "1.5", "--output-dir", str(tmp / "corpus")], "valid_fraction must be in [0, 1), got 1.5"),
    "megatron-ext-import-hf-checkpoint": lambda tmp, corpus: (
        ["--hf-model", str(tmp / "missing"), "--output-dir", str(tmp / "out")],
        f"--hf-model {tmp / 'missing'}: no such directory"),
    "megatron-ext-export-hf-checkpoint": lambda tmp, corpus: (
        ["--checkpoint", str(tmp / "missing"), "--output-dir", str(tmp / "out")],
        f"--checkpoint: no complete checkpoint at {tmp / 'missing'}"),
    "megatron-ext-merge-checkpoints": lambda tmp, corpus: (
        ["--method", "uniform", str(tmp / "missing"), "--out", str(tmp / "out")],
        f"parent 1 {tmp / 'missing'}: no complete checkpoint at {tmp / 'missing'}"),
    "megatron-ext-evaluate": lambda tmp, corpus: (
        ["--models", str(tmp / "missing"), "--tasks", "rt_sentiment", "--output-dir", str(tmp / "out")],
        f"model '{tmp / 'missing'}': {tmp / 'missing'} is not a directory"),
    "megatron-ext-build-eval-suite": lambda tmp, corpus: (  # argparse's own check, one line too
        ["--tasks", "no_such_task", "--output-dir", str(tmp / "suite")], "argument --tasks: invalid choice: 'no_such_task'"),
    "megatron-ext-fetch-benchmarks": lambda tmp, corpus: ([], "--output-dir is required"),
    "megatron-ext-plot-loss": lambda tmp, corpus: ([str(tmp / "missing")], f"{tmp / 'missing'}: no metrics.jsonl"),
    "megatron-ext-plan-study": lambda tmp, corpus: (
        [str(tmp / "missing.yaml"), "--dry-run"], str(tmp / "missing.yaml")),
    "megatron-ext-study-report": lambda tmp, corpus: (
        [str(PAPER_STUDY), "--eval-dir", str(tmp), "--output-dir", str(tmp / "report")],
        f"--eval-dir {tmp}: no summary.json"),
    "megatron-ext-run-study": lambda tmp, corpus: (
        [str(tmp / "missing.yaml"), "--launcher", "local"], f"{tmp / 'missing.yaml'}: no such study file"),
    "megatron-ext-fill-mask": lambda tmp, corpus: (
        [str(tmp / "missing"), "The [MASK] is here."], f"model_dir {tmp / 'missing'}: no such directory"),
}


def test_every_console_script_has_a_bad_input_case():
    assert sorted(BAD_INPUTS) == sorted(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_bad_input_is_one_line_and_exit_code_2(script, tmp_path, tiny_corpus):
    module = SCRIPTS[script].partition(":")[0]
    tool = module.rpartition(".")[2] + ".py"
    argv, named = BAD_INPUTS[script](tmp_path, tiny_corpus)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("RANK", None)
    run = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == USER_ERROR_EXIT_CODE, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr[-3000:]  # no third-party warning either (entry.THIRD_PARTY_WARNINGS)
    assert lines[0].startswith(f"{tool}: error: ") and named in lines[0], lines[0]


def test_the_line_names_the_rank_and_joins_listed_problems(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    message = "cannot resume: this run changes:\n  model.num_layers: 2 -> 4\n  model.vocab_size: 1 -> 2\nUse another"
    assert error_line("pretrain_encoder.py", message) == (
        "pretrain_encoder.py: error (rank 3): cannot resume: this run changes: model.num_layers: 2 -> 4; "
        "model.vocab_size: 1 -> 2; Use another")
