"""Merging checkpoints (``megatron_ext/checkpoint/merge.py``, ``tools/merge_checkpoints.py``): TIES and
the uniform average on hand-computed tensors, and on real checkpoints of a tiny trunk and a decay branch
off it (CPU, real data): the merged checkpoint holds what the method promises, trains on as a start of
continued pretraining, and exports to Hugging Face with the same logits; what is refused, in one line."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from helpers import assert_export_has_its_logits, tiny_recipe
from megatron_ext.checkpoint.merge import (DEFAULT_DENSITY, MERGE_KEY, PROVENANCE, MergeConfig,
                                           ties_merge, trim, uniform_merge)
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.cli import merge_checkpoints as merge_tool
from megatron_ext.config_loading import UserError
from megatron_ext.training.loop import pretrain
from megatron_ext.training.recipe import run_config_from_dict

BRANCH_STEP = 4


# --- Pure functions, hand-computed ---------------------------------------------------------------


def test_trim_keeps_the_largest_magnitudes_first_by_position():
    delta = torch.tensor([[0.5, -3.0], [2.0, -2.0]])
    assert torch.equal(trim(delta, 0.5), torch.tensor([[0.0, -3.0], [2.0, 0.0]]))  # |2| twice: the first kept
    assert torch.equal(trim(delta, 0.3), torch.tensor([[0.0, -3.0], [2.0, 0.0]]))  # ceil(0.3 x 4) = 2
    assert torch.equal(trim(delta, 1.0), delta)


def test_ties_on_a_hand_computed_example():
    base = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0]), "b": torch.tensor([0.0, 0.0]), "count": torch.tensor(7)}
    # task vectors (parent - base): tau1 = [ 3, -1, 0.5, 2, -1],  tau2 = [ 1, 2, -4, -2, 1],
    #                               tau3 = [-2, 1, 0.25, 4, -3]
    parents = [
        {"w": torch.tensor([4.0, 0.0, 1.5, 3.0, 0.0]), "b": torch.tensor([1.0, -1.0]), "count": torch.tensor(7)},
        {"w": torch.tensor([2.0, 3.0, -3.0, -1.0, 2.0]), "b": torch.tensor([2.0, 2.0]), "count": torch.tensor(7)},
        {"w": torch.tensor([-1.0, 2.0, 1.25, 5.0, -2.0]), "b": torch.tensor([-4.0, 1.0]), "count": torch.tensor(7)},
    ]
    # density 0.6 keeps 3 of 5 entries: t1 = [3, -1, 0, 2, 0] (of the two |1|, the first), t2 = [0, 2, -4, -2, 0],
    # t3 = [-2, 0, 0, 4, -3]. Sums [1, 1, -4, 4, -3]: elected signs [+, +, -, +, -]. Disjoint means over the
    # parents of the elected sign: [3, 2, -4, (2 + 4) / 2, -3]; merged = 1 + 0.5 x mean.
    merged, stats = ties_merge(base, parents, density=0.6, scale=0.5)
    assert torch.equal(merged["w"], torch.tensor([2.5, 2.0, -1.0, 2.5, -0.5]))
    # b: tau = [1, -1], [2, 2], [-4, 1]; density 0.6 keeps ceil(1.2) = 2: all. Sums [-1, 2] -> signs [-, +];
    # means [-4, (2 + 1) / 2 = 1.5]
    assert torch.equal(merged["b"], torch.tensor([-2.0, 0.75]))
    assert torch.equal(merged["count"], torch.tensor(7))  # not a floating weight: carried, equal in all
    # conflicts: w at 0 (3, -2), 1 (-1, 2), 3 (2, -2, 4); b at 0 and 1. Changed: all 7 entries.
    assert (stats.tensors, stats.parameters, stats.changed, stats.conflicts) == (2, 7, 7, 5)

    # A tie of the sum elects no sign: nothing is added there. Weighted: the elected sign and the mean weigh.
    tied, _ = ties_merge({"w": torch.zeros(1)}, [{"w": torch.tensor([2.0])}, {"w": torch.tensor([-2.0])}], density=1)
    assert torch.equal(tied["w"], torch.zeros(1))
    weighted, _ = ties_merge({"w": torch.zeros(2)}, [{"w": torch.tensor([2.0, 1.0])}, {"w": torch.tensor([-1.0, 3.0])}],
                             density=1, weights=[3, 1])
    assert torch.equal(weighted["w"], torch.tensor([2.0, 1.5]))  # 0.75*2 - 0.25*1 > 0: only the first; (3+3)/4


def test_ties_and_uniform_reduce_to_their_closed_forms():
    generator = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(6, 5, generator=generator), "n": torch.ones(3)}
    parent = {"w": torch.randn(6, 5, generator=generator), "n": torch.full((3,), 2.0)}
    other = {"w": torch.randn(6, 5, generator=generator), "n": torch.full((3,), -1.0)}
    # One parent, density 1: base + lambda x tau; lambda 1 gives the parent back.
    assert torch.equal(ties_merge(base, [parent], density=1.0)[0]["w"], parent["w"])
    half = ties_merge(base, [parent], density=1.0, scale=0.5)[0]["w"]
    assert torch.equal(half, (base["w"].double() + 0.5 * (parent["w"].double() - base["w"].double())).float())
    # One parent, density d: base + its trimmed task vector (20 % of 30 entries: 6 changed).
    trimmed = ties_merge(base, [parent], density=DEFAULT_DENSITY)[0]["w"]
    assert int((trimmed != base["w"]).sum()) == 6
    # Density 1: parents agreeing everywhere give their mean change; disagreeing, the side of the larger sum.
    assert torch.equal(ties_merge(base, [parent, parent], density=1.0)[0]["w"], parent["w"])
    assert torch.equal(ties_merge(base, [parent, other], density=1.0)[0]["n"], torch.full((3,), -1.0))  # +1, -2: -2
    # uniform: one parent is itself; two are their mean; weights are normalised.
    assert torch.equal(uniform_merge([parent])[0]["w"], parent["w"])
    assert torch.equal(uniform_merge([parent, other])[0]["w"], ((parent["w"].double() + other["w"].double()) / 2).float())
    assert torch.equal(uniform_merge([parent, other], [3, 1])[0]["n"], torch.full((3,), 1.25))


def test_inputs_that_do_not_fit_are_refused_naming_the_key():
    a = {"w": torch.zeros(2, 3), "steps": torch.tensor(4)}
    with pytest.raises(UserError, match=r"^parent 2: w is \(3, 2\) torch.float32, \(2, 3\) torch.float32 in parent 1"):
        uniform_merge([a, {"w": torch.zeros(3, 2), "steps": torch.tensor(4)}])
    with pytest.raises(UserError, match=r"^parent 2 lacks steps, which parent 1 has"):
        uniform_merge([a, {"w": torch.zeros(2, 3)}])
    with pytest.raises(UserError, match=r"^parent 1: steps differs from base's and is not a floating-point weight"):
        ties_merge({"w": torch.zeros(2, 3), "steps": torch.tensor(3)}, [a])
    with pytest.raises(UserError, match=r"--weights: 1 given for 2 parents"):
        uniform_merge([a, a], [1.0])
    for config, message in ((dict(method="uniform", density=0.5), "--density belongs to --method ties"),
                            (dict(method="ties", density=0.0), r"--density 0.0: expected a share .* in \(0, 1\]"),
                            (dict(method="ties", weights=(1, -1)), r"--weights \[1.0, -1.0\]: expected one positive"),
                            (dict(method="mean"), "--method 'mean': expected one of uniform, ties")):
        with pytest.raises(UserError, match=message):
            MergeConfig(**config)


# --- Real checkpoints: a trunk and a decay branch off it ----------------------------------------


@pytest.fixture(scope="module")
def branches(tmp_path_factory, tiny_corpus):
    """A tiny 8-step run (the trunk, keeping step 4) and a branch off it at step 4 whose last phase masks
    20 % instead of 40 % (its decay differs), both trained to step 8."""
    root = tmp_path_factory.mktemp("merge")
    training = {"train_iters": 8, "eval_interval": 0, "log_interval": 4}
    trunk = tiny_recipe(tiny_corpus, root / "trunk", training=training,
                        checkpoint={"keep_steps": [BRANCH_STEP]})
    pretrain(run_config_from_dict(trunk))
    branch = tiny_recipe(tiny_corpus, root / "branch", training=training,
                         phases=[{"objective": "clm", "share": 0.5}, {"objective": "mlm", "mask_ratio": 0.2, "share": 0.5}],
                         checkpoint={"branch_from": trunk["checkpoint"]["save"], "branch_step": BRANCH_STEP})
    assert pretrain(run_config_from_dict(branch)).start_step == BRANCH_STEP
    return {"root": root, "corpus": tiny_corpus, "trunk": root / "trunk/ckpt", "branch": root / "branch/ckpt",
            "base": Checkpoint.at_step(root / "trunk/ckpt", BRANCH_STEP).path}


def _weights(*checkpoints) -> list[dict[str, torch.Tensor]]:
    from megatron_ext.hf import load_megatron_checkpoint, single_process_model_parallel

    with single_process_model_parallel():
        return [{key: value.cpu() for key, value in load_megatron_checkpoint(c).state_dict().items()
                 if isinstance(value, torch.Tensor)} for c in checkpoints]


def test_uniform_merge_of_real_checkpoints_is_their_average(branches, tmp_path, capsys):
    out = tmp_path / "uniform"
    assert merge_tool.main(["--method", "uniform", str(branches["trunk"]), str(branches["branch"]),
                            "--out", str(out)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("merged 2 parent(s) by uniform: ") and summary.endswith(f"-> {out / 'iter_0000000'}")
    merged, trunk, branch = _weights(out, branches["trunk"], branches["branch"])
    assert merged.keys() == trunk.keys() and len(merged) > 10
    differ = 0
    for key, value in merged.items():
        assert torch.equal(value, ((trunk[key].double() + branch[key].double()) / 2).to(value.dtype)), key
        differ += not torch.equal(trunk[key], branch[key])
    assert differ > len(merged) // 2  # the branch really trained apart from the trunk

    checkpoint = Checkpoint.open(out)
    assert checkpoint.step == 0 and checkpoint.optimizer_format() is None  # weights only
    assert checkpoint.model_config() == Checkpoint.open(branches["trunk"]).model_config()
    assert checkpoint.tokenizer_fingerprint() == Checkpoint.open(branches["trunk"]).tokenizer_fingerprint()
    # what the parents last trained, for exports: the same reading of the outputs under two names
    assert checkpoint.trained_objective() == {"name": "mlm-40 + mlm-20", "prediction_offset": 0, "causal": False}
    provenance = json.loads((out / PROVENANCE).read_text())
    assert provenance == checkpoint.run_config()[MERGE_KEY]
    assert [(p["path"], p["step"], p["weight"]) for p in provenance["parents"]] == [
        (str(branches["trunk"] / "iter_0000008"), 8, 0.5), (str(branches["branch"] / "iter_0000008"), 8, 0.5)]
    assert provenance["method"] == "uniform" and provenance["base"] is None and provenance["density"] is None
    assert provenance["parameters"] == sum(v.numel() for v in merged.values())


def test_ties_merge_trains_on_and_exports_with_the_same_logits(branches, tmp_path, capsys):
    from megatron_ext.hf import export_checkpoint

    out = tmp_path / "ties"
    assert merge_tool.main(["--method", "ties", "--base", str(branches["base"]), str(branches["trunk"]),
                            str(branches["branch"]), "--density", "0.5", "--lambda", "1.0", "--out", str(out)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "by ties" in summary and "sign conflicts at " in summary
    merged, base, trunk, branch = _weights(out, branches["base"], branches["trunk"], branches["branch"])
    expected, stats = ties_merge(base, [trunk, branch], density=0.5, scale=1.0)
    for key, value in merged.items():
        assert torch.equal(value, expected[key]), key
    provenance = json.loads((out / PROVENANCE).read_text())
    assert provenance["base"] == {"path": str(branches["base"]), "step": BRANCH_STEP}
    assert (provenance["density"], provenance["lambda"]) == (0.5, 1.0)
    assert 0 < provenance["sign_conflict_share"] == stats.conflict_share < 1

    # Trains on: continued pretraining from it (weights only: a fresh optimizer and schedule at step 0). At a
    # learning rate of 1e-9 two steps move no weight by 1e-6: what was saved is the merge, trained.
    recipe = tiny_recipe(branches["corpus"], tmp_path / "on", training={"train_iters": 2, "eval_interval": 0},
                         schedule={"lr": 1e-9, "lr_decay_style": "constant", "lr_warmup_iters": 0},
                         checkpoint={"load": str(out), "finetune": True})
    result = pretrain(run_config_from_dict(recipe))
    assert (result.start_step, result.final_step) == (0, 2) and all(map(math.isfinite, result.losses.values()))
    (trained,) = _weights(tmp_path / "on/ckpt")
    for key, value in trained.items():
        torch.testing.assert_close(value, merged[key], atol=1e-6, rtol=0, msg=key)
    assert any(not torch.equal(trained[key], merged[key]) for key in merged)  # it did train

    # Exports: the Hugging Face model computes the merged weights' logits.
    export_checkpoint(out, tmp_path / "hf", hf_format="eurobert", log=lambda _: None)
    assert json.loads((tmp_path / "hf/config.json").read_text())["trained_objective"]["name"] == "mlm-40 + mlm-20"
    assert_export_has_its_logits(out, tmp_path / "hf")


def test_merges_that_cannot_be_made_are_one_line(branches, tmp_path, capsys):
    def refused(*argv: str) -> str:
        assert merge_tool.main(list(argv)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("merge_checkpoints.py: error: ")
        return lines[0]

    trunk, branch, out = str(branches["trunk"]), str(branches["branch"]), str(tmp_path / "out")
    missing = tmp_path / "missing"
    assert f"parent 2 {missing}: no complete checkpoint at {missing}: not a directory" in refused(
        "--method", "uniform", trunk, str(missing), "--out", out)
    assert "--method ties needs --base" in refused("--method", "ties", trunk, branch, "--out", out)
    assert "--density belongs to --method ties" in refused("--method", "uniform", trunk, branch, "--density", "0.3",
                                                          "--out", out)
    assert "--base belongs to --method ties" in refused("--method", "uniform", "--base", str(branches["base"]), trunk,
                                                        branch, "--out", out)
    assert "--weights: 3 given for 2 parents" in refused("--method", "uniform", trunk, branch, "--weights", "1", "2",
                                                         "3", "--out", out)
    assert f"--out {branches['root']} holds the input" in refused("--method", "uniform", trunk, branch,
                                                                  "--out", str(branches["root"]))
    # Parents whose outputs predict at other positions: the trunk at step 4 had trained CLM last, at 8 MLM.
    assert (f"parent 2 {branches['base']} last trained clm, parent 1 mlm-40: their outputs predict tokens at other "
            "positions") in refused("--method", "uniform", trunk, str(branches["base"]), "--out", out)
    # Another architecture: a copy of the branch's checkpoint whose model_config.json says another RoPE base.
    other = tmp_path / "other" / "iter_0000008"
    shutil.copytree(Checkpoint.open(branch).path, other)
    config = json.loads((other / "model_config.json").read_text())
    (other / "model_config.json").write_text(json.dumps({**config, "rotary_base": 20_000.0}))
    line = refused("--method", "ties", "--base", str(branches["base"]), trunk, str(other), "--out", out)
    assert f"parent 2 {other}: model_config.json rotary_base is 20000.0, {config['rotary_base']} in --base" in line
    assert not (tmp_path / "out").exists()
