"""How long a checkpoint save stops training: synchronous vs Megatron's asynchronous save, one run.

    .venv/bin/python benchmarks/checkpoint_stall.py                   # CPU: 210m preset, vocab 8,192
    .venv/bin/python benchmarks/checkpoint_stall.py --preset 610m     # on a GPU

Builds the model and the Megatron engine with the distributed optimizer (what the paper recipes
run), takes one training step so the optimizer has state, then saves ``--rounds`` times each way
(alternating) through ``megatron_ext.checkpoint.core.CheckpointSaver``:
- ``stall_s``: how long ``save`` keeps the training loop waiting (what the step log feels);
- ``written_s``: from the call until the checkpoint is published (complete on disk);
- ``next_step_s``: the training step right after the save returns (an asynchronous writer shares
  the machine with it), against ``step_s``, a step with no save in flight.
On a GPU a third way, ``async_forked``: Megatron's writer forked per save (the CPU default)
instead of its persistent worker. Writes ``benchmarks/results/checkpoint_stall_<device>.json``
with the medians and every round.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.results_file import write_record  # noqa: E402
from megatron_ext import platform  # noqa: E402
from megatron_ext.model import build_encoder_model, parameter_count  # noqa: E402
from megatron_ext.objectives import MaskingConfig, apply_mlm  # noqa: E402
from megatron_ext.checkpoint import core as ckpt  # noqa: E402
from megatron_ext.training.config import run_config_from_dict  # noqa: E402
from megatron_ext.training.engines import MegatronEngine, MicroBatch, megatron_transformer_overrides  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="210m")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")

    raw = {"model": {"preset": args.preset, "vocab_size": args.vocab_size, "attention_backend": "local"},
           "tokenizer": {"tokenizer_model": "unused"},
           "data": {"data_path": ["unused"], "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
                    "global_batch_size": args.micro_batch_size},
           "schedule": {"lr": 1e-4, "lr_decay_style": "constant", "lr_warmup_iters": 0},
           "phases": [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}],
           "training": {"train_iters": 1, "bf16": platform.on_gpu()},
           "parallel": {"use_distributed_optimizer": True}}
    config = run_config_from_dict(raw)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        platform.init_process_group_and_model_parallel(init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        stack.callback(platform.destroy_process_group_and_model_parallel)
        model = build_encoder_model(config.model, transformer_overrides=megatron_transformer_overrides(config))
        engine = MegatronEngine(model.to(platform.device()), config)
        gen = torch.Generator(device=platform.device()).manual_seed(0)
        tokens = torch.randint(4, args.vocab_size, (args.micro_batch_size, args.seq_length),
                               device=platform.device(), generator=gen)
        batch = [MicroBatch(apply_mlm(tokens, config=MaskingConfig(mask_ratio=0.4), mask_id=3,
                                      vocab_size=args.vocab_size, special_ids=(0, 1, 2, 3), generator=gen), None)]

        def step() -> float:
            start = time.perf_counter()
            engine.train_step(batch, lr=1e-4)
            if platform.on_gpu():
                torch.cuda.synchronize()
            return time.perf_counter() - start

        step()
        savers = {"sync": ckpt.CheckpointSaver(async_save=False), "async": ckpt.CheckpointSaver(async_save=True)}
        if platform.persistent_checkpoint_writer():  # GPU: also the writer forked per save, as on CPU
            savers["async_forked"] = ckpt.CheckpointSaver(async_save=True, persistent_writer=False)
        rounds = {mode: [] for mode in savers}
        for saver in savers.values():  # closed before returning: no writer process outlives the benchmark
            stack.enter_context(saver)
        for i in range(args.rounds):
            for mode, saver in savers.items():
                plain = step()
                start = time.perf_counter()
                with engine.checkpointing():
                    saver.save(Path(tmp) / mode, step=i + 1, model=engine.checkpoint_model,
                               optimizer=engine.optimizer_state, trainer_state={}, run_config={},
                               tokenizer_reference={}, keep_last=1)
                stall = time.perf_counter() - start
                next_step = step()
                saver.wait()
                written = time.perf_counter() - start
                assert ckpt.latest_checkpoint(Path(tmp) / mode).name == f"iter_{i + 1:07d}"
                rounds[mode].append({"stall_s": stall, "written_s": written, "next_step_s": next_step,
                                     "step_s": plain})
                print(f"round {i + 1} {mode:>5}: stall {stall:.2f} s | written after {written:.2f} s | "
                      f"next step {next_step:.3f} s (plain {plain:.3f} s)", flush=True)

    summary = {mode: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for mode, rows in rounds.items()}
    device = platform.device_name() if platform.on_gpu() else f"cpu{torch.get_num_threads()}"
    record = {"device": device, **platform.software_versions(), "preset": args.preset, "vocab_size": args.vocab_size,
              "parameters": parameter_count(config.model), "distributed_optimizer": True, "median": summary,
              "stall_async_over_sync": summary["async"]["stall_s"] / summary["sync"]["stall_s"], "rounds": rounds}
    print(f"median stall: sync {summary['sync']['stall_s']:.2f} s, async {summary['async']['stall_s']:.2f} s "
          f"(x{record['stall_async_over_sync']:.2f}); written after {summary['async']['written_s']:.2f} s async")
    write_record("checkpoint_stall", device, record, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
