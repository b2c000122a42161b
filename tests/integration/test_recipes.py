"""The shipped recipes and launch scripts, checked through ``pretrain_encoder.py --dry-run``.

Every recipe under ``examples/recipes`` (except the size bases, which have no phases) must
validate and plan to the paper's numbers; user mistakes must fail with exit code 2 and a message
naming the problem; each launch script's ``DRY_RUN=1`` mode must plan for the world size it
would start.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_ext.cli import pretrain_encoder
from megatron_ext.training.recipe import read_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "examples" / "recipes"
PAPER = sorted((RECIPES / "paper").glob("*.yaml"))
RUNNABLE = sorted(p for p in RECIPES.rglob("*.yaml") if "base" not in p.relative_to(RECIPES).parts)
DEMO = RECIPES / "demo_tiny_biphasic.yaml"
CPT_ENCODER = sorted((RECIPES / "cpt_encoder").glob("*.yaml"))
OBJECTIVE_RECIPES = sorted((RECIPES / "objectives").glob("*.yaml"))
LONG_CONTEXT = sorted((RECIPES / "long_context").glob("*.yaml"))  # planned in test_long_context.py
MULTILINGUAL = sorted((RECIPES / "multilingual").glob("*.yaml"))  # data: fetch_sample_data.py --multilingual
ANNEALING = sorted((RECIPES / "annealing").glob("*.yaml"))  # planned in test_phase_data.py
LAUNCH = ROOT / "examples" / "launch"

TOKENS_PER_STEP = 1152 * 2048  # the paper's ~2.36M tokens per step
PEAK_LR = "5.00e-04"
SHAPES = {"210m": (12, 768, 12, 12), "610m": (26, 1152, 18, 6), "1b": (26, 1728, 18, 6)}  # the authors: EuroBERT commit 6e9d6b2
PHASE_LINE = re.compile(r"^\s+(clm|mlm-\d+)\s+steps \[\s*(\d+),\s*(\d+)\).*lr (\S+) -> (\S+)", re.M)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = pretrain_encoder.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def plan_of(path: Path, world: int, capsys, *extra: str) -> str:
    code, out, err = run(["--config", str(path), "--dry-run", "--world-size", str(world), *extra], capsys)
    assert code == 0, err
    return out


def phases(plan: str) -> list[tuple[str, int, int]]:
    return [(name, int(start), int(end)) for name, start, end, _, _ in PHASE_LINE.findall(plan)]


def total_tokens(plan: str) -> tuple[int, int]:
    match = re.search(r"^tokens\s+([\d,]+)/step, ([\d,]+) in total", plan, re.M)
    assert match, plan
    per_step, total = (int(x.replace(",", "")) for x in match.groups())
    return per_step, total


def expected_phases(recipe: str, steps: int) -> list[tuple[str, int, int]]:
    kind = recipe.split("_", 1)[1]
    if kind == "clm":
        return [("clm", 0, steps)]
    if kind.startswith("mlm_"):
        return [(f"mlm-{kind[4:]}", 0, steps)]
    if kind.startswith("biphasic_"):
        boundary = steps * int(kind.split("_")[1]) // 100
        return [("clm", 0, boundary), ("mlm-40", boundary, steps)]
    assert kind == "cpt_mlm_40", recipe
    return [("mlm-40", 0, steps)]


def test_the_paper_recipe_set_is_complete():
    names = {p.stem for p in PAPER}
    kinds = ["mlm_20", "mlm_30", "mlm_40", "mlm_50", "clm", "biphasic_25_75", "biphasic_50_50", "cpt_mlm_40"]
    assert names == {f"{size}_{kind}" for size in SHAPES for kind in kinds}
    assert set(RUNNABLE) == (set(PAPER) | {DEMO} | set(CPT_ENCODER) | set(OBJECTIVE_RECIPES) | set(LONG_CONTEXT)
                             | set(MULTILINGUAL) | set(ANNEALING))
    assert [p.stem for p in MULTILINGUAL] == ["tiny_temperature_annealed"]
    assert [p.stem for p in ANNEALING] == [f"{size}_pretrain_anneal_decay" for size in ("1b", "210m", "610m")]
    assert [p.stem for p in CPT_ENCODER] == ["eurobert_210m_clm_detour", "eurobert_210m_mlm"]


def test_cpt_encoder_recipes_plan_on_an_import(tmp_path, capsys):
    """recipes/cpt_encoder/ on top of an imported EuroBERT-210m (its recipe_model.yaml written as
    the importer writes it, where the base expects it): equal steps and tokens, the detour's MLM
    phase exactly the WSD decay, the import's weights loaded."""
    import shutil

    import transformers

    from megatron_ext.hf.architectures import encoder_config_from_hf
    from megatron_ext.hf.importer import RECIPE_SNIPPET, _recipe_snippet

    shutil.copytree(RECIPES / "cpt_encoder", tmp_path / "examples" / "recipes" / "cpt_encoder")
    imported = tmp_path / "runs" / "cpt_encoder" / "eurobert_210m"
    imported.mkdir(parents=True)
    eurobert_210m = transformers.EuroBertConfig(rope_parameters={"rope_type": "default", "rope_theta": 250_000.0})
    config = encoder_config_from_hf(eurobert_210m, vocab_size=128_256, seq_length=2048)
    (imported / RECIPE_SNIPPET).write_text(_recipe_snippet(config, imported / "tokenizer", imported, "EuroBERT-210m"))
    plans = {p.stem: plan_of(tmp_path / "examples" / "recipes" / "cpt_encoder" / p.name, 8, capsys)
             for p in CPT_ENCODER}
    assert phases(plans["eurobert_210m_mlm"]) == [("mlm-40", 0, 2000)]
    assert phases(plans["eurobert_210m_clm_detour"]) == [("clm", 0, 1600), ("mlm-40", 1600, 2000)]
    for plan in plans.values():
        assert total_tokens(plan) == (TOKENS_PER_STEP, 2000 * TOKENS_PER_STEP)
        assert "decay 400 (linear)" in plan and "12 layers, hidden 768, FFN 3072, heads 12/12 KV" in plan
        assert f"load={imported} (weights only: continued pretraining)" in plan


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_recipe_plans(path: Path, capsys):
    world = 64  # the paper-scale layout: 8 nodes x 8 GPUs (8 GPUs: the CPT and launch tests)
    plan = plan_of(path, world, capsys)
    size = path.stem.split("_")[0]
    steps = 22000 if "cpt" in path.stem else 42000

    assert f"world size        {world} = TP 1 x PP 1 x DP {world}" in plan
    layers, hidden, heads, kv = SHAPES[size]
    assert f"{layers} layers, hidden {hidden}," in plan and f"heads {heads}/{kv} KV, vocab 128,256" in plan
    assert "(te layers)" in plan  # the measured default (benchmarks/results/recipe_defaults.md)
    micro = {"210m": 18, "610m": 9, "1b": 9}[size]
    assert f"global 1152 = micro {micro} x DP {world} x {1152 // (micro * world)} micro-batches/step" in plan
    assert total_tokens(plan) == (TOKENS_PER_STEP, TOKENS_PER_STEP * steps)
    assert "wsd, peak 0.0005, warmup 2000, decay 2000 (linear), min 0" in plan
    # As the authors' Optimus trains: decay on every parameter, no depth-scaled init.
    assert ("AdamW (0.9, 0.95), eps 1e-05, weight decay 0.1 on every parameter, clip 1; "
            "init N(0, 0.02) for every matrix") in plan
    assert phases(plan) == expected_phases(path.stem, steps)
    assert f"save=/checkpoints/paper/{path.stem} every 1000 steps" in plan


def total_flops(plan: str) -> float:
    match = re.search(r"^compute\s+\S+ FLOPs/token on average, (\S+) FLOPs in total", plan, re.M)
    assert match, plan
    return float(match.group(1))


def test_flops_count_the_lm_head_where_it_runs(capsys):
    """MFU/plan FLOPs: with the scored-positions head, MLM-40 steps count the head at 40 % of
    the tokens, CLM steps at all; the full head counts it everywhere (610M: hidden 1152,
    vocab 128,256, 26 layers of 1152 * (2 * 18 + 2 * 6) * 64 + 3 * 1152 * 4096 matmul weights)."""
    layers, hidden, vocab, seq, steps = 26, 1152, 128_256, 2048, 42000
    body = layers * (hidden * (2 * 18 + 2 * 6) * 64 + 3 * hidden * 4096)
    attention = 12 * layers * hidden * seq
    per_token = {share: 6 * (body + share * vocab * hidden) + attention for share in (0.4, 1.0)}
    tokens = TOKENS_PER_STEP * steps

    def flops(recipe: str, *extra: str) -> float:
        return total_flops(plan_of(RECIPES / "paper" / recipe, 64, capsys, *extra))

    assert flops("610m_mlm_40.yaml") == pytest.approx(tokens * per_token[0.4], rel=1e-3)
    assert flops("610m_mlm_40.yaml", "--no-lm-head-scored-only") == pytest.approx(tokens * per_token[1.0], rel=1e-3)
    assert flops("610m_clm.yaml") == pytest.approx(tokens * per_token[1.0], rel=1e-3)
    biphasic = (steps // 4 * per_token[1.0] + (steps - steps // 4) * per_token[0.4]) * TOKENS_PER_STEP
    assert flops("610m_biphasic_25_75.yaml") == pytest.approx(biphasic, rel=1e-3)


@pytest.mark.parametrize("size", SHAPES)
def test_biphasic_mlm_starts_before_the_decay(size: str, capsys):
    plan = plan_of(RECIPES / "paper" / f"{size}_biphasic_25_75.yaml", 64, capsys)
    assert phases(plan) == [("clm", 0, 10500), ("mlm-40", 10500, 42000)]
    (*_, clm_start, clm_end), (*_, mlm_start, mlm_end) = PHASE_LINE.findall(plan)
    # One schedule over both phases: MLM begins at the stable peak and only it decays.
    assert (clm_start, clm_end, mlm_start) == ("0.00e+00", PEAK_LR, PEAK_LR)
    assert float(mlm_end) < 1e-6


@pytest.mark.parametrize("size", SHAPES)
def test_cpt_loads_weights_only_from_the_clm_run(size: str, capsys):
    cpt = RECIPES / "paper" / f"{size}_cpt_mlm_40.yaml"
    clm_save = read_recipe(RECIPES / "paper" / f"{size}_clm.yaml")["checkpoint"]["save"]
    assert read_recipe(cpt)["checkpoint"]["load"] == clm_save
    plan = plan_of(cpt, 8, capsys)
    assert f"load={clm_save} (weights only: continued pretraining)" in plan
    (_, start, _, lr_first, _), = PHASE_LINE.findall(plan)
    assert (start, lr_first) == ("0", "0.00e+00")  # a fresh warmup, not the CLM run's last rate


def test_step_budget_overrides(capsys):
    plan = plan_of(RECIPES / "paper" / "610m_biphasic_25_75.yaml", 64, capsys, "--train-iters", "12000")
    assert phases(plan) == [("clm", 0, 3000), ("mlm-40", 3000, 12000)]
    assert total_tokens(plan) == (TOKENS_PER_STEP, TOKENS_PER_STEP * 12000)

    cpt = RECIPES / "paper" / "610m_cpt_mlm_40.yaml"
    code, _, err = run(["--config", str(cpt), "--dry-run", "--world-size", "8", "--train-iters", "2000"], capsys)
    assert code == 2 and "lr_warmup_iters" in err  # 2,000 warmup + 2,000 decay do not fit in 2,000
    plan = plan_of(cpt, 8, capsys, "--train-iters", "2000", "--lr-warmup-iters", "200", "--lr-wsd-decay-iters", "200")
    assert phases(plan) == [("mlm-40", 0, 2000)]
    assert "warmup 200, decay 200" in plan


def test_demo_recipe_plan(demo_tokenizer: Path, tmp_path: Path, capsys):
    prefix = str(tmp_path / "train_text_document")
    plan = plan_of(DEMO, 1, capsys, "--tokenizer-model", str(demo_tokenizer), "--data-path", prefix)
    assert "4 layers, hidden 128," in plan and "vocab 8,192," in plan and "(local layers)" in plan
    assert "global 16 = micro 8 x DP 1 x 2 micro-batches/step, sequence 128" in plan
    steps = yaml.safe_load(DEMO.read_text())["training"]["train_iters"]
    assert total_tokens(plan) == (2048, 2048 * steps)
    assert phases(plan) == [("clm", 0, steps // 2), ("mlm-40", steps // 2, steps)]
    assert "save=runs/demo/checkpoints" in plan
    assert f"data              {prefix} (split 95,5,0)" in plan


def test_objective_recipes_plan(demo_tokenizer: Path, tmp_path: Path, capsys):
    """recipes/objectives/: one tiny recipe per objective beyond CLM and MLM, each planning its
    phases under the objective's name."""
    expected = {"clm_then_mntp": [("clm", 0, 100), ("mntp-20", 100, 200)],
                "mlm_ratio_schedule": [("mlm-30to5-cosine", 0, 200)],
                "span": [("span-40", 0, 200)], "whole_word": [("wwm-40", 0, 200)]}
    assert [p.stem for p in OBJECTIVE_RECIPES] == sorted(expected)
    for path in OBJECTIVE_RECIPES:
        plan = plan_of(path, 1, capsys, "--tokenizer-model", str(demo_tokenizer),
                       "--data-path", str(tmp_path / "train_text_document"))
        found = re.findall(r"^\s+(\S+)\s+steps \[\s*(\d+),\s*(\d+)\)", plan, re.M)
        assert [(name, int(start), int(end)) for name, start, end in found] == expected[path.stem], plan


def test_demo_vocab_needs_a_loadable_tokenizer(tmp_path: Path, capsys):
    code, _, err = run(["--config", str(DEMO), "--dry-run", "--tokenizer-model", str(tmp_path / "none")], capsys)
    assert code == 2 and "tokenizer_model" in err and "none" in err


def _recipe(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"base: {RECIPES / 'paper' / '610m_mlm_40.yaml'}\n{text}")
    return str(path)


def test_unknown_recipe_key_lists_the_valid_ones(tmp_path: Path, capsys):
    code, _, err = run(["--config", _recipe(tmp_path, "data: {micro_batch: 4}\n"), "--dry-run"], capsys)
    assert code == 2
    assert "data: unknown key(s) ['micro_batch']" in err and "'micro_batch_size'" in err


def test_the_old_name_of_transformer_impl_is_refused_naming_the_new_one(tmp_path: Path, capsys):
    """``model.attention_backend`` was renamed ``model.transformer_impl``: the old key is refused in one
    line naming the new one, the old flag is unknown; the 610M recipe sets ``transformer_impl: te``."""
    def layers(plan: str) -> str:
        return re.search(r"parameters \((\w+) layers\)", plan).group(1)

    assert layers(plan_of(RECIPES / "paper" / "610m_mlm_40.yaml", 8, capsys)) == "te"
    assert layers(plan_of(RECIPES / "paper" / "610m_mlm_40.yaml", 8, capsys, "--transformer-impl", "local")) == "local"
    code, _, err = run(["--config", _recipe(tmp_path, "model: {attention_backend: local}\n"), "--dry-run",
                        "--world-size", "8"], capsys)
    assert code == 2 and "unknown key(s) ['attention_backend'] (attention_backend is now model.transformer_impl)" in err
    code, _, err = run(["--config", str(RECIPES / "paper" / "610m_mlm_40.yaml"), "--dry-run", "--world-size", "8",
                        "--attention-backend", "local"], capsys)
    assert code == 2 and "--attention-backend" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "6", "--tensor-model-parallel-size", "4"],
         "world size 6 is not divisible by tensor_model_parallel_size=4"),
        # 16 x 64 = 1,024 does not divide 1,152.
        (["--world-size", "64", "--micro-batch-size", "16"],
         "data.global_batch_size=1152 is not divisible by micro_batch_size=16 x data-parallel size 64"),
        (["--world-size", "8", "--model-preset", "350m"], "model.preset: unknown preset '350m'"),
        (["--world-size", "8", "--phases", "[{objective: mlm, share: 1.0}]"], "mask_ratio"),
        (["--world-size", "8", "--phases", "[{objective: clm, share: 0.25}, {objective: mlm, mask_ratio: 0.4, share: 0.5}]"],
         "share sum to 0.75"),
        (["--world-size", "8", "--phases", "{objective: clm}"], "phases: expected a non-empty list"),
    ],
    ids=["layout", "global-batch", "preset", "phase-field", "phase-shares", "phase-list"],
)
def test_bad_launches_fail_with_a_message(argv: list[str], message: str, capsys):
    code, out, err = run(["--config", str(RECIPES / "paper" / "610m_mlm_40.yaml"), "--dry-run", *argv], capsys)
    assert code == 2 and out == ""
    assert err.startswith("pretrain_encoder.py: error: ") and message in err


def test_launch_scripts_dry_run(tmp_path: Path):
    """Each script plans for the world size it would start; extra arguments reach the trainer."""
    launches = {
        "single_node.sh": ({"GPUS_PER_NODE": "4"}, 4),
        "multi_node.sh": ({"NNODES": "4", "GPUS_PER_NODE": "8"}, 32),
        "slurm.sbatch": ({"NNODES": "2", "GPUS_PER_NODE": "8"}, 16),
    }
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "RECIPE", "NNODES", "GPUS_PER_NODE", "WORLD_SIZE"))}
    recipe = RECIPES / "paper" / "1b_biphasic_50_50.yaml"
    # Concurrently: each run is mostly the interpreter importing torch and Megatron.
    procs = {
        script: subprocess.Popen(
            ["bash", str(LAUNCH / script), "--train-iters", "12000"],
            env={**clean, **env, "DRY_RUN": "1", "PYTHON": sys.executable, "RECIPE": str(recipe)},
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for script, (env, _) in launches.items()
    }
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        world = launches[script][1]
        assert proc.returncode == 0, f"{script}: {err}"
        assert f"world size        {world} = TP 1 x PP 1 x DP {world}" in out, script
        assert phases(out) == [("clm", 0, 6000), ("mlm-40", 6000, 12000)], script


@pytest.mark.parametrize(
    "script, env, expected",
    [
        ("single_node.sh", {"GPUS_PER_NODE": "4"},
         "--standalone --nproc-per-node 4 --module megatron_ext.cli.pretrain_encoder"),
        ("multi_node.sh", {"NNODES": "3", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "6000", "NODE_RANK": "0"},
         "--nnodes 3 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 10.0.0.7:6000 "
         "--rdzv-id encoder-10.0.0.7-6000 --rdzv-conf is_host=true --module megatron_ext.cli.pretrain_encoder"),
        ("multi_node.sh", {"NODE_RANK": "2", "MASTER_ADDR": "node001"}, "--rdzv-conf is_host=false"),
        # inside a SLURM allocation: the first host of its node list, its job id
        ("multi_node.sh", {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242"},
         "--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint gpu07:29500 --rdzv-id 4242"),
        ("multi_node.sh", {"MASTER_ADDR": "node001", "NETWORK_INTERFACE": "lo"}, "--local-addr 127.0.0.1 --module"),
    ],
)
def test_launch_command_lines(script: str, env: dict[str, str], expected: str, tmp_path: Path):
    """The torchrun command each script would run (TORCHRUN=echo prints it instead)."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("NNODES", "GPUS_PER_NODE", "MASTER_", "NODE_RANK", "SLURM_", "NETWORK_INTERFACE"))}
    # scontrol reads a configuration before it expands a node list: a minimal one
    (tmp_path / "slurm.conf").write_text("ClusterName=test\nSlurmctldHost=head\nNodeName=gpu[07-08]\n")
    result = subprocess.run(
        ["bash", str(LAUNCH / script), "--lr", "1e-4"],
        env={**clean, **env, "TORCHRUN": "echo", "PYTHON": sys.executable, "SLURM_CONF": str(tmp_path / "slurm.conf")},
        cwd=tmp_path, capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout
    # The default recipe, relative to the working directory (the scripts are package data, not the checkout's).
    assert result.stdout.rstrip().endswith("--config examples/recipes/paper/610m_biphasic_25_75.yaml --lr 1e-4")


def test_multi_node_refuses_localhost_for_several_nodes_and_sets_the_interface(tmp_path: Path):
    """NNODES > 1 with the default MASTER_ADDR (localhost) is refused in one line; NETWORK_INTERFACE
    sets NCCL's and gloo's socket interface (a stand-in torchrun prints them)."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("NNODES", "GPUS_PER_NODE", "MASTER_", "NODE_RANK", "SLURM_", "NETWORK_INTERFACE",
                                  "NCCL_", "GLOO_"))}
    base = {**clean, "PYTHON": sys.executable, "TORCHRUN": "echo"}
    refused = subprocess.run(["bash", str(LAUNCH / "multi_node.sh")], env={**base, "NNODES": "2"}, cwd=tmp_path,
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and "error: MASTER_ADDR=localhost with NNODES=2" in refused.stderr, refused
    show = tmp_path / "show_interfaces"
    show.write_text('#!/bin/sh\necho "nccl=$NCCL_SOCKET_IFNAME gloo=$GLOO_SOCKET_IFNAME"\n')
    show.chmod(0o755)
    shown = subprocess.run(["bash", str(LAUNCH / "multi_node.sh")], cwd=tmp_path, capture_output=True, text=True,
                           env={**base, "MASTER_ADDR": "node001", "NETWORK_INTERFACE": "lo", "TORCHRUN": str(show)},
                           timeout=30)
    assert shown.stdout.strip() == "nccl=lo gloo=lo", shown
