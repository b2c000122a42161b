"""A tiny biphasic run with documents isolated (``data.reset_attention_mask`` and
``data.reset_position_ids``): it trains, differs from the same run across documents, resumes
exactly and exports."""

from __future__ import annotations

import math


from helpers import assert_export_has_its_logits, tiny_recipe
from megatron_ext.checkpoint.reader import latest_checkpoint
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.loop import pretrain

ISOLATED = {"reset_attention_mask": True, "reset_position_ids": True}


def test_isolated_biphasic_run_trains_resumes_exactly_and_exports(tmp_path, tiny_corpus):
    from megatron_ext.hf import export_checkpoint

    straight = pretrain(run_config_from_dict(tiny_recipe(tiny_corpus, tmp_path / "a", data=ISOLATED)))
    assert straight.final_step == 8 and all(math.isfinite(v) for v in straight.losses.values())
    assert set(straight.valid[8]) == {"clm", "mlm"}
    across = pretrain(run_config_from_dict(tiny_recipe(tiny_corpus, tmp_path / "c", checkpoint={"save": None},
                                                       training={"train_iters": 8, "eval_interval": 0})))
    assert across.losses[1] != straight.losses[1]  # the setting changes what the first step computes

    interrupted = run_config_from_dict(tiny_recipe(tiny_corpus, tmp_path / "b", data=ISOLATED))
    assert pretrain(interrupted, exit_after_step=3).final_step == 3
    resumed = pretrain(interrupted)
    assert resumed.start_step == 3
    for step in range(4, 9):
        assert resumed.losses[step] == straight.losses[step], f"step {step} differs after resume"
    assert resumed.valid[8] == straight.valid[8]

    checkpoint = latest_checkpoint(tmp_path / "b/ckpt")
    export_checkpoint(checkpoint, tmp_path / "hf", hf_format="eurobert", log=lambda _: None)
    assert_export_has_its_logits(checkpoint, tmp_path / "hf", batch=1)  # one document: what isolation trains

def test_document_attention_benchmark_checks_and_times_the_three_routes(tmp_path, demo_tokenizer):
    """benchmarks/document_attention.py at a small shape: the isolated routes agree, each is timed."""
    from benchmarks import document_attention

    out = tmp_path / "document_attention.json"
    record = document_attention.main(["--micro-batch-size", "2", "--seq-length", "256", "--repeats", "1",
                                      "--tokenizer", str(demo_tokenizer), "--output", str(out)])
    assert record["documents"] > 2 and set(record["patterns"]) == {"bidirectional", "causal"}
    for rows in record["patterns"].values():
        assert set(rows) == {"cross_document", "per_document", "explicit_mask"}
        assert all(row["ms"] > 0 for row in rows.values()) and rows["per_document"]["speedup_vs_explicit_mask"] > 0
