"""Phases that change the data (``training.mixtures``), on CPU with real text: three sources (300 real
news articles cut into 150, 100 and 50 documents, one prefix each, the tiny corpus's tokenizer),
phases that switch blends and temperatures and, in the last, the length. Temperature shares against
hand-computed values; every source continued across switches and read once per epoch; exact resume
before, at, after and across the switches; a changed started phase refused; each validation source's
losses; the dry run's reads equal to the trainer's; a branch that trains another mixture."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from helpers import tiny_recipe
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.config_loading import UserError
from megatron_ext.training import context
from megatron_ext.training.datasets import blend_counts, build_span_dataset, plan_source_reads
from megatron_ext.training.loop import pretrain
from megatron_ext.training.mixtures import Mixture, SpanReads, plan_reads, source_shares
from megatron_ext.training.recipe import run_config_from_dict

SIZES = {"a": (0, 150), "b": (150, 250), "c": (250, 300)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_corpus, news_texts) -> dict[str, str]:
    """Three prefixes of real news made with the tiny corpus's tokenizer (its record written)."""
    from megatron_ext.data.preprocess import PreprocessConfig, preprocess
    from megatron_ext.tokenizer import TokenizerConfig

    root = tmp_path_factory.mktemp("sources")
    out = {}
    for name, (lo, hi) in SIZES.items():
        jsonl = root / f"{name}.jsonl"
        jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in news_texts[lo:hi]))
        preprocess(PreprocessConfig(inputs=(str(jsonl),), output_prefix=str(root / name),
                                    tokenizer=TokenizerConfig(tokenizer_model=tiny_corpus["tokenizer"]),
                                    append_eod=True, progress=False))
        out[name] = str(root / f"{name}_text_document")
    return out


def _phases(src: dict[str, str], last: list[str] | None = None) -> list[dict]:
    """{a, b} at tau 0.5 (CLM) -> {b, c} (MLM) -> {a} at 128 tokens (MLM), 3 steps each."""
    return [{"objective": "clm", "steps": 3, "data_path": [src["a"], src["b"]], "temperature": 0.5},
            {"objective": "mlm", "mask_ratio": 0.4, "steps": 3, "data_path": [src["b"], src["c"]]},
            {"objective": "mlm", "mask_ratio": 0.4, "steps": 3, "data_path": last or [src["a"]], "seq_length": 128}]


def _recipe(corpus, src, run_dir, **sections) -> dict:
    data = {"data_path": [src["a"], src["b"], src["c"]], "split": "90,10,0", "seq_length": 64,
            "micro_batch_size": 4, "global_batch_size": 8, "eval_iters": 1,
            "data_cache_path": str(run_dir / "index_cache")}
    return tiny_recipe(corpus, run_dir, **{"phases": _phases(src), "data": data,
                                           "training": {"train_iters": 9, "eval_interval": 3, "log_interval": 1},
                                           "checkpoint": {"save": str(run_dir / "ckpt"), "save_interval": 3},
                                           **sections})


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_corpus, sources):
    run_dir = tmp_path_factory.mktemp("straight")
    config = run_config_from_dict(_recipe(tiny_corpus, sources, run_dir))
    return run_dir, config, pretrain(config)


def test_temperature_shares_against_hand_computed_values():
    unweighted = Mixture(data_path=("a", "b"), temperature=0.5)
    assert source_shares(unweighted, [100, 25]) == pytest.approx([10 / 15, 5 / 15])  # sqrt: 10 : 5
    assert source_shares(Mixture(data_path=("a", "b")), [100, 25]) == pytest.approx([0.8, 0.2])  # tau 1: sizes
    assert source_shares(Mixture(data_path=("a", "b"), temperature=0.0), [100, 25]) == [0.5, 0.5]  # uniform
    weighted = Mixture(data_path=("1", "a", "4", "b", "16", "c"), temperature=0.5)  # weights, not sizes
    assert source_shares(weighted, [7, 7, 7]) == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    # mmBERT's annealing flattens a skewed mix: 0.7 -> 0.5 -> 0.3 moves shares towards uniform.
    skewed = [10_000, 100, 1]
    low = [source_shares(Mixture(data_path=("a", "b", "c"), temperature=t), skewed)[2] for t in (0.7, 0.5, 0.3)]
    assert low[0] < low[1] < low[2] < 1 / 3


def _plan(spans_spec, per_epoch):
    """plan_reads over hand-made spans: (start, end, length, sources, samples)."""
    class Span:
        def __init__(self, start, end, length, prefixes, samples):
            self.start, self.end, self.seq_length, self.samples = start, end, length, samples
            self.mixture = Mixture(data_path=tuple(prefixes))
    spans = [Span(*spec) for spec in spans_spec]
    return plan_reads(spans, samples_per_epoch=lambda prefix, length: per_epoch[prefix] * 64 // length,
                      blend_counts=blend_counts, sample_count=lambda span: span.samples)


def test_a_source_continues_where_the_run_left_it_and_a_new_one_starts_at_its_beginning():
    plans = _plan([(0, 10, 64, ["a", "b"], 100), (10, 20, 64, ["b", "c"], 100), (20, 30, 64, ["a"], 50),
                   (30, 40, 128, ["a", "c"], 40)], per_epoch={"a": 1000, "b": 1000, "c": 1000})
    first = {(i, s.prefix): (s.first_sample, s.samples) for i, p in enumerate(plans) for s in p.sources}
    assert first[(0, "a")] == (0, 50) and first[(0, "b")] == (0, 50)  # equal sizes: half each
    assert first[(1, "b")][0] == 50 and first[(1, "c")][0] == 0        # b continues, c is new
    assert first[(2, "a")] == (50, 50)                                  # a comes back where it stopped
    # At twice the length a source's cursor is its tokens read: 100 samples of 64 = 50 of 128.
    assert first[(3, "a")][0] == 50 and first[(3, "c")][0] == math.ceil(first[(1, "c")][1] / 2)


def test_every_source_is_read_once_per_epoch_over_many_switches(sources, tiny_corpus):
    """Twelve switches between random mixtures at one length, enough samples for each source to wrap
    its epochs several times: per source, the stream positions read are 0, 1, 2, ... (none skipped,
    none read twice), and each epoch's samples are Megatron's one-epoch dataset in its own shuffle."""
    from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer
    from megatron_ext.training.config import DataConfig

    config = DataConfig(data_path=tuple(sources.values()), split="90,10,0", seq_length=64, micro_batch_size=4,
                        global_batch_size=8, eval_iters=0, data_cache_path=str(tiny_corpus["data"]) + "_cache")
    rng = np.random.default_rng(0)
    names = list(sources)
    spans = []
    for i in range(12):
        chosen = sorted(rng.choice(names, size=int(rng.integers(1, 4)), replace=False))
        span = context.DatasetSpan(seq_length=64, start=i, end=i + 1, first_sample=0, contexts=(),
                                   mixture=Mixture(data_path=tuple(sources[n] for n in chosen),
                                                   temperature=float(rng.choice([0.3, 0.7, 1.0]))))
        spans.append((span, int(rng.integers(200, 800))))
    plans = plan_reads([s for s, _ in spans], samples_per_epoch=lambda p, length: plan_source_reads(
        config, [context.DatasetSpan(seq_length=length, start=0, end=1, first_sample=0, contexts=(),
                                     mixture=Mixture(data_path=(p,)))])[0].sources[0].samples_per_epoch,
        blend_counts=blend_counts, sample_count=lambda span: dict(spans)[span])
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=tiny_corpus["tokenizer"]))
    positions = {p: [] for p in sources.values()}
    epochs_seen = {}
    for plan in plans:
        dataset = build_span_dataset(config, plan, tokenizer=tokenizer, seed=1234)
        for j in range(len(dataset)):
            s = int(dataset.dataset_index[j])
            source = plan.sources[s]
            position = source.first_sample + int(dataset.dataset_sample_index[j])
            positions[source.prefix].append(position)
            epoch, sample = divmod(position, source.samples_per_epoch)
            epochs_seen.setdefault(source.prefix, set()).add(epoch)
            if j % 97 == 0:  # the sample is that epoch's Megatron sample
                np.testing.assert_array_equal(dataset[j]["tokens"], dataset.epochs[(s, epoch)][sample]["tokens"])
    for prefix, read in positions.items():
        assert read == list(range(len(read))), f"{prefix}: a stream sample skipped or read twice"
    assert max(len(e) for e in epochs_seen.values()) >= 3  # some source wrapped its epochs
    # Epochs after the first are reshuffled: epoch 1 is not epoch 0 again.
    wrapped = next(p for p, e in epochs_seen.items() if {0, 1} <= e)
    built = {}
    for plan in plans:
        for s, source in enumerate(plan.sources):
            if source.prefix == wrapped and {0, 1} <= set(source.epochs):
                dataset = build_span_dataset(config, plan, tokenizer=tokenizer, seed=1234)
                built = {e: dataset.epochs[(s, e)] for e in (0, 1)}
    if built:
        assert not np.array_equal(built[0][0]["tokens"], built[1][0]["tokens"])


def test_phases_read_their_own_mixtures_and_validation_reports_each_source(straight, sources):
    run_dir, config, result = straight
    assert result.final_step == 9
    spans = context.dataset_spans(config.phase_contexts)
    assert [(s.start, s.end, s.seq_length) for s in spans] == [(0, 3, 64), (3, 6, 64), (6, 9, 128)]
    records = [json.loads(line) for line in (run_dir / "log/metrics.jsonl").read_text().splitlines()]
    header = next(r for r in records if "source_reads" in r)
    reads = [[(s["prefix"], s["first_sample"], s["samples"]) for s in span["sources"]] for span in header["source_reads"]]
    assert [[p for p, _, _ in span] for span in reads] == [[sources["a"], sources["b"]], [sources["b"], sources["c"]],
                                                           [sources["a"]]]
    a_first, b_first = reads[0][0][2], reads[0][1][2]
    assert a_first + b_first == 3 * 8 and reads[1][0][1] == b_first  # b continues in the second span
    assert reads[2][0][1] == math.ceil(a_first * 64 / 128)  # a continues at 128 tokens where it stopped
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["step"] for r in valid] == [3, 6, 9]
    names = ["a_text_document", "b_text_document", "c_text_document"]
    for record in valid:
        assert list(record["by_source"]) == names
        for key in ("clm", "mlm"):
            per_source = [record["by_source"][n][key] for n in names]
            assert all(math.isfinite(v) for v in per_source)
            assert min(per_source) <= record[key] <= max(per_source)  # the blend's is their token-weighted mean
    assert result.valid_by_source[9] == valid[-1]["by_source"]
    # plot_loss draws a third panel, each source's validation loss (18 x 4.5 inches at 120 dpi).
    from PIL import Image

    from megatron_ext.cli import plot_loss

    assert plot_loss.main([str(run_dir / "log"), "--output", str(run_dir / "loss.png")]) == 0
    assert Image.open(run_dir / "loss.png").size == (2160, 540)


@pytest.mark.parametrize("stops", [(2,), (3,), (4,), (2, 7)], ids=["before", "at", "after", "across"])
def test_resume_across_blend_switches_is_exact(straight, tiny_corpus, sources, tmp_path, stops):
    _, _, uninterrupted = straight
    config = run_config_from_dict(_recipe(tiny_corpus, sources, tmp_path))
    for stop in stops:
        assert pretrain(config, exit_after_step=stop).final_step == stop
    resumed = pretrain(config)
    assert resumed.start_step == stops[-1] and resumed.final_step == 9
    for step in range(stops[-1] + 1, 10):
        assert resumed.losses[step] == uninterrupted.losses[step], f"step {step} differs after resume"
    assert resumed.valid[9] == uninterrupted.valid[9]


def test_a_resume_that_changes_a_started_phase_blend_is_refused(tiny_corpus, sources, tmp_path):
    recipe = _recipe(tiny_corpus, sources, tmp_path, training={"train_iters": 9, "eval_interval": 0})
    pretrain(run_config_from_dict(recipe), exit_after_step=4)
    changed = _recipe(tiny_corpus, sources, tmp_path, training={"train_iters": 9, "eval_interval": 0})
    changed["phases"][1]["temperature"] = 0.3
    with pytest.raises(UserError, match=r"^resuming .*step 3 reads .*2 sources .*vs .*2 sources at temperature 0\.3"
                                        r".*branch_from") as error:
        pretrain(run_config_from_dict(changed))
    assert "\n" not in str(error.value)


def test_a_branch_trains_another_decay_mixture(straight, tiny_corpus, sources, tmp_path):
    """The documented way to change a later phase: a branch from the trunk's step-6 checkpoint whose
    last phase reads another mixture; its steps before the branch are the trunk's."""
    trunk_dir, _, trunk = straight
    recipe = _recipe(tiny_corpus, sources, tmp_path, phases=_phases(sources, last=[sources["b"], sources["c"]]))
    recipe["checkpoint"] = {**recipe["checkpoint"], "branch_from": str(trunk_dir / "ckpt"), "branch_step": 6}
    branch = pretrain(run_config_from_dict(recipe))
    assert branch.start_step == 6 and branch.final_step == 9
    assert branch.losses[7] != trunk.losses[7]  # another mixture from the branch on
    # A branch that changes a phase before its branch step is refused, naming the step.
    early = _recipe(tiny_corpus, sources, tmp_path / "early")
    early["phases"][1]["data_path"] = [sources["c"]]
    early["checkpoint"] = {**early["checkpoint"], "branch_from": str(trunk_dir / "ckpt"), "branch_step": 6}
    with pytest.raises(UserError, match=r"cannot branch at step 6: .*step 3 reads"):
        pretrain(run_config_from_dict(early))


def test_the_dry_run_prints_what_the_trainer_reads(straight, tiny_corpus, sources, tmp_path, capsys):
    import yaml

    from megatron_ext.cli import pretrain_encoder

    run_dir, config, _ = straight
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(tiny_corpus, sources, run_dir)))
    assert pretrain_encoder.main(["--config", str(path), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    trained = [json.loads(line) for line in (run_dir / "log/metrics.jsonl").read_text().splitlines()]
    header = next(r for r in trained if "source_reads" in r)
    for span in header["source_reads"]:
        for source in span["sources"]:
            name = source["prefix"].rsplit("/", 1)[1]
            assert re.search(rf"{name}: share {100 * source['share']:.1f}% \| {source['samples']:,} samples", plan), plan
    assert "steps [6, 9) at seq_length 128: 12 samples from 1 source" in plan
    # Each source's cost: the spans' costs shared by the samples it gives them, adding up to the run's.
    shares = {name: float(share) for name, share in
              re.findall(r"^  source (\w+): \S+ FLOPs \(([\d.]+) %\), ", plan, re.M)}
    assert set(shares) == {"a_text_document", "b_text_document", "c_text_document"}
    assert sum(shares.values()) == pytest.approx(100, abs=0.2)


def test_phase_data_refusals(tiny_corpus, sources, tmp_path, news_texts):
    from megatron_ext.training.preflight import check_paths

    missing = _recipe(tiny_corpus, sources, tmp_path)
    missing["phases"][1]["data_path"] = [sources["b"], str(tmp_path / "nowhere_text_document")]
    with pytest.raises(UserError, match=r"^phases\[1\]\.data_path: .*nowhere_text_document"):
        check_paths(run_config_from_dict(missing))
    with pytest.raises(UserError, match=r"temperature: expected a number in \[0, 1\]"):
        bad = _recipe(tiny_corpus, sources, tmp_path)
        bad["phases"][0]["temperature"] = 1.5
        run_config_from_dict(bad)
    with pytest.raises(UserError, match=r"phases\[0\]\.data_path.*either only prefixes or alternating"):
        mixed = _recipe(tiny_corpus, sources, tmp_path)
        mixed["phases"][0]["data_path"] = ["0.5", sources["a"], sources["b"]]
        run_config_from_dict(mixed)
    # A prefix made with another tokenizer, named by the phase that reads it.
    from megatron_ext.cli import train_tokenizer
    from megatron_ext.data.preprocess import PreprocessConfig, preprocess
    from megatron_ext.tokenizer import TokenizerConfig

    jsonl = tmp_path / "other.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in news_texts[:40]))
    assert train_tokenizer.main(["--input", str(jsonl), "--output-dir", str(tmp_path / "tok"), "--vocab-size", "512",
                                 "--no-progress"]) == 0
    preprocess(PreprocessConfig(inputs=(str(jsonl),), output_prefix=str(tmp_path / "other"),
                                tokenizer=TokenizerConfig(tokenizer_model=str(tmp_path / "tok")), append_eod=True,
                                progress=False))
    other = _recipe(tiny_corpus, sources, tmp_path)
    other["phases"][2]["data_path"] = [str(tmp_path / "other_text_document")]
    with pytest.raises(UserError, match=r"^phases\[2\]\.data_path: .*other_text_document was tokenized by"):
        pretrain(run_config_from_dict(other))


def test_span_reads_are_a_function_of_the_config(straight, sources):
    """What a resume relies on: the plan computed again is the same."""
    _, config, _ = straight
    first = plan_source_reads(config.data, context.dataset_spans(config.phase_contexts))
    again = plan_source_reads(config.data, context.dataset_spans(config.phase_contexts))
    assert first == again and all(isinstance(p, SpanReads) for p in first)


def test_megatrons_per_split_paths_read_each_blend_whole_for_its_split(tiny_corpus, sources, tmp_path):
    """``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` (Megatron's
    ``blend_per_split``): training reads only its blend, every document of it (no split cut out),
    validation and test only theirs, each validation source reported; the mixes are refused."""
    from megatron_ext.data.index_checks import read_index
    from megatron_ext.megatron_compat.datasets import samples_per_epoch
    from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer
    from megatron_ext.training.config import DataConfig
    from megatron_ext.training.datasets import build_datasets

    data = dict(train_data_path=(sources["a"],), valid_data_path=(sources["b"], sources["c"]),
                test_data_path=(sources["c"],), seq_length=64, micro_batch_size=4, global_batch_size=8,
                eval_iters=1, data_cache_path=str(tmp_path / "cache"))
    config = DataConfig(**data)
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=tiny_corpus["tokenizer"]))
    whole = int(read_index(sources["a"]).tokens_before[-1])
    train, valid, test = build_datasets(config, tokenizer=tokenizer, train_samples=10, valid_samples=8,
                                        test_samples=8, seed=1234)
    assert train.dataset_path == sources["a"] and len(train) == samples_per_epoch(whole, 64)  # all of a
    assert sorted({d.dataset_path for d in valid.datasets}) == sorted([sources["b"], sources["c"]])
    assert test.dataset_path == sources["c"]
    for bad, message in [(dict(data, data_path=(sources["a"],)), r"give data_path .* or train_data_path .*not both"),
                         (dict(data, split="90,10,0"), r"data\.split '90,10,0' with train_data_path"),
                         (dict(data, valid_data_path=()), r"no valid_data_path beside train_data_path"),
                         ({**{k: v for k, v in data.items() if k != "train_data_path"}, "data_path": (sources["a"],)},
                          r"valid_data_path / test_data_path come with train_data_path")]:
        with pytest.raises(UserError, match=message):
            DataConfig(**bad)
    recipe = _recipe(tiny_corpus, sources, tmp_path / "run", data=data, phases=[
        {"objective": "clm", "share": 0.5}, {"objective": "mlm", "mask_ratio": 0.4, "share": 0.5}],
        training={"train_iters": 4, "eval_interval": 4, "log_interval": 1})
    recipe["data"] = {key: value for key, value in recipe["data"].items() if key not in ("data_path", "split")}
    result = pretrain(run_config_from_dict(recipe))
    assert list(result.valid_by_source[4]) == ["b_text_document", "c_text_document"]
    assert result.test and math.isfinite(result.test["mlm"])


def test_a_phase_may_validate_on_its_own_blend(tiny_corpus, sources, tmp_path):
    """Validation reads the run's blend (a, b, c) in every phase but one that names its own (b, c)."""
    phases = [{"objective": "clm", "steps": 2}, {"objective": "mlm", "mask_ratio": 0.4, "steps": 2,
                                                 "valid_data_path": [sources["b"], sources["c"]]}]
    recipe = _recipe(tiny_corpus, sources, tmp_path, phases=phases,
                     training={"train_iters": 4, "eval_interval": 2, "log_interval": 1})
    result = pretrain(run_config_from_dict(recipe))
    assert list(result.valid_by_source[2]) == ["a_text_document", "b_text_document", "c_text_document"]
    assert list(result.valid_by_source[4]) == ["b_text_document", "c_text_document"]
    saved = Checkpoint.open(tmp_path / "ckpt").run_config()
    assert saved["phases"][1]["valid_data_path"] == [sources["b"], sources["c"]] and "data_path" not in saved["phases"][1]


@pytest.mark.parametrize("size", ["210m", "610m", "1b"])
def test_the_annealing_recipes_plan_each_phase_mix(size, capsys):
    """examples/recipes/annealing/: the paper's biphasic run, 8,192 tokens on a new mix, a decay on
    another, planned at 64 GPUs where the data is not at hand: each phase's mix is printed."""
    from helpers import RECIPES
    from megatron_ext.cli import pretrain_encoder

    recipe = RECIPES / "annealing" / f"{size}_pretrain_anneal_decay.yaml"
    assert pretrain_encoder.main(["--config", str(recipe), "--dry-run", "--world-size", "64"]) == 0
    plan = capsys.readouterr().out
    assert re.search(r"mlm-40 +steps \[ 34750,  40000\)", plan) and re.search(r"mlm-5 +steps \[ 40000,  42000\)", plan)
    assert ("data: its own blend: fineweb_edu_text_document weight 50%, wikipedia_text_document weight 30%, "
            "books_text_document weight 20%") in plan
    assert ("data: its own blend: wikipedia_text_document weight 40%, books_text_document weight 40%, "
            "fineweb_edu_text_document weight 20%") in plan
    assert plan.count("data: the run's blend: fineweb_edu_text_document") == 2
    assert "per-source shares not computed here" in plan  # the placeholders' .idx are not on this machine


def test_the_temperature_annealed_multilingual_recipe_trains_and_validates_per_language(multilingual_sample, tmp_path,
                                                                                        capsys):
    """examples/recipes/multilingual/: mmBERT's three phases on real text in four languages (2 -> 3
    -> 4 languages, tau 0.7 -> 0.5 -> 0.3), read from the sample built here; a short run trains all
    three phases and gives every language's validation loss at each evaluation, Korean's too before
    it enters the training mix."""
    import yaml

    from helpers import RECIPES
    from megatron_ext.cli import pretrain_encoder
    from megatron_ext.training.recipe import read_recipe

    raw = read_recipe(RECIPES / "multilingual" / "tiny_temperature_annealed.yaml")
    text = yaml.safe_dump(raw).replace("data/multilingual_sample", str(multilingual_sample["dir"]))
    recipe = yaml.safe_load(text)
    recipe["training"] = {**recipe["training"], "train_iters": 40, "eval_interval": 20}
    recipe["schedule"] = {**recipe["schedule"], "lr_warmup_iters": 5, "lr_wsd_decay_iters": 2}
    recipe["checkpoint"] = {"save": str(tmp_path / "ckpt"), "save_interval": 20}
    recipe["logging"] = {**recipe["logging"], "log_dir": str(tmp_path / "log"), "wandb_mode": "disabled"}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert pretrain_encoder.main(["--config", str(path), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    # tau 0.7 over English's and Bulgarian's sizes, then 3 and 4 languages at 0.5 and 0.3.
    assert re.search(r"steps \[0, 31\) at seq_length 128: 496 samples from 2 sources at temperature 0\.7", plan)
    assert re.search(r"ko/train_text_document: share 13\.\d% \| \d+ samples", plan)
    assert pretrain_encoder.main(["--config", str(path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "log/metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 41)) and {r["phase"] for r in train} == {"mlm-30", "mlm-15", "mlm-5"}
    valid = [r for r in records if r["kind"] == "valid"]
    languages = [f"{lang}/valid_text_document" for lang in ("en", "bg", "uk", "ko")]
    assert [r["step"] for r in valid] == [20, 40] and all(list(r["by_source"]) == languages for r in valid)


def _two_rank_worker(rank: int, rendezvous: str, recipe: dict, out: str) -> None:
    from pathlib import Path

    import torch

    from megatron_ext import process_group

    torch.set_num_threads(1)
    config = run_config_from_dict(recipe)
    process_group.init_process_group_and_model_parallel(seed=config.training.seed, init_method=rendezvous, rank=rank,
                                                        world_size=2)
    result = pretrain(config)
    process_group.destroy_process_group_and_model_parallel()
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": result.losses, "valid": result.valid_by_source}))


@pytest.mark.slow
def test_two_data_parallel_ranks_read_what_one_reads(straight, tiny_corpus, sources, tmp_path):
    """Two data-parallel ranks build every source's epochs (rank 0 first, Megatron's builder) and split
    each step's global batch of the spans as one rank reads it: the same losses, and the same
    per-source validation, across the three switches."""
    from distributed import run_ranks

    _, _, single = straight
    recipe = _recipe(tiny_corpus, sources, tmp_path, checkpoint={"save": None})
    out = tmp_path / "two_ranks.json"
    run_ranks(_two_rank_worker, recipe, str(out), world=2, tmp_path=tmp_path)
    got = json.loads(out.read_text())
    for step, loss in single.losses.items():
        assert got["losses"][str(step)] == pytest.approx(loss, rel=1e-5, abs=1e-6), f"step {step}"
    for source, losses in single.valid_by_source[9].items():
        assert got["valid"]["9"][source] == pytest.approx(losses, rel=1e-5), source


def test_a_sharded_corpus_trains_from_its_blend_file_through_data_args_path(tiny_corpus, news_texts, tmp_path):
    """``tools/preprocess_data.py --shard-size`` writes the shards' blend (``tokens prefix`` lines);
    Megatron's ``--data-args-path`` names that file: the run reads every shard, weighted by its
    tokens (the corpus sampled as one), and the pre-flight checks each shard."""
    from megatron_ext.cli import preprocess_data
    from megatron_ext.data.blend_file import read_blend
    from megatron_ext.training.config import DataConfig

    jsonl = tmp_path / "news.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in news_texts))
    assert preprocess_data.main(["--input", str(jsonl), "--output-prefix", str(tmp_path / "news"), "--tokenizer-model",
                                 tiny_corpus["tokenizer"], "--append-eod", "--shard-size", "100KB", "--workers", "2",
                                 "--launcher", "local"]) == 0
    blend_file = tmp_path / "news_text_document.blend"
    entries = read_blend(blend_file)
    assert len(entries) >= 6  # several shards
    config = DataConfig(data_args_path=str(blend_file), seq_length=64, micro_batch_size=4, global_batch_size=8)
    assert config.blend == ([str(p) for p in entries[1::2]], [float(w) for w in entries[0::2]])
    recipe = tiny_recipe(tiny_corpus, tmp_path / "run", training={"train_iters": 4, "eval_interval": 4, "log_interval": 1})
    recipe["data"] = {**{k: v for k, v in recipe["data"].items() if k != "data_path"}, "data_args_path": str(blend_file)}
    result = pretrain(run_config_from_dict(recipe))
    assert result.final_step == 4 and math.isfinite(result.valid[4]["mlm"])
    header = next(r for r in map(json.loads, (tmp_path / "run/log/metrics.jsonl").read_text().splitlines())
                  if "blend" in r)
    assert [entry["prefix"] for entry in header["blend"]] == [str(p) for p in entries[1::2]]
    with pytest.raises(UserError, match=r"data.data_args_path='.*nowhere.blend': No such file"):
        DataConfig(data_args_path=str(tmp_path / "nowhere.blend"), seq_length=64, micro_batch_size=4,
                   global_batch_size=8)
    with pytest.raises(UserError, match=r"is read instead of data_path: give one"):
        DataConfig(data_args_path=str(blend_file), data_path=("x",), seq_length=64, micro_batch_size=4,
                   global_batch_size=8)


def test_a_bad_source_is_refused_before_the_first_step_and_the_dry_run_says_not_ready(tiny_corpus, sources, tmp_path):
    """What a run would otherwise meet only when its steps reach it (training.preflight, check 8): a
    source with no whole sample at its phase's length, ids outside the vocab in a later phase's source
    or in a phase's own validation blend. The run refuses each before its first step, naming the
    setting and the prefix; ``--dry-run`` says it NOT READY (this machine runs its plan), prints no
    per-source shares for data it could not plan, and prints them for a plan whose files then fail."""
    import shutil

    from megatron_ext.checkpoint.reader import intact_checkpoints
    from megatron_ext.data.index_checks import read_index
    from megatron_ext.data.preprocess import PreprocessConfig, preprocess
    from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer
    from megatron_ext.training.dry_run import format_dry_run, make_plan
    from megatron_ext.training.preflight import NOT_READY, Caller, preflight

    # A source of one short document: no sample of phases[2]'s 128 tokens (+1).
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "A short note."}) + "\n")
    preprocess(PreprocessConfig(inputs=(str(tmp_path / "short.jsonl"),), output_prefix=str(tmp_path / "short"),
                                tokenizer=TokenizerConfig(tokenizer_model=tiny_corpus["tokenizer"]), append_eod=True,
                                progress=False))
    short = str(tmp_path / "short_text_document")
    config = run_config_from_dict(_recipe(tiny_corpus, sources, tmp_path / "short_run",
                                          phases=_phases(sources, last=[short])))
    found = preflight(config, Caller.DRY_RUN, world_size=1)
    assert found.source_plan is None and found.lines[-1].startswith(f"sources: {NOT_READY}: data_path {short!r}: "
                                                                    "its train split holds no whole sample"), found.lines
    assert "per-source shares not computed" in format_dry_run(config, make_plan(config, 1),
                                                              source_plan=found.source_plan)

    # Source c again, one id in it past the vocab (no tokenizer record: only a notice of that).
    bad = str(tmp_path / "bad_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copyfile(sources["c"] + suffix, bad + suffix)
    vocab = build_tokenizer(TokenizerConfig(tokenizer_model=tiny_corpus["tokenizer"])).vocab_size
    tokens = np.memmap(bad + ".bin", mode="r+", dtype=read_index(bad).dtype)
    tokens[7] = vocab
    tokens.flush()
    del tokens
    message = rf"{re.escape(bad)}\.bin: token id {vocab} \(document 0, token 7 of its sequence 0\) is outside the vocab"
    later = _recipe(tiny_corpus, sources, tmp_path / "later", phases=_phases(sources, last=[sources["a"], bad]))
    later_config = run_config_from_dict(later)
    found = preflight(later_config, Caller.DRY_RUN, world_size=1)
    assert re.match(rf"sources: {NOT_READY}: phases\[2\]\.data_path: {message}", found.lines[-1]), found.lines
    # the plan was made before the files failed: its shares are printed beside the NOT READY line
    assert bad in {source.prefix for span in found.source_plan for source in span.sources}
    printed = format_dry_run(later_config, make_plan(later_config, 1), source_plan=found.source_plan)
    assert "per-source shares not computed" not in printed and "bad_text_document" in printed, printed
    with pytest.raises(UserError, match=rf"^phases\[2\]\.data_path: {message}"):
        pretrain(run_config_from_dict(later))  # its phase starts at step 6: refused before step 1
    assert intact_checkpoints(tmp_path / "later" / "ckpt") == []  # none saved at step 3
    validated = _recipe(tiny_corpus, sources, tmp_path / "validated")
    validated["phases"][1]["valid_data_path"] = [bad]
    found = preflight(run_config_from_dict(validated), Caller.DRY_RUN, world_size=1)
    assert re.match(rf"sources: {NOT_READY}: phases\[1\]\.valid_data_path: {message}", found.lines[-1]), found.lines
