# megatron_ext: `make demo` runs the main job on its embedded default, `make test` runs the tests.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

PYTHON ?= python3.12
VENV := .venv
PY := $(VENV)/bin/python
DATA ?= data
DEMO_CORPUS := $(DATA)/demo_corpus
DEMO_TOKENIZER := $(DATA)/demo_tokenizer
DEMO_DATASET := $(DATA)/demo_dataset
# Extra pretrain_encoder.py flags for the demo, e.g. DEMO_ARGS="--train-iters 200"
DEMO_ARGS ?=

.PHONY: setup demo-data demo miniature test test-quick bench docs clean

# Idempotent: re-installs only when a requirements file changed.
setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; megatron-core needs Python >= 3.12 (set PYTHON=/path/to/python3.12)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 2>&1 | { grep -v "is ignored: it is neither" || true; }
	$(PY) -m pip install -q -r requirements-dev.txt 2>&1 | { grep -v "is ignored: it is neither" || true; }
	$(PY) -m pip install -q --no-deps -e . 2>&1 | { grep -v "is ignored: it is neither" || true; }
	$(PY) -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, '| torch', torch.__version__)" 2>/dev/null
	touch $@

# The demo corpus (a pinned registry download), its tokenizer and dataset: built when absent.
demo-data: $(DEMO_DATASET)/train_text_document.idx $(DEMO_DATASET)/valid_text_document.idx

$(DEMO_CORPUS)/train.jsonl: | setup
	$(PY) tools/fetch_sample_data.py --output-dir $(DEMO_CORPUS) --overwrite

$(DEMO_TOKENIZER)/tokenizer.json: $(DEMO_CORPUS)/train.jsonl
	$(PY) tools/train_tokenizer.py --input $(DEMO_CORPUS)/train.jsonl --output-dir $(DEMO_TOKENIZER) --vocab-size 8192 --overwrite

$(DEMO_DATASET)/%_text_document.idx: $(DEMO_CORPUS)/train.jsonl $(DEMO_TOKENIZER)/tokenizer.json
	mkdir -p $(DEMO_DATASET)
	$(PY) tools/preprocess_data.py --input $(DEMO_CORPUS)/$*.jsonl --output-prefix $(DEMO_DATASET)/$* \
		--tokenizer-model $(DEMO_TOKENIZER) --append-eod --workers 2 --overwrite --no-progress

demo: demo-data
	$(PY) pretrain_encoder.py --config examples/recipes/demo_tiny_biphasic.yaml $(DEMO_ARGS)
	$(PY) tools/plot_loss.py runs/demo --output runs/demo/loss.png
	$(PY) tools/export_hf_checkpoint.py --checkpoint runs/demo/checkpoints --output-dir runs/demo/hf_eurobert --overwrite
	$(PY) tools/fill_mask.py runs/demo/hf_eurobert

# The paper in miniature: a study (examples/studies/miniature.yaml) trained, evaluated and reported
# by the local launcher, the code path of a cluster study. Rerunning skips what is complete.
miniature: demo-data
	$(PY) tools/run_study.py examples/studies/miniature.yaml --launcher local

# Two pytest-xdist workers, whatever the core count: the suite waits on subprocesses and SLURM jobs
# part of its time (TEST_WORKERS=0: one process). tests/unit/ holds the tests of one part in this
# process (seconds each); tests/integration/ the whole runs: trainers, torchrun, SLURM jobs, studies,
# benchmark scripts, the docs' commands. How tests are grouped and ordered: tests/conftest.py.
# The docs' recipes and the benchmarks name the demo tokenizer (data/demo_tokenizer): built first.
TEST_WORKERS ?= 2
test: setup demo-data
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=30 tests

# The edit loop: the unit tests only (tests/unit/).
test-quick: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests/unit

bench: setup
	$(PY) -m benchmarks.preprocess

# The generated parts of README.md and docs/ rendered again (GPU and benchmark tables, recipe keys,
# exit codes, each tool's --help), then every page checked against the code (tests/integration/test_docs.py).
docs: setup
	$(PY) -m tools.render_docs
	$(PY) -m tools.check_docs --no-run

clean:
	rm -rf $(VENV) .pytest_cache
