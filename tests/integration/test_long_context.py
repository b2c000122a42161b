"""Long context as a phase (CPU, tiny): a CLM phase at 64 tokens then an MLM phase at 256 tokens with a
larger RoPE base trains, resumes exactly before, at and after the switch, refuses a resume that
changes the long phase, and exports a model whose logits on a 200-token input are the trained one's."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from helpers import tiny_recipe
from megatron_ext import hardware
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.config_loading import UserError
from megatron_ext.eval import finetuning
from megatron_ext.hf import export_checkpoint, load_megatron_checkpoint, single_process_model_parallel
from megatron_ext.model.attention import attention_pattern
from megatron_ext.training import context
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.loop import pretrain

LONG_BASE = 160_000.0
PHASES = [{"objective": "clm", "share": 0.5},
          {"objective": "mlm", "mask_ratio": 0.4, "share": 0.5, "seq_length": 256, "rotary_base": LONG_BASE}]


def _recipe(corpus, run_dir, **sections):
    return tiny_recipe(corpus, run_dir, phases=PHASES, **sections)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_corpus):
    run_dir = tmp_path_factory.mktemp("straight")
    config = run_config_from_dict(_recipe(tiny_corpus, run_dir))
    return run_dir, config, pretrain(config)


def test_a_long_phase_reads_its_length_and_keeps_tokens_per_step(straight):
    run_dir, config, result = straight
    assert config.model.seq_length == 256  # the longest phase's, by default
    short, long = config.phase_contexts
    assert (short.seq_length, short.global_batch_size, short.micro_batch_size, short.rotary_base) == (64, 8, 4, 10_000)
    assert (long.seq_length, long.global_batch_size, long.micro_batch_size, long.rotary_base) == (256, 2, 1, LONG_BASE)
    assert short.tokens_per_step == long.tokens_per_step == 512
    assert result.final_step == 8 and all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())
    records = [json.loads(line) for line in (run_dir / "log/metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [(r["seq_length"], r["global_batch_size"]) for r in train] == [(64, 8)] * 4 + [(256, 2)] * 4
    saved = Checkpoint.open(run_dir / "ckpt").run_config()
    assert saved["phases"][1]["seq_length"] == 256 and saved["phases"][1]["rotary_base"] == LONG_BASE
    # Megatron's counter: the steps' global batches; the long phase starts at the sample covering the
    # 4 x 512 tokens read before it.
    assert context.consumed_samples(config.phase_contexts, 8) == 4 * 8 + 4 * 2
    assert [(s.seq_length, s.first_sample, s.last_sample) for s in context.dataset_spans(config.phase_contexts)] == [
        (64, 0, 32), (256, 8, 16)]


@pytest.mark.parametrize("stops", [(3,), (4,), (5,), (3, 5)], ids=["before", "at", "after", "across"])
def test_resume_across_the_switch_is_exact(straight, tiny_corpus, tmp_path, stops):
    _, _, uninterrupted = straight
    config = run_config_from_dict(_recipe(tiny_corpus, tmp_path))
    for stop in stops:
        assert pretrain(config, exit_after_step=stop).final_step == stop
    resumed = pretrain(config)
    assert resumed.start_step == stops[-1] and resumed.final_step == 8
    for step in range(stops[-1] + 1, 9):
        assert resumed.losses[step] == uninterrupted.losses[step], f"step {step} differs after resume"
    assert resumed.valid[8] == uninterrupted.valid[8]


def test_a_resume_that_changes_the_long_phase_is_refused(tiny_corpus, tmp_path):
    pretrain(run_config_from_dict(_recipe(tiny_corpus, tmp_path, training={"train_iters": 8, "eval_interval": 0})),
             exit_after_step=5)
    phases = [PHASES[0], {**PHASES[1], "seq_length": 128}]
    changed = tiny_recipe(tiny_corpus, tmp_path, phases=phases, training={"train_iters": 8, "eval_interval": 0})
    with pytest.raises(UserError, match=r"^resuming .*step 4 reads seq_length 256 x global batch 2, RoPE base 160000 "
                                        r"\(phases\[1\]\) vs seq_length 128 x global batch 4.*branch_from") as error:
        pretrain(run_config_from_dict(changed))
    assert "\n" not in str(error.value)
    # The same for a run that had no long phase and is resumed with one added over its steps.
    plain = tiny_recipe(tiny_corpus, tmp_path / "plain", training={"train_iters": 8, "eval_interval": 0})
    pretrain(run_config_from_dict(plain), exit_after_step=5)
    with pytest.raises(UserError, match=r"step 4 reads seq_length 64 x global batch 8"):
        pretrain(run_config_from_dict(_recipe(tiny_corpus, tmp_path / "plain",
                                              training={"train_iters": 8, "eval_interval": 0})))


def test_export_reads_the_long_phase(straight, tmp_path):
    run_dir, _, _ = straight
    checkpoint = Checkpoint.open(run_dir / "ckpt")
    assert checkpoint.model_config().rotary_base == LONG_BASE
    assert Checkpoint.at_step(run_dir / "ckpt", 4).model_config().rotary_base == 10_000  # trained at 64 so far
    out = export_checkpoint(checkpoint.path, tmp_path / "hf", log=lambda line: None)
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["max_position_embeddings"] == 256
    # The evaluation harness reads inputs as long as the export's positions allow (99 %, the paper's).
    assert finetuning.input_length(finetuning.FinetuneConfig(seed=0, lr=1e-5), 256, where="test") == 253
    assert hf_config["rope_parameters"]["rope_theta"] == LONG_BASE if "rope_parameters" in hf_config \
        else hf_config["rope_theta"] == LONG_BASE
    ids = torch.randint(0, 1000, (1, 200), generator=torch.Generator().manual_seed(0))  # beyond the first phase's 64
    with single_process_model_parallel(), torch.no_grad():
        trained = load_megatron_checkpoint(checkpoint).eval()
        assert trained.encoder_config.rotary_base == LONG_BASE
        bidirectional = attention_pattern(causal=False)
        expected = trained(ids.to(hardware.device()), packed_seq_params=bidirectional).cpu()
        first_base = trained(ids.to(hardware.device()), packed_seq_params=bidirectional, rotary_base=10_000.0).cpu()
    exported = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    with torch.no_grad():
        got = exported(input_ids=ids).logits
    torch.testing.assert_close(got, expected[..., :got.shape[-1]], atol=1e-5, rtol=1e-5)
    # The base matters at this length: the first phase's gives other logits, beyond the tolerance.
    assert not torch.allclose(first_base[..., :got.shape[-1]], got, atol=1e-5, rtol=1e-5)


def test_the_long_context_recipe_plans_each_phase(capsys):
    """examples/recipes/long_context/: the paper's 610M biphasic run with a final 8,192-token phase at
    the released EuroBERT's RoPE theta, planned at the paper-scale layout (64 GPUs)."""
    import re
    from pathlib import Path

    from megatron_ext.cli import pretrain_encoder

    recipe = Path(__file__).resolve().parents[2] / "examples/recipes/long_context/610m_biphasic_long_8192.yaml"
    assert pretrain_encoder.main(["--config", str(recipe), "--dry-run", "--world-size", "64"]) == 0
    plan = capsys.readouterr().out
    assert re.search(r"mlm-40 +steps \[ 37800,  42000\)", plan)
    assert ("sequence 8192, global 256 = micro 2 x DP 64 x 2, RoPE base 250000; tokens/step 2,097,152 vs "
            "2,359,296 in phases[0]") in plan
    assert "sequence 2048, global 1152 = micro 9 x DP 64 x 2, RoPE base 10000; same tokens/step" in plan
    per_token = [float(x) for x in re.findall(r"; (\S+) FLOPs/token, \S+ FLOPs$", plan, re.M)]
    assert per_token[2] > per_token[1]  # the same MLM at 4x the length: attention's share grows
    assert re.search(r"phases\[2\] mlm-40 +seq 8192 x micro 2: params", plan)
    assert "phases[2] at 8192 tokens:" in plan


def _two_rank_worker(rank: int, rendezvous: str, recipe: dict, out: str) -> None:
    from pathlib import Path

    from megatron_ext import process_group

    torch.set_num_threads(1)
    config = run_config_from_dict(recipe)
    process_group.init_process_group_and_model_parallel(
        tensor_parallel_size=1, pipeline_parallel_size=config.parallel.pipeline_model_parallel_size,
        seed=config.training.seed, init_method=rendezvous, rank=rank, world_size=2)
    result = pretrain(config)
    process_group.destroy_process_group_and_model_parallel()
    if rank == 0:
        Path(out).write_text(json.dumps(result.losses))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_two_ranks_match_one_rank_across_the_switch(straight, tiny_corpus, tmp_path, layout):
    """Data parallelism splits each phase's global batch (8 x 64, then 2 x 256 tokens) as one rank
    reads it; pipeline stages exchange each phase's own shape (PP=2 and its one-stage reference both
    start from the straight run's weights: a seed initialises each stage from the start of its stream)."""
    from distributed import run_ranks

    run_dir, _, single = straight
    parallel, checkpoint = {}, {"save": None}
    if layout == "pp2":
        parallel = {"pipeline_model_parallel_size": 2}
        checkpoint = {"save": None, "load": str(run_dir / "ckpt"), "finetune": True}
        single = pretrain(run_config_from_dict(_recipe(tiny_corpus, tmp_path / "pp1", checkpoint=checkpoint)))
    recipe = _recipe(tiny_corpus, tmp_path, parallel=parallel, checkpoint=checkpoint)
    out = tmp_path / "losses.json"
    run_ranks(_two_rank_worker, recipe, str(out), world=2, tmp_path=tmp_path)
    losses = {int(k): v for k, v in json.loads(out.read_text()).items()}
    for step, loss in single.losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), f"step {step}"


def test_a_branch_adds_the_long_phase_to_a_run_that_had_none(straight, tiny_corpus, tmp_path):
    """The documented continuation: a run trained at 64 tokens throughout, branched at step 4 with the
    long phase from there, trains steps 5-8 exactly as the run that had the long phase from the start."""
    _, _, long_from_the_start = straight
    plain = tiny_recipe(tiny_corpus, tmp_path / "plain")
    pretrain(run_config_from_dict(plain), exit_after_step=4)
    branch = _recipe(tiny_corpus, tmp_path / "branch",
                     checkpoint={"branch_from": str(tmp_path / "plain/ckpt"), "branch_step": 4})
    result = pretrain(run_config_from_dict(branch))
    assert result.start_step == 4
    for step in range(5, 9):
        assert result.losses[step] == long_from_the_start.losses[step], f"step {step}"


def test_isolated_documents_and_a_long_phase_pack_more_documents_per_row(tiny_corpus, tmp_path, monkeypatch):
    """With documents isolated in packed rows (``data.reset_attention_mask`` and ``reset_position_ids``)
    the long phase's rows hold more documents than the short phase's, each still attending only to
    itself (the document starts of the attention pattern, read where it is built); the run resumes exactly
    across the switch."""
    from megatron_ext.model import attention

    isolated = {"reset_attention_mask": True, "reset_position_ids": True}
    seen: dict[int, list[float]] = {}
    real = attention.document_cu_seqlens

    def recording(document_ends):
        cu_seqlens = real(document_ends)
        seen.setdefault(document_ends.shape[1], []).append((len(cu_seqlens) - 1) / document_ends.shape[0])
        return cu_seqlens

    monkeypatch.setattr(attention, "document_cu_seqlens", recording)
    straight = pretrain(run_config_from_dict(_recipe(tiny_corpus, tmp_path / "straight", data=isolated)))
    assert straight.final_step == 8 and set(seen) >= {64, 256}
    per_row = {length: sum(counts) / len(counts) for length, counts in seen.items()}
    assert per_row[256] > 1.3 * per_row[64] and per_row[64] > 1, per_row  # measured: 1.75 and 1.17 documents per row
    config = run_config_from_dict(_recipe(tiny_corpus, tmp_path / "resumed", data=isolated))
    pretrain(config, exit_after_step=3)
    resumed = pretrain(config)
    assert [resumed.losses[step] for step in range(4, 9)] == [straight.losses[step] for step in range(4, 9)]
