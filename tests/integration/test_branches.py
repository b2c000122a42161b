"""Branches (``checkpoint.branch_from``/``branch_step``/``keep_steps``) on CPU with real data: a
tiny study planned as a tree and trained from the planner's recipes gives the separate runs' losses
bit for bit; what the trainer refuses before loading anything, with the reason; the sample-order
key against the orders Megatron builds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron_ext.cli import pretrain_encoder
from helpers import tiny_recipe
from megatron_ext.checkpoint.config import CheckpointConfig
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.config_loading import UserError
from megatron_ext.study.plan import plan_study, plan_to_dict
from megatron_ext.study.spec import read_study
from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.config import DataConfig
from megatron_ext.training.datasets import build_datasets, sample_order
from megatron_ext.training.loop import pretrain

DECAY = 4
"""WSD decay steps of the tiny study: the 12-step budget decays from step 8 (where it branches off
the 20-step run, stable up to step 16), and warmup is 2 steps."""


def _study(tmp_path: Path, corpus: dict[str, str]) -> Path:
    """CLM and biphasic 25/75 at 12 and 20 steps: the 20-step CLM run is the trunk, keeping steps 3
    and 5 (biphasic switches), and 8 (the 12-step CLM run's decay start)."""
    base = tiny_recipe(corpus, tmp_path)
    base.pop("phases")
    base["logging"] = {"wandb_mode": "disabled"}
    base["schedule"]["lr_wsd_decay_iters"] = DECAY
    base["training"] = {"eval_interval": 0, "log_interval": 5}
    base["checkpoint"] = {"save_interval": 100, "keep_last": 1}  # saves: the kept steps and the last
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    study = {"name": "tiny", "sizes": [{"name": "tiny", "base": "base.yaml"}], "budgets": [12, 20],
             "objectives": [{"objective": "clm"}], "biphasic": {"clm_shares": [0.25], "mask_ratio": 0.4},
             "output": {"save": str(tmp_path / "{run}" / "ckpt"), "log_dir": str(tmp_path / "{run}" / "log")}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def _separate(recipe: dict, run_dir: Path) -> dict:
    """The same run trained from step 0 on its own: no branch keys, its own outputs."""
    checkpoint = {k: v for k, v in recipe["checkpoint"].items() if k not in ("branch_from", "branch_step", "keep_steps")}
    return {**recipe, "checkpoint": {**checkpoint, "save": str(run_dir / "ckpt")},
            "logging": {**recipe["logging"], "log_dir": str(run_dir / "log")}}


@pytest.fixture(scope="module")
def tree(tmp_path_factory, tiny_corpus):
    """The tiny study's plan (its recipes read back from ``plan_to_dict``'s JSON) and its trunk,
    trained with asynchronous saves."""
    root = tmp_path_factory.mktemp("tree")
    path = _study(root, tiny_corpus)
    plan = plan_study(read_study(path), path)
    recipes = {run["name"]: run["recipe"] for run in json.loads(json.dumps(plan_to_dict(plan)))["runs"]}
    trunk = dict(recipes["tiny_clm_20"], checkpoint={**recipes["tiny_clm_20"]["checkpoint"], "async_save": True})
    return {"root": root, "plan": plan, "recipes": recipes, "trunk": pretrain(run_config_from_dict(trunk))}


def test_the_tree_of_a_tiny_study_trains_its_runs_exactly(tree, capsys):
    plan, recipes, trunk, root = tree["plan"], tree["recipes"], tree["trunk"], tree["root"]
    got = {s.run: (s.start_from, s.parent, s.branch_step, s.saves) for s in plan.segments}
    assert got == {"tiny_clm_20": ("scratch", None, None, (3, 5, 8)),
                   "tiny_clm_12": ("branch", "tiny_clm_20", 8, ()),
                   "tiny_biphasic_25_75_20": ("branch", "tiny_clm_20", 5, ()),
                   "tiny_biphasic_25_75_12": ("branch", "tiny_clm_20", 3, ())}
    trunk_save = recipes["tiny_clm_20"]["checkpoint"]["save"]
    assert recipes["tiny_clm_20"]["checkpoint"]["keep_steps"] == [3, 5, 8]
    assert (recipes["tiny_clm_12"]["checkpoint"]["branch_from"], recipes["tiny_clm_12"]["checkpoint"]["branch_step"]) \
        == (trunk_save, 8)
    # keep_last 1, yet the kept steps survive the saves after them (asynchronous ones, published late).
    assert [c.step for c in Checkpoint.every(trunk_save)] == [3, 5, 8, 20]

    # Biphasic 25/75 at 20 steps: the CLM trunk to its switch (step 5), then its own MLM branch; the
    # branch is stopped after step 10 and rerun: it resumes from its own checkpoint, not the trunk's.
    biphasic = run_config_from_dict(recipes["tiny_biphasic_25_75_20"])
    first = pretrain(biphasic, exit_after_step=10)
    assert (first.start_step, first.final_step) == (5, 10)
    assert "branched from " + trunk_save + " at step 5" in capsys.readouterr().out
    rest = pretrain(biphasic)
    assert rest.start_step == 10 and rest.checkpoint.endswith("iter_0000020")
    assert f"branched from {trunk_save} at step 5 (resumed from this run's " in capsys.readouterr().out
    again = pretrain(biphasic)
    assert again.start_step == again.final_step == 20 and not again.losses
    alone = pretrain(run_config_from_dict(_separate(recipes["tiny_biphasic_25_75_20"], root / "bi_alone")))
    assert {s: alone.losses[s] for s in range(1, 6)} == {s: trunk.losses[s] for s in range(1, 6)}
    assert {**first.losses, **rest.losses} == {s: alone.losses[s] for s in range(6, 21)}  # bitwise

    # The 12-step budget branches off the 20-step run where its decay begins (step 8).
    budget = pretrain(run_config_from_dict(recipes["tiny_clm_12"]))
    assert budget.start_step == 8
    alone = pretrain(run_config_from_dict(_separate(recipes["tiny_clm_12"], root / "clm12_alone")))
    assert {s: alone.losses[s] for s in range(1, 9)} == {s: trunk.losses[s] for s in range(1, 9)}
    assert budget.losses == {s: alone.losses[s] for s in range(9, 13)}
    assert alone.losses[12] != trunk.losses[12]  # the decays differ: the comparison above could fail

    # Its own checkpoint records the trunk at step 8: another parent or step is refused on a rerun.
    moved = dict(recipes["tiny_clm_12"], checkpoint={**recipes["tiny_clm_12"]["checkpoint"], "branch_step": 5})
    with pytest.raises(UserError, match=r"holds iter_0000012 of a run branched from .*tiny_clm_20/ckpt at step 8, "
                                        r"but this recipe branches from .* at step 5"):
        pretrain(run_config_from_dict(moved))


def _child(tree, name: str, tag: str, **checkpoint) -> dict:
    """Recipe ``name`` of the tiny study, as a branch of the trunk with these checkpoint keys, saving
    under a directory of its own (``tag``)."""
    recipe = tree["recipes"][name]
    run_dir = tree["root"] / f"refused_{tag}"
    keys = {"branch_from": tree["recipes"]["tiny_clm_20"]["checkpoint"]["save"], **checkpoint,
            "save": str(run_dir / "ckpt")}
    return dict(recipe, checkpoint={**recipe["checkpoint"], **keys},
                logging={**recipe["logging"], "log_dir": str(run_dir / "log")})


def test_branches_that_are_not_the_parents_run_are_refused_before_loading(tree, capsys):
    refusals = [
        # a step the trunk did not keep; no parent at all
        (_child(tree, "tiny_clm_12", "unsaved", branch_step=6),
         r"branch_from=.*: the parent never saved step 6 \(or pruned it\); it has steps 3, 5, 8, 20; set "
         r"keep_steps: \[6\] in the parent's checkpoint section"),
        (_child(tree, "tiny_clm_12", "no_parent", branch_step=8, branch_from=str(tree["root"] / "nowhere")),
         r"branch_from=.*nowhere': no such directory \(the parent run's checkpoint.save\)"),
        # a biphasic 25/75 child past its switch (step 3 at 12 steps): the trunk is still CLM there
        (_child(tree, "tiny_biphasic_25_75_12", "past_switch", branch_step=5),
         r"cannot branch at step 5: .* first difference \(parent vs child\): step 3: phase clm \(steps 0-19\) vs "
         r"mlm 0.4 \(steps 3-11\)"),
        # another warmup: the learning rate differs from step 1 (both start at 0)
        (dict(_child(tree, "tiny_clm_12", "warmup", branch_step=8),
              schedule={**tree["recipes"]["tiny_clm_12"]["schedule"], "lr_warmup_iters": 3}),
         r"step 1: learning rate 0\.0015 \(train_iters 20, decay from step 16\) vs 0\.001 "),
        # 5,000 steps read the tiny corpus over several epochs: Megatron orders its samples otherwise
        (dict(_child(tree, "tiny_clm_12", "epochs", branch_step=8),
              training={**tree["recipes"]["tiny_clm_12"]["training"], "train_iters": 5000}),
         r"first difference \(parent vs child\): sample order at train_iters 20 \(\(\('.*news_text_document', 1, "
         r"False\),\)\) vs 5000 \(\(\('.*news_text_document', \d+, (True|False)\),\)\)"),
    ]
    for recipe, message in refusals:
        with pytest.raises(UserError, match=message):
            pretrain(run_config_from_dict(recipe))
        assert not Path(recipe["checkpoint"]["save"]).exists()  # refused before anything was written
    # Through the command line: one line, exit code 2.
    path = tree["root"] / "refused.yaml"
    path.write_text(yaml.safe_dump(refusals[0][0]))
    capsys.readouterr()
    assert pretrain_encoder.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the parent never saved step 6" in err


@pytest.mark.parametrize("checkpoint, message", [
    ({"branch_step": 4}, r"checkpoint.branch_step needs checkpoint.branch_from"),
    ({"branch_from": "/ckpt/parent"}, r"checkpoint.branch_from needs checkpoint.branch_step"),
    ({"branch_from": "/ckpt/parent", "branch_step": 0}, r"branch_step must be a step >= 1, got 0"),
    ({"branch_from": "/ckpt/parent", "branch_step": 4, "load": "/ckpt/other"}, r"both name the state this run starts"),
    ({"branch_from": "SAVE", "branch_step": 4}, r"branch_from is this run's own checkpoint.save"),
    ({"branch_from": "/ckpt/parent", "branch_step": 4, "keep_steps": [3, 6]},
     r"keep_steps \[3\]: this run starts at its branch_step 4"),
    ({"branch_from": "/ckpt/parent", "branch_step": 8}, r"branch_step=8 leaves this run nothing to train"),
    ({"keep_steps": [4, 9]}, r"keep_steps \[9\]: past the run's last step \(training.train_iters=8\)"),
    ({"keep_steps": [4], "save": None}, r"keep_steps \[4\] needs checkpoint.save"),
    ({"keep_steps": [0]}, r"keep_steps must be steps >= 1"),
])
def test_bad_branch_keys_name_the_key(tmp_path, tiny_corpus, checkpoint, message):
    recipe = tiny_recipe(tiny_corpus, tmp_path)
    save = recipe["checkpoint"]["save"]
    recipe["checkpoint"].update({k: save if v == "SAVE" else v for k, v in checkpoint.items()})
    with pytest.raises(UserError, match=message):
        run_config_from_dict(recipe)


def test_keep_steps_are_sorted_once_and_a_continued_pretraining_may_branch():
    config = CheckpointConfig(save="/ckpt/a", keep_steps=(8, 3, 8))
    assert config.keep_steps == (3, 8)
    # A CPT branching off a sibling CPT keeps its source weights (load + finetune) and the branch keys.
    CheckpointConfig(save="/ckpt/b", load="/ckpt/source", finetune=True, branch_from="/ckpt/a", branch_step=3)


def test_the_sample_order_key_is_equal_exactly_when_megatron_orders_the_samples_alike(tmp_path, tiny_corpus):
    """Lengths within one epoch of the tiny corpus's train split, just past it (the second epoch
    shuffled apart), and later in the second epoch (shuffled with the first): the key of two
    lengths is equal exactly when the first samples of the datasets Megatron builds are."""
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=tiny_corpus["tokenizer"]))
    config = DataConfig(data_path=(tiny_corpus["data"],), split="90,10,0", seq_length=64, micro_batch_size=1,
                        global_batch_size=1, data_cache_path=str(tmp_path / "cache"))

    def dataset(samples: int):
        return build_datasets(config, tokenizer=tokenizer, train_samples=samples, valid_samples=0, seed=1234)[0]

    epoch = len(dataset(1))  # samples in one epoch of the train split
    lengths = [8, epoch, epoch + 1, epoch + epoch // 2, 2 * epoch - 5, 2 * epoch + 1]
    keys = {n: sample_order(config, train_samples=n) for n in lengths}
    assert [keys[n][0][1:] for n in lengths] == [(1, False), (1, False), (2, True), (2, True), (2, False), (3, True)]
    built = {n: dataset(n) for n in lengths}
    for i, a in enumerate(lengths):
        for b in lengths[i + 1:]:
            same = all(np.array_equal(built[a][k]["tokens"], built[b][k]["tokens"]) for k in range(0, a, 3))
            assert same == (keys[a] == keys[b]), (a, b)
    # A weighted blend asks each dataset for its share (plus Megatron's 0.5 % surplus).
    blend = dataclasses.replace(config, data_path=("0.75", tiny_corpus["data"], "0.25", tiny_corpus["data"]))
    assert [key[1] for key in sample_order(blend, train_samples=epoch)] == [1, 1]
    assert [key[1] for key in sample_order(blend, train_samples=int(epoch * 1.4))] == [2, 1]
