"""Evaluation fixtures shared by the harness tests (unit) and the grid workers' and speed tests
(integration): import them by name (``from eval_fixtures import TINY, encoder, suite``); tests/ is on
``pythonpath``."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = {"max_steps": 3, "batch_size": 8, "max_eval_examples": 16, "max_length": 32, "device": "cpu"}
"""CI-sized runs: a few steps on short inputs, scored on 16 validation and 16 test examples."""


@pytest.fixture(scope="module")
def suite() -> Path:
    """The default suite directory (under the data dir, like the assets cache): building
    wiki_mentions takes ~12 s of CPU, so it is built once and kept, as tools/evaluate.py does."""
    from megatron_ext.eval.suite import build_task
    from megatron_ext.eval.task_io import TASK_FILE, default_suite_dir

    root = default_suite_dir()
    for name in ("rt_sentiment", "wiki_mentions"):
        if not (root / name / TASK_FILE).is_file():
            build_task(name, root)
    return root


@pytest.fixture(scope="module")
def encoder(tmp_path_factory, minilm_dir) -> str:
    """all-MiniLM-L6-v2 cut to its first layer (real weights and tokenizer; 6 layers are too slow
    for a CI grid on 2 CPU cores)."""
    from transformers import AutoModel, AutoTokenizer

    out = tmp_path_factory.mktemp("minilm_l1")
    AutoModel.from_pretrained(minilm_dir, num_hidden_layers=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(out)
    return str(out)
