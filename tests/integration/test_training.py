"""pretrain_encoder end to end on CPU: biphasic run, exact resume, DP/TP parity, CPT, bad input."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from megatron_ext.cli import pretrain_encoder
from distributed import run_ranks
from helpers import tiny_recipe as _recipe
from megatron_ext import process_group
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.loop import pretrain
from megatron_ext.training.recovery import NonFiniteLossError
from megatron_ext.cli import plot_loss




def test_biphasic_run_logs_both_objectives_and_resumes_exactly(tmp_path, tiny_corpus):
    straight = pretrain(run_config_from_dict(_recipe(tiny_corpus, tmp_path / "a")))
    assert straight.final_step == 8 and all(math.isfinite(v) for v in straight.losses.values())
    assert set(straight.valid) == {4, 8} and set(straight.valid[8]) == {"clm", "mlm"}
    records = [json.loads(l) for l in (tmp_path / "a/log/metrics.jsonl").read_text().splitlines()]
    assert [r["objective"] for r in records if r["kind"] == "train"] == ["clm"] * 4 + ["mlm"] * 4
    assert (tmp_path / "a/ckpt").is_dir()

    # Stop after step 3 (a checkpoint is written on exit), then resume to the end.
    interrupted = run_config_from_dict(_recipe(tiny_corpus, tmp_path / "b"))
    first = pretrain(interrupted, exit_after_step=3)
    assert first.final_step == 3
    resumed = pretrain(interrupted)
    assert resumed.start_step == 3 and resumed.final_step == 8
    for step in range(4, 9):
        assert resumed.losses[step] == straight.losses[step], f"step {step} differs after resume"
    assert resumed.valid[8] == straight.valid[8]
    again = pretrain(interrupted)  # rerunning a finished run does nothing
    assert again.start_step == again.final_step == 8 and not again.losses
    assert plot_loss.main([str(tmp_path / "b/log"), "--output", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").stat().st_size > 10_000


def test_continued_pretraining_loads_weights_only(tmp_path, tiny_corpus):
    clm = _recipe(tiny_corpus, tmp_path / "clm", phases=[{"objective": "clm", "share": 1.0}],
                  training={"train_iters": 4, "eval_interval": 0})
    pretrain(run_config_from_dict(clm))
    cpt = _recipe(tiny_corpus, tmp_path / "cpt", phases=[{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}],
                  training={"train_iters": 5, "eval_interval": 0},
                  checkpoint={"load": str(tmp_path / "clm/ckpt"), "finetune": True, "save_interval": 10})
    result = pretrain(run_config_from_dict(cpt))
    assert result.start_step == 0 and result.final_step == 5  # fresh schedule, not step 4
    scratch = _recipe(tiny_corpus, tmp_path / "scratch", phases=cpt["phases"], training=cpt["training"],
                      checkpoint={"save": None})
    # Same seed, data and masks: only the starting weights differ.
    assert pretrain(run_config_from_dict(scratch)).losses[1] != result.losses[1]


def _two_rank_worker(rank: int, rendezvous: str, recipe: dict, out: str) -> None:
    torch.set_num_threads(1)
    config = run_config_from_dict(recipe)
    process_group.init_process_group_and_model_parallel(
        tensor_parallel_size=config.parallel.tensor_model_parallel_size, seed=config.training.seed,
        init_method=rendezvous, rank=rank, world_size=2,
    )
    result = pretrain(config)
    process_group.destroy_process_group_and_model_parallel()
    if rank == 0:
        Path(out).write_text(json.dumps(result.losses))


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_two_ranks_match_one_rank_on_the_same_global_batch(tmp_path, tiny_corpus, layout):
    sections = dict(training={"train_iters": 4, "eval_interval": 0}, checkpoint={"save": None})
    single = pretrain(run_config_from_dict(_recipe(tiny_corpus, tmp_path / "one", **sections)))
    parallel = {"tensor_model_parallel_size": 2 if layout == "tp2" else 1}
    recipe = _recipe(tiny_corpus, tmp_path / "two", parallel=parallel, **sections)
    out = tmp_path / "losses.json"
    run_ranks(_two_rank_worker, recipe, str(out), world=2, tmp_path=tmp_path)
    losses = {int(k): v for k, v in json.loads(out.read_text()).items()}
    for step, loss in single.losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), f"step {step}"


def test_non_finite_loss_stops_after_n_in_a_row(tmp_path, tiny_corpus):
    recipe = _recipe(tiny_corpus, tmp_path, training={"train_iters": 20, "eval_interval": 0, "max_nonfinite_steps": 3},
                     checkpoint={"save": None})
    recipe["schedule"] = {"lr": 1e30, "lr_decay_style": "constant"}
    with pytest.raises(NonFiniteLossError, match=r"non-finite for 3 consecutive steps"):
        pretrain(run_config_from_dict(recipe))


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path, tiny_corpus):
    recipe = _recipe(tiny_corpus, tmp_path, model={"vocab_size": 512}, checkpoint={"save": None})
    with pytest.raises(ValueError, match=r"has 1024 ids but model.vocab_size is 512"):
        pretrain(run_config_from_dict(recipe))


def test_resume_with_other_shapes_lists_mismatches(tmp_path, tiny_corpus):
    recipe = _recipe(tiny_corpus, tmp_path, training={"train_iters": 5, "eval_interval": 0})
    pretrain(run_config_from_dict(recipe))
    wider = _recipe(tiny_corpus, tmp_path, model={"ffn_hidden_size": 192}, training={"train_iters": 6, "eval_interval": 0})
    with pytest.raises(ValueError, match=r"changes what its weights mean:\n  model.ffn_hidden_size: 128 -> 192"):
        pretrain(run_config_from_dict(wider))
    # Starting from its weights (continued pretraining) lists the tensors that do not fit.
    cpt = _recipe(tiny_corpus, tmp_path / "cpt", model={"ffn_hidden_size": 192}, training=wider["training"],
                  checkpoint={"load": str(tmp_path / "ckpt"), "finetune": True})
    with pytest.raises(ValueError, match=r"linear_fc1"):
        pretrain(run_config_from_dict(cpt))


def test_cli_unknown_key_and_override(tmp_path, tiny_corpus, capsys):
    import yaml

    path = tmp_path / "r.yaml"
    bad = _recipe(tiny_corpus, tmp_path)
    bad["training"]["train_itrs"] = 5
    path.write_text(yaml.safe_dump(bad))
    assert pretrain_encoder.main(["--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "unknown key(s) ['train_itrs']" in err and "'train_iters'" in err
    good = _recipe(tiny_corpus, tmp_path)
    path.write_text(yaml.safe_dump(good))
    assert pretrain_encoder.main(["--config", str(path), "--dry-run", "--train-iters", "40", "--lr", "1e-4"]) == 0
    out = capsys.readouterr().out
    assert "clm       steps [     0,     20)" in out and "peak 0.0001" in out


def test_resume_refuses_another_tokenizer_or_head_layout_of_the_same_shapes(tmp_path, tiny_corpus, news_texts):
    """Same tensor shapes, other meaning: a different 1,024-token tokenizer, or 4/4 -> 4/2 heads
    at the same widths, must not resume silently; settings that may change (LR) still resume."""
    from megatron_ext.cli import train_tokenizer

    # The data without its tokenizer record (a dataset older than the record): what is refused here
    # is the resume itself, not the data (tests/unit/test_data_provenance.py refuses the data).
    unrecorded = tmp_path / "unrecorded_text_document"
    for suffix in (".bin", ".idx"):
        Path(f"{unrecorded}{suffix}").symlink_to(tiny_corpus["data"] + suffix)
    recipe = _recipe(tiny_corpus, tmp_path, model={"num_query_groups": 4}, data={"data_path": [str(unrecorded)]},
                     training={"train_iters": 4, "eval_interval": 0})
    pretrain(run_config_from_dict(recipe), exit_after_step=2)
    other = tmp_path / "other_tok"
    jsonl = tmp_path / "reversed.jsonl"
    jsonl.write_text("".join(json.dumps({"text": " ".join(reversed(t.split()))[::-1]}) + "\n" for t in news_texts))
    assert train_tokenizer.main(["--input", str(jsonl), "--output-dir", str(other), "--vocab-size", "1024",
                                 "--no-progress"]) == 0
    with pytest.raises(ValueError, match=r"changes what its weights mean:\n  tokenizer: .*other_tok"):
        pretrain(run_config_from_dict(dict(recipe, tokenizer={"tokenizer_model": str(other)})))
    with pytest.raises(ValueError, match=r"model.num_query_groups: 4 -> 2"):
        pretrain(run_config_from_dict(dict(recipe, model={**recipe["model"], "num_query_groups": 2})))
    resumed = pretrain(run_config_from_dict(dict(recipe, schedule={**recipe["schedule"], "lr": 1e-3})))
    assert resumed.start_step == 2 and resumed.final_step == 4


@pytest.mark.parametrize("field, value, message", [
    ("save", "/proc/megatron_ext_ckpt", r"checkpoint.save='/proc/megatron_ext_ckpt' cannot be written"),
    ("save", "FILE/ckpt", r"checkpoint.save=.*is a file, not a directory"),
    ("load", "/nonexistent/ckpt", r"checkpoint.load='/nonexistent/ckpt' does not exist"),
])
def test_unusable_paths_fail_before_training_and_in_dry_run(tmp_path, tiny_corpus, capsys, field, value, message):
    """Found before the first step (not at the first save, a whole save interval in), and reported
    by --dry-run (which still prints the plan: a login node may lack the compute nodes' mounts)."""
    import yaml

    (tmp_path / "FILE").write_text("not a directory")
    value = value.replace("FILE", str(tmp_path / "FILE"))
    recipe = _recipe(tiny_corpus, tmp_path, checkpoint={field: value}, training={"train_iters": 4, "eval_interval": 0})
    with pytest.raises(ValueError, match=message):
        pretrain(run_config_from_dict(recipe))
    assert not (tmp_path / "log").exists()  # nothing ran
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert pretrain_encoder.main(["--config", str(path), "--dry-run"]) == 0
    assert re.search("paths: NOT READY, a run would stop here: " + message, capsys.readouterr().out)


def test_dry_run_says_what_it_checked(tmp_path, tiny_corpus, capsys):
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_recipe(tiny_corpus, tmp_path)))
    assert pretrain_encoder.main(["--config", str(path), "--dry-run"]) == 0
    assert "checked: checkpoint.save writable, logging.log_dir writable, 1 data prefix(es) present" in capsys.readouterr().out


def test_dry_run_imports_no_megatron(tmp_path, tiny_corpus):
    """Reading and checking a recipe (plan, paths, memory) needs no Megatron-Core import, which
    costs seconds; the dry run stays quick on a login node."""
    import subprocess
    import sys

    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_recipe(tiny_corpus, tmp_path)))
    script = ("import sys; from megatron_ext.cli import pretrain_encoder; "
              "code = pretrain_encoder.main(['--config', sys.argv[1], '--dry-run']); "
              "print(code, sorted(m for m in sys.modules if m.startswith('megatron.')))")
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0 []"


def test_user_errors_after_start_up_are_one_line_and_exit_2(tmp_path, tiny_corpus):
    """A corrupt index found after start-up: one line naming the file, exit code 2, no traceback."""
    import shutil
    import subprocess
    import sys

    import numpy as np
    import yaml

    prefix = tmp_path / "copy_text_document"
    for suffix in (".bin", ".idx", ".tokenizer.json"):  # the data and its tokenizer record: no notice
        shutil.copy(tiny_corpus["data"] + suffix, str(prefix) + suffix)
    with open(str(prefix) + ".idx", "r+b") as f:  # zero the pointer area
        n_sequences = int(np.frombuffer(f.read(34)[18:26], dtype=np.int64)[0])
        f.seek(34 + 4 * n_sequences)
        f.write(b"\0" * 8 * n_sequences)
    recipe = _recipe(tiny_corpus, tmp_path, data={"data_path": [str(prefix)]}, training={"train_iters": 4})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run = subprocess.run([sys.executable, "pretrain_encoder.py", "--config", str(path)], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True)
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower() and "warn" not in line.lower()]
    assert len(errors) == 1 and f"{prefix}.idx: corrupt index" in errors[0], run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_step_line_names_phase_throughput_and_skips():
    from megatron_ext.objectives import CLM, MLM
    from megatron_ext.phases import Phase, resolve_phases
    from megatron_ext.training.step_log import format_step_line

    clm, mlm = resolve_phases((Phase(objective=CLM(), share=0.5), Phase(objective=MLM(mask_ratio=0.3), share=0.5)), 100)
    line = format_step_line(step=7, total_steps=100, phase=mlm, loss=5.26924, lr=1e-3, grad_norm=0.9123,
                            tokens_per_s=12345.6, mfu=0.4123, elapsed_s=62, eta_s=3725, skipped=0)
    assert line == ("step   7/100 | mlm-30  | loss 5.2692 | lr 1.00e-03 | gnorm 0.912 | 12,346 tok/s | MFU 41.2% | "
                    "elapsed 1m02s | ETA 1h02m")
    line = format_step_line(step=100, total_steps=100, phase=clm, loss=float("nan"), lr=0.0, grad_norm=float("inf"),
                            tokens_per_s=10.0, mfu=None, elapsed_s=5, eta_s=0, skipped=1)
    assert line.startswith("step 100/100 | clm     | loss nan") and "MFU" not in line
    assert line.endswith("| 1 step SKIPPED (non-finite)")
    line = format_step_line(step=100, total_steps=100, phase=clm, loss=5.0, lr=0.0, grad_norm=1.0,
                            tokens_per_s=10.0, mfu=None, elapsed_s=5, eta_s=0, skipped=3)
    assert line.endswith("| 3 steps SKIPPED (non-finite)")  # of the steps since the last line
    # A run with a longer phase name pads every phase to it, so the columns line up.
    scheduled = resolve_phases((Phase(objective=MLM(mask_ratio=0.3, mask_ratio_schedule="cosine", final_mask_ratio=0.05),
                                      share=1.0),), 100)[0]
    lines = [format_step_line(step=1, total_steps=100, phase=p, loss=1.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0,
                              mfu=None, elapsed_s=1, eta_s=1, skipped=0, name_width=len(scheduled.name))
             for p in (clm, scheduled)]
    assert [line.index("| loss") for line in lines] == [len("step   1/100 | mlm-30to5-cosine ")] * 2


def _write(recipe: dict, path: Path) -> str:
    import yaml

    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.parametrize("objective, tokenizer, message", [
    ({"name": "wwm", "mask_ratio": 0.4}, "sentencepiece",
     r"objective wwm-40 needs a mask token: tokenizer SentencePieceTokenizer '.*botchan_en_bpe_1000.model' has no mask"),
    ({"name": "mntp", "mask_ratio": 0.2}, "sentencepiece", r"objective mntp-20 needs a mask token"),
    ({"name": "wwm", "mask_ratio": 0.4}, "unmarked", r"objective wwm-40 masks whole words, but the pieces of tokenizer "
                                                     r"HuggingFaceTokenizer '.*unmarked' carry no word mark"),
    ({"name": "span", "mask_ratio": 0.4}, "unmarked", r"objective span-40 \(span_unit: word\) masks whole words"),
    ("clm", "sentencepiece", r"validation \(data.eval_iters=1\) measures mlm-40: objective mlm-40 needs a "
                             r"mask token: .*; or set data.eval_iters: 0"),
])
def test_dry_run_refuses_a_tokenizer_an_objective_cannot_serve(tmp_path, tiny_corpus, news_texts, capsys, objective,
                                                               tokenizer, message):
    """One line naming the objective and the tokenizer, exit 2, from --dry-run (no model is built)
    as from the run itself, before anything is written."""
    from helpers import unmarked_bpe_dir
    from megatron_ext import assets

    model = (str(assets.member("sentencepiece-sdist", "sentencepiece-0.2.3/test/botchan_en_bpe_1000.model"))
             if tokenizer == "sentencepiece" else str(unmarked_bpe_dir(news_texts[:100], tmp_path / "unmarked")))
    recipe = _recipe(tiny_corpus, tmp_path, tokenizer={"tokenizer_model": model},
                     phases=[{"objective": objective, "share": 1.0}])
    assert pretrain_encoder.main(["--config", _write(recipe, tmp_path / "r.yaml"), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert re.fullmatch(r"pretrain_encoder.py: error: " + message + ".*\n", captured.err), captured.err
    assert "world size" not in captured.out  # refused before the plan
    with pytest.raises(ValueError, match=message):
        pretrain(run_config_from_dict(recipe))
    assert not (tmp_path / "log").exists()


@pytest.mark.parametrize("sections, key", [
    ({"phases": [{"objective": "wwm", "mask_ratio": 0.003, "share": 1.0}]}, r"phases\[0\]\.mask_ratio: 0.003 .*"
                                                                             r"selects 0 per sequence"),
    ({"phases": [{"objective": {"name": "mlm", "mask_ratio": 0.3, "mask_ratio_schedule": "linear",
                                "final_mask_ratio": 0.01}, "share": 1.0}]},
     r"phases\[0\]\.final_mask_ratio: 0.01 of the 64 maskable positions .* selects 1 per sequence, fewer than 2"),
    ({"phases": [{"objective": "mntp", "mask_ratio": 0.02, "share": 1.0}]},
     r"phases\[0\]\.mask_ratio: 0.02 of the 63 maskable"),
    ({"training": {"eval_mask_ratio": 0.01}}, r"training\.eval_mask_ratio: 0.01 .*raise training\.eval_mask_ratio to "
                                              r"at least 0.0234 or lengthen data.seq_length"),
])
def test_a_ratio_that_selects_nearly_nothing_is_refused(tmp_path, tiny_corpus, capsys, sections, key):
    """At --dry-run, naming the key (the schedule's end by its own name), before any step's loss
    is 0/0."""
    recipe = _recipe(tiny_corpus, tmp_path, **sections)
    assert pretrain_encoder.main(["--config", _write(recipe, tmp_path / "r.yaml"), "--dry-run"]) == 2
    assert re.fullmatch(r"pretrain_encoder.py: error: " + key + ".*\n", capsys.readouterr().err)
    recipe["data"]["seq_length"] = 2048  # the same ratios select enough in longer sequences
    recipe["model"]["seq_length"] = 2048
    run_config_from_dict(recipe)


def test_a_step_that_scored_nothing_does_not_blame_the_learning_rate(tmp_path, tiny_corpus):
    from megatron_ext.training.recovery import NonFiniteGuard
    from megatron_ext.training.megatron_engine import StepOutcome

    phase = run_config_from_dict(_recipe(tiny_corpus, tmp_path)).resolved_phases[1]
    nothing = StepOutcome(loss=math.nan, grad_norm=math.nan, skipped=True, scored_tokens=0.0)
    with pytest.raises(NonFiniteLossError, match=r"step 7: .*the last step scored no token, so its loss is 0/0: phase "
                                                 r"mlm-40's objective selected nothing") as raised:
        NonFiniteGuard(2, in_a_row=1).update(7, nothing, phase)
    assert "learning rate" not in str(raised.value)
    diverged = StepOutcome(loss=math.inf, grad_norm=math.nan, skipped=True, scored_tokens=512.0)
    with pytest.raises(NonFiniteLossError, match="lower the learning rate"):
        NonFiniteGuard(1).update(7, diverged, phase)
