"""The docs against the code: every command on the README's and docs/'s pages runs or is checked as
its block is marked, every flag, recipe key, repository path, link and quoted error line they name
exists (``tools/check_docs.py``), and the generated parts are what ``tools/render_docs.py`` renders
now. The checker's own test shows that a changed flag, key, path, link or message fails it.

The commands run inside this process (no interpreter start per command), so the module costs the
imports of the tools, two dry runs and docs/evaluation.md's own-task example: one fine-tune of 10
steps, with a one-layer MiniLM encoder standing in for the model the page names."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tools.check_docs import REPO, DocsChecker, doc_pages
from tools.render_docs import GENERATORS, REGION, render_page
from eval_fixtures import encoder  # noqa: F401 (fixture)

STAND_IN_MODEL = "runs/demo/checkpoints"
"""The model docs/evaluation.md's own-task example names (the one `make demo` trains)."""


@pytest.fixture(scope="module")
def checker(demo_tokenizer, encoder, tmp_path_factory) -> DocsChecker:  # noqa: F811
    # demo_tokenizer: the pages' recipes name data/demo_tokenizer; encoder: the stand-in model
    return DocsChecker(run=True, scratch=tmp_path_factory.mktemp("docs_scratch"),
                       stand_ins={STAND_IN_MODEL: encoder})


def test_every_page_matches_the_code(checker):
    problems = checker.check_pages(doc_pages())
    assert not problems, "\n".join(map(str, problems))


def test_generated_parts_are_current():
    stale = []
    for page in doc_pages():
        text = page.read_text()
        if REGION.search(text) and render_page(text, page) != text:
            stale.append(str(page.relative_to(REPO)))
    assert not stale, f"out of date, run `python -m tools.render_docs`: {stale}"


def test_the_gpu_status_names_a_stage_that_stopped_itself_and_lists_what_did_not_run(tmp_path, monkeypatch):
    import json

    from tools import render_docs

    visit = tmp_path / "h100-2030-01-01"
    visit.mkdir()
    (visit / "summary.json").write_text(json.dumps({"device": "GPU", "commit": "abc1234", "budget_s": 500,
                                                    "elapsed_s": 499, "stages": [
        {"name": "gpu_tests", "status": "failed", "exit_code": 124, "reason": "wrote x.json",
         "figures": {"counts": {"passed": 3, "unfinished": 1}}},
        {"name": "fp8_gemm", "status": "skipped", "exit_code": None, "reason": "needs >= 40 s, 1 s left",
         "figures": {}}]}))
    newest = render_docs.newest_gpu_suite_run(tmp_path)
    assert newest.folder == visit
    monkeypatch.setattr(render_docs, "newest_gpu_suite_run", lambda: newest)
    text = render_docs.render_gpu_status(tmp_path / "README.md")
    assert "| `gpu_tests` | timed out (stopped itself at its limit) | 3 passed, 1 unfinished |" in text
    assert text.rstrip().endswith("Not run in that visit: `fp8_gemm` (needs >= 40 s, 1 s left).")


def test_every_page_is_on_the_readme_map():
    readme = (REPO / "README.md").read_text()
    unlinked = [str(page.relative_to(REPO)) for page in doc_pages()[1:]
                if f"]({page.relative_to(REPO)})" not in readme and f"]({page.relative_to(REPO)}#" not in readme]
    assert not unlinked, f"pages the README's documentation map does not link: {unlinked}"


def test_every_generator_is_used():
    used = {match["name"].split()[0] for page in doc_pages() for match in REGION.finditer(page.read_text())}
    assert used == set(GENERATORS)


def test_the_renderer_rewrites_a_hand_edited_region():
    page = REPO / "docs" / "troubleshooting.md"
    text = page.read_text()
    edited = text.replace("| **75** |", "| **77** |", 1)
    assert edited != text
    assert render_page(edited, page) == text


# A page that matches the code, and the same page with one thing changed at a time: each change is
# one problem, named.
PAGE = """# A page

What it is for: the checker's own test.

<!-- check: help -->
```bash
python pretrain_encoder.py --config examples/recipes/paper/610m_mlm_40.yaml --micro-batch-size 4 --dry-run
RECIPE=examples/recipes/paper/610m_mlm_40.yaml DRY_RUN=1 bash examples/launch/slurm.sbatch
make test TEST_WORKERS=0
python -m benchmarks.recipe_defaults --check
```

<!-- check: dry-run -->
```bash
python tools/plan_study.py examples/studies/miniature.yaml --dry-run
```

Resume past a damaged checkpoint with `--load-step N`; `training.rope_fusion` fuses RoPE;
`mask_ratio: 0.4`; the lock lives in `megatron_ext/checkpoint/lock.py` (`checkpoint/lock.py`);
`megatron_ext.exit_codes.RESUMABLE_EXIT_CODE`, `cuda_on_cpu.check_megatron_runs_here`; see [the clusters page](clusters.md#exit-codes).

```yaml
training: {train_iters: 100, rope_fusion: true}
```

<!-- check: messages -->
| the line says | fix |
|---|---|
| `is in use by another trainer` | wait |
"""

CHANGES = {
    "a flag in a command": ("--micro-batch-size 4", "--micro-batch-sise 4", "has no flag --micro-batch-sise"),
    "a flag in prose": ("`--load-step N`", "`--load-steps N`", "has no flag --load-steps"),
    "a recipe file in a command": ("paper/610m_mlm_40.yaml --micro", "paper/610m_mlm_41.yaml --micro",
                                   "no such file or directory: examples/recipes/paper/610m_mlm_41.yaml"),
    "a launch script's variable": ("DRY_RUN=1 bash", "DRYRUN=1 bash", "does not read DRYRUN"),
    "a make target": ("make test TEST", "make tests TEST", "no make target 'tests'"),
    "a benchmark run by its path": ("python -m benchmarks.recipe_defaults", "python benchmarks/recipe_defaults.py",
                                    "run it as python -m benchmarks.recipe_defaults"),
    "a dry run that fails": ("examples/studies/miniature.yaml --dry-run", "examples/recipes/demo_tiny_biphasic.yaml --dry-run",
                             "exited 2"),
    "a dry-run block without --dry-run": ("miniature.yaml --dry-run\n", "miniature.yaml\n", "without --dry-run"),
    "a dotted recipe key": ("`training.rope_fusion`", "`training.rope_fusoin`", "recipe section training has no key rope_fusoin"),
    "a key: value": ("`mask_ratio: 0.4`", "`mask_ration: 0.4`", "no config key mask_ration"),
    "a key in YAML": ("rope_fusion: true}", "rope_fusions: true}", "no key 'rope_fusions'"),
    "a repository path": ("megatron_ext/checkpoint/lock.py", "megatron_ext/checkpoint/core.py",
                          "no such file or directory: megatron_ext/checkpoint/core.py"),
    "a path inside the package": ("(`checkpoint/lock.py`)", "(`checkpoint/locks.py`)", "no such file or directory"),
    "a module attribute": ("exit_codes.RESUMABLE_EXIT_CODE", "exit_codes.RESUMABLE_EXIT", "no such module or attribute"),
    "a function moved": ("`cuda_on_cpu.check_megatron_runs_here`", "`hardware.check_megatron_runs_here`",
                         "megatron_ext.hardware has no check_megatron_runs_here"),
    "a link": ("(clusters.md#exit-codes)", "(cluster.md#exit-codes)", "link to a missing file"),
    "a link's heading": ("(clusters.md#exit-codes)", "(clusters.md#exit-code)", "link to a missing heading"),
    "a quoted error line": ("`is in use by another trainer`", "`is used by another trainer`",
                            "no error line of the code contains 'is used by another trainer'"),
    "an issue number": ("# A page\n", "# A page (issue 46)\n", "an internal issue number"),
    "an unmarked block": ("<!-- check: help -->\n", "", "a bash block without a marker"),
}


def test_the_checker_passes_the_page(checker):
    page = REPO / "docs" / "checker_test.md"  # never written: the links resolve from docs/
    assert checker.check_text(PAGE, page) == []


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_the_checker_fails_on_a_change(checker, change):
    old, new, expected = CHANGES[change]
    assert old in PAGE
    problems = checker.check_text(PAGE.replace(old, new, 1), REPO / "docs" / "checker_test.md")
    assert len(problems) == 1 and expected in problems[0].message, (change, [str(p) for p in problems])


def test_the_checker_runs_a_recipe_block(checker):
    recipe = "\n".join(["<!-- check: recipe -->", "```yaml", "model: {preset: tiny}",
                        "tokenizer: {tokenizer_model: data/demo_tokenizer}",
                        "data: {data_path: [d], seq_length: 128, micro_batch_size: 8, global_batch_size: 16}",
                        "schedule: {lr: 1.0e-3, lr_decay_style: constant}", "phases: [{objective: mlm, mask_ratio: 0.4, share: 1.0}]",
                        "training: {train_iters: 10}", "```", ""])
    page = Path(REPO / "docs" / "checker_test.md")
    assert checker.check_text(recipe, page) == []
    problems = checker.check_text(recipe.replace("share: 1.0", "share: 0.5"), page)
    assert len(problems) == 1 and "does not validate" in problems[0].message, [str(p) for p in problems]


def test_the_minimal_recipe_trains_as_the_page_shows_it(checker):
    """docs/pretraining.md's minimal recipe is the file its run command trains (as written: every
    step, the checkpoints), with its outputs in the scratch directory, not the repository."""
    page = REPO / "docs" / "pretraining.md"
    assert checker.check_blocks(page.read_text(), page) == []  # run once by the first test too: cached
    [recipe] = checker.scratch.glob("files-*/my_recipe.yaml")
    saved = recipe.parent / "runs" / "mine" / "checkpoints"
    assert yaml.safe_load(recipe.read_text())["checkpoint"]["save"] == str(saved)
    assert (saved / "iter_0000100").is_dir() and not (REPO / "runs" / "mine").exists()
    # a recipe block with a name is still checked as a recipe: an invalid one fails before it runs
    text = page.read_text().replace("share: 0.75}", "share: 0.5}", 1)
    problems = checker.check_blocks(text, page)
    assert any("does not validate" in problem.message for problem in problems), [str(p) for p in problems]


def test_the_own_task_example_runs_on_the_files_the_page_shows(checker):
    """docs/evaluation.md's folder of CSV/JSONL files is written as shown and evaluated: a change to
    a column the code reads (or to the files' layout) fails the page."""
    page = REPO / "docs" / "evaluation.md"
    text = page.read_text()
    assert checker.check_text(text, page) == []  # run once by the first test too: cached
    [written] = [path for path in checker.scratch.glob("files-*/my_topics/test.jsonl")]
    assert written.read_text().count('"label"') == 3
    runs = sorted(checker.scratch.glob("files-*/runs/eval_try/runs/demo/my_topics/*.json"))
    assert [path.name for path in runs] == ["lr0.0001_seed0.json"]  # the outputs went to the scratch dir
    assert not (REPO / "runs" / "eval_try").exists() and not (REPO / "my_topics").exists()
    for old, new in (("text,label\n\"Oil", "sentence,label\n\"Oil"),  # a column renamed
                     ("file my_topics/test.jsonl", "file my_topics/tests.jsonl")):  # a split misnamed
        assert old in text
        problems = checker.check_text(text.replace(old, new, 1), page)
        assert len(problems) == 1 and "exited 2" in problems[0].message, [str(p) for p in problems]


def test_a_file_block_names_a_relative_path_once(checker):
    page = REPO / "docs" / "checker_test.md"
    block = "<!-- check: file {} -->\n```csv\ntext,label\n```\n"
    assert checker.check_text(block.format("my_dir/train.csv"), page) == []
    for name in ("../train.csv", "/tmp/train.csv"):
        problems = checker.check_text(block.format(name), page)
        assert len(problems) == 1 and "names a relative path" in problems[0].message, [str(p) for p in problems]
    problems = checker.check_text(block.format("a/x.csv") * 2, page)
    assert len(problems) == 1 and "a second file block for a/x.csv" in problems[0].message
