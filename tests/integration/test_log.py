"""A log a person can read: a 2-rank CPU pretraining under torchrun with asynchronous saves prints
each line once (third-party warnings at most once per job, ``megatron_ext.cli.entry``; the step,
validation and closing lines from rank 0 only)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from megatron_ext.checkpoint.reader import latest_checkpoint
from helpers import tiny_recipe

REPO = Path(__file__).resolve().parents[2]
TORCH_LOG_PREFIX = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ ")
"""torch's logging prefix (level, date, time, pid): two ranks' copies of one line differ only there."""

REPEATS_ALLOWED: dict[str, str] = {}
"""Lines that may legitimately appear more than once, with the reason (none today: every step,
validation and checkpoint line names its step)."""


def test_two_rank_run_prints_every_line_once(tmp_path, tiny_corpus):
    recipe = tiny_recipe(tiny_corpus, tmp_path, checkpoint={"save": str(tmp_path / "ckpt"), "save_interval": 4,
                                                            "async_save": True})
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(REPO / "pretrain_encoder.py"), "--config", str(tmp_path / "recipe.json")],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    output = run.stdout
    assert run.returncode == 0, output[-3000:]
    assert latest_checkpoint(tmp_path / "ckpt").name == "iter_0000008"
    lines = [TORCH_LOG_PREFIX.sub("", line) for line in output.splitlines() if line.strip()]

    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == [f"step {k}/8" for k in range(1, 9)], output  # rank 0 only
    repeated = {line: n for line, n in Counter(lines).items() if n > 1 and line not in REPEATS_ALLOWED}
    assert not repeated, output
    # What each rank used to print (Megatron's import-time notices), now once per job or not at all.
    for gone in ("GPTModel IS DEPRECATED", "Megatron-FSDP", "Apex is not installed", "MimoModelConfig is experimental", "full scope is deprecated",
                 "MCore's async save is deprecated",  # two async saves; the writer is checkpoint.async_strategy
                 "absl.logging is not installed", "No CUDA runtime is found"):
        assert gone not in output, gone
    assert sum(line.startswith("done: steps 0 -> 8") for line in lines) == 1, output


def test_start_up_notes_no_user_can_act_on_are_filtered():
    """Megatron's Megatron-FSDP INFO notes and GPTModel deprecation, and torch's notes when the
    export reads a checkpoint in one process, print nothing once an entry point has set up logging
    (the one place: ``entry.configure_logging``); a line of their loggers that is not among them
    still prints."""
    script = """
import logging, warnings
from megatron_ext.cli.entry import configure_logging
configure_logging(logging.INFO)
fsdp = "megatron.core.distributed.fsdp.src.megatron_fsdp."
logging.getLogger(fsdp + "mixed_precision").info("Using Megatron-FSDP without Transformer Engine.")
logging.getLogger(fsdp + "param_and_grad_buffer").info("Detected Megatron Core, using Megatron-FSDP with Megatron.")
logging.getLogger(fsdp + "megatron_fsdp").info("Detected Megatron Core, using Megatron-FSDP with Megatron.")
logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED. GPTModel is only ...")
warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming ...", UserWarning)
warnings.warn("The argument order of load has been changed. Please check the document", UserWarning)
warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
logging.getLogger("megatron.core.models.gpt.gpt_model").warning("something else")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["WARNING megatron.core.models.gpt.gpt_model: something else"], done.stderr


def test_a_blended_run_logs_its_shares_quiet_wandb_and_each_step_once_after_a_resume(tmp_path, tiny_corpus):
    """wandb (offline, the default) says one line naming its run folder and nothing else; the blend's
    weights and realised shares are in the log and in metrics.jsonl's header row; a run resumed
    from an earlier checkpoint than its last logged step (killed before saving) leaves each step in
    metrics.jsonl once."""
    import shutil

    other = tmp_path / "copy_text_document"
    for suffix in (".bin", ".idx", ".tokenizer.json"):
        shutil.copy(tiny_corpus["data"] + suffix, str(other) + suffix)
    recipe = tiny_recipe(tiny_corpus, tmp_path, data={"data_path": ["0.7", tiny_corpus["data"], "0.3", str(other)]},
                         logging={"log_dir": str(tmp_path / "log"), "wandb_mode": "offline"})
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}

    def train() -> str:
        run = subprocess.run([sys.executable, str(REPO / "pretrain_encoder.py"), "--config", str(tmp_path / "recipe.json")],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:]
        return run.stdout

    output = train()
    wandb_lines = [line for line in output.splitlines() if "wandb" in line.lower()]
    assert len(wandb_lines) == 1 and str(tmp_path / "log" / "wandb") in wandb_lines[0], output
    blend = [line for line in output.splitlines() if line.startswith("blend of 2 datasets")]
    assert len(blend) == 1 and "news_text_document weight 70.0% -> " in blend[0], output
    rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "run" and rows[0]["step"] == 0
    shares = rows[0]["blend"]
    assert [entry["weight"] for entry in shares] == [0.7, 0.3]
    assert sum(entry["share"] for entry in shares) == 1.0 and abs(shares[0]["share"] - 0.7) < 0.1, shares

    shutil.rmtree(tmp_path / "ckpt" / "iter_0000008")  # as if killed after logging step 8, before saving it
    train()
    rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["kind"] == "train"] == list(range(1, 9))
    assert [row["step"] for row in rows if row["kind"] == "valid"] == [4, 8]
    assert [row["step"] for row in rows if row["kind"] == "run"] == [0, 4]
