"""What a checkpoint save costs training: synchronous against asynchronous, and each asynchronous
writer (``checkpoint.async_strategy``: Megatron-Core's own, NVIDIA's resiliency package), one run.

    .venv/bin/python -m benchmarks.checkpoint_stall --preset tiny --vocab-size 32768   # CPU
    .venv/bin/python -m benchmarks.checkpoint_stall --preset 210m --seq-length 512     # on a GPU

Builds the model and the Megatron engine with the distributed optimizer (what the paper recipes
run), takes one training step so the optimizer has state, then, ``--rounds`` times, for each side in
turn (sides alternate, so drift in the machine's speed spreads over all of them): ``--steps-before``
plain steps, a save through ``megatron_ext.checkpoint.writer.CheckpointSaver``, and training steps
polled as the training loop polls (``CheckpointSaver.poll`` after each) until the checkpoint is
published and at least ``--steps-after`` steps have run. Per save:

- ``stall_s``: how long ``save`` keeps the training loop waiting;
- ``written_s``: from the call until the checkpoint is published (complete on disk);
- ``excess_s``: what the steps after the save took beyond as many plain steps (the writer sharing
  the machine, the publication in ``poll``), over every step until it was published and at least
  ``--steps-after`` of them;
- ``cost_s`` = stall + excess, also as plain steps (``cost_steps``) and as the share of a run that
  saves every ``--save-interval`` steps (``share_at_interval``; the recipes save every 1,000);
- CPU seconds, which a machine shared with other work disturbs less than wall time: the trainer's
  in the save call (``stall_cpu_s``) and beyond plain steps after it (``excess_cpu_s``), and its
  helper processes' until the save is published (``helpers_cpu_s``: the writer, forked or
  persistent, and the results queue's manager); the first step's minor
  page faults beyond a plain step's (``first_step_extra_page_faults``: copy-on-write copies of the
  memory a forked writer still shares).

Sides: ``sync``; ``async_<strategy>`` for each of ``--strategies`` (default: ``mcore``, and ``nvrx``
where ``checkpoint.config.nvrx_problem`` finds nothing against it); on a GPU also
``async_mcore_forked``, Megatron's writer forked per save (the CPU's) against its persistent worker.
``--time-limit-s`` starts no round that would not finish in time (the GPU suite's cap); the record
says how many ran. Writes ``benchmarks/results/checkpoint_stall_<device>.json`` (medians, ratios of
each asynchronous side to ``async_mcore``, every save).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from megatron_ext import hardware, process_group
from megatron_ext.checkpoint.reader import latest_checkpoint
from megatron_ext.checkpoint.writer import ASYNC_STRATEGIES, CheckpointSaver
from megatron_ext.checkpoint.config import check_nvrx_async_writer, nvrx_problem
from megatron_ext.model import build_encoder_model, parameter_count
from megatron_ext.objectives import MaskingConfig, apply_mlm
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.megatron_engine import MegatronEngine, MicroBatch, megatron_transformer_overrides

from benchmarks.results_file import write_record

MEDIAN_KEYS = ("stall_s", "written_s", "excess_s", "cost_s", "cost_steps", "share_at_interval", "plain_step_s",
               "steps_while_writing", "stall_cpu_s", "excess_cpu_s", "plain_step_cpu_s", "first_step_extra_page_faults",
               "helpers_cpu_s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="210m")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", choices=ASYNC_STRATEGIES, default=None,
                        help="asynchronous writers to time (default: mcore, and nvrx where it can run)")
    parser.add_argument("--steps-before", type=int, default=3, help="plain steps before each save (the baseline)")
    parser.add_argument("--steps-after", type=int, default=5, help="at least this many steps after each save")
    parser.add_argument("--max-steps-after", type=int, default=400,
                        help="then wait for the writer (its wait counts as stall)")
    parser.add_argument("--save-interval", type=int, default=1000, help="for share_at_interval")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="start no round that would end past this many seconds from the start")
    parser.add_argument("--output", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps_before < 1 or args.steps_after < 1:
        parser.error("--rounds, --steps-before and --steps-after must be >= 1")
    strategies = args.strategies or ["mcore"] + ([] if nvrx_problem() else ["nvrx"])
    if "nvrx" in strategies:
        check_nvrx_async_writer()  # one line, before minutes of set-up
    started = time.monotonic()

    raw = {"model": {"preset": args.preset, "vocab_size": args.vocab_size, "transformer_impl": "local"},
           "tokenizer": {"tokenizer_model": "unused"},
           "data": {"data_path": ["unused"], "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
                    "global_batch_size": args.micro_batch_size},
           "schedule": {"lr": 1e-4, "lr_decay_style": "constant", "lr_warmup_iters": 0},
           "phases": [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}],
           "training": {"train_iters": 1, "bf16": hardware.on_gpu()},
           "parallel": {"use_distributed_optimizer": True}}
    config = run_config_from_dict(raw)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        process_group.init_process_group_and_model_parallel(init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        stack.callback(process_group.destroy_process_group_and_model_parallel)
        model = build_encoder_model(config.model, transformer_overrides=megatron_transformer_overrides(config))
        engine = MegatronEngine(model.to(hardware.device()), config)
        gen = torch.Generator(device=hardware.device()).manual_seed(0)
        tokens = torch.randint(4, args.vocab_size, (args.micro_batch_size, args.seq_length),
                               device=hardware.device(), generator=gen)
        batch = [MicroBatch(apply_mlm(tokens, config=MaskingConfig(mask_ratio=0.4), mask_id=3,
                                      vocab_size=args.vocab_size, special_ids=(0, 1, 2, 3), generator=gen), None)]

        def step(saver: CheckpointSaver | None = None) -> tuple[float, float, int]:
            """Wall and CPU seconds (this process, all its threads) of one training step, and its minor
            page faults (copy-on-write copies while a forked writer shares the trainer's memory)."""
            start, start_cpu = time.perf_counter(), time.process_time()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            engine.train_step(batch, lr=1e-4)
            if saver is not None:
                saver.poll()  # as the training loop does after every step
            if hardware.on_gpu():
                torch.cuda.synchronize()
            return (time.perf_counter() - start, time.process_time() - start_cpu,
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)

        step()
        # Closed before returning (the stack): no writer process outlives the benchmark.
        savers = {"sync": stack.enter_context(CheckpointSaver(async_save=False))}
        for strategy in strategies:
            savers[f"async_{strategy}"] = stack.enter_context(
                CheckpointSaver(async_save=True, async_strategy=strategy))
        if hardware.persistent_checkpoint_writer():  # GPU: also the writer forked per save, as on CPU
            savers["async_mcore_forked"] = stack.enter_context(
                CheckpointSaver(async_save=True, persistent_writer=False))
        rounds: dict[str, list[dict]] = {side: [] for side in savers}
        round_s = 0.0
        for i in range(args.rounds):
            if args.time_limit_s is not None and time.monotonic() - started + round_s > args.time_limit_s:
                print(f"stopping after {i} rounds: another (~{round_s:.0f} s) would pass --time-limit-s", flush=True)
                break
            round_start = time.monotonic()
            for side, saver in savers.items():
                row = _timed_save(saver, step, engine, Path(tmp) / side, save_step=i + 1, args=args)
                rounds[side].append(row)
                print(f"round {i + 1} {side:>18}: stall {row['stall_s']:.3f} s | written after {row['written_s']:.2f} s "
                      f"| {row['steps_while_writing']} steps while writing, excess {row['excess_s']:+.3f} s | cost "
                      f"{row['cost_steps']:.1f} plain steps ({100 * row['share_at_interval']:.3f} % of a run saving "
                      f"every {args.save_interval})", flush=True)
            round_s = time.monotonic() - round_start

    ran = {side: rows for side, rows in rounds.items() if rows}
    summary = {side: {key: statistics.median(r[key] for r in rows) for key in MEDIAN_KEYS} for side, rows in ran.items()}
    device = hardware.device_name() if hardware.on_gpu() else f"cpu{torch.get_num_threads()}"
    record = {"device": device, **hardware.software_versions(),
              "load_average_at_end": os.getloadavg(),  # a shared machine's figures are only as quiet as it was
              "preset": args.preset, "vocab_size": args.vocab_size, "seq_length": args.seq_length,
              "micro_batch_size": args.micro_batch_size, "parameters": parameter_count(config.model),
              "distributed_optimizer": True, "save_interval": args.save_interval,
              "rounds_run": min((len(rows) for rows in rounds.values()), default=0), "median": summary,
              "ratios_to_async_mcore": _ratios(summary), "rounds": rounds}
    if "sync" in summary and "async_mcore" in summary:
        record["stall_async_over_sync"] = summary["async_mcore"]["stall_s"] / summary["sync"]["stall_s"]
    for side, values in summary.items():
        print(f"median {side:>18}: stall {values['stall_s']:.3f} s, written after {values['written_s']:.2f} s, "
              f"cost {values['cost_s']:.3f} s = {values['cost_steps']:.1f} plain steps "
              f"({100 * values['share_at_interval']:.3f} % at --save-interval {args.save_interval}); CPU s: "
              f"stall {values['stall_cpu_s']:.3f}, steps' excess {values['excess_cpu_s']:+.3f}, "
              f"helper processes {values['helpers_cpu_s']:.2f}")
    write_record("checkpoint_stall", device, record, args.output)
    return 0


def _timed_save(saver: CheckpointSaver, step, engine: MegatronEngine, save_dir: Path, *, save_step: int,
                args: argparse.Namespace) -> dict:
    """One save between plain steps and the steps that run while it is written (module docstring).
    Besides wall time, CPU seconds, which other processes on a shared machine disturb less: the
    trainer's in the save call and in the steps after it, and its helper processes' (the writers,
    forked or persistent, and the results queue's manager) from the save until it is published."""
    before = [step() for _ in range(args.steps_before)]
    plain, plain_cpu = statistics.median(r[0] for r in before), statistics.median(r[1] for r in before)
    plain_faults = statistics.median(r[2] for r in before)
    helpers = _helpers_cpu_s()
    start, start_cpu = time.perf_counter(), time.process_time()
    with engine.checkpointing():
        saver.save(save_dir, step=save_step, model=engine.checkpoint_model, optimizer=engine.optimizer_state,
                   trainer_state={}, run_config={}, model_config={}, tokenizer_reference={}, keep_last=1)
    stall, stall_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    after: list[tuple[float, float, int]] = []
    written, steps_while_writing = None, 0
    if not saver.in_flight:  # synchronous: written now
        written, helpers = stall, _helpers_cpu_s() - helpers
    while written is None or len(after) < args.steps_after:
        if written is None and len(after) >= args.max_steps_after:  # the writer is too slow for the steps
            waited = time.perf_counter()
            saver.wait()
            stall += time.perf_counter() - waited
        else:
            after.append(step(saver))
        if written is None and not saver.in_flight:
            written = time.perf_counter() - start
            steps_while_writing = len(after)
            helpers = _helpers_cpu_s() - helpers
    assert latest_checkpoint(save_dir).name == f"iter_{save_step:07d}"
    excess = sum(r[0] for r in after) - len(after) * plain
    excess_cpu = sum(r[1] for r in after) - len(after) * plain_cpu
    cost = stall + excess
    return {"stall_s": stall, "written_s": written, "steps_while_writing": steps_while_writing, "excess_s": excess,
            "cost_s": cost, "cost_steps": cost / plain, "share_at_interval": cost / (args.save_interval * plain),
            "plain_step_s": plain, "stall_cpu_s": stall_cpu, "excess_cpu_s": excess_cpu, "helpers_cpu_s": helpers,
            "plain_step_cpu_s": plain_cpu, "first_step_extra_page_faults": after[0][2] - plain_faults,
            "steps_after_s": [r[0] for r in after], "steps_after_cpu_s": [r[1] for r in after],
            "steps_after_page_faults": [r[2] for r in after], "plain_step_page_faults": plain_faults}


def _helpers_cpu_s() -> float:
    """User + system CPU seconds of this process's helper processes so far: the reaped ones (forked
    writers) and the live ones (a persistent writer, the results queue's manager)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile is counted once reaped
            times = child.cpu_times()
            total += times.user + times.system
    return total


def _ratios(summary: dict) -> dict:
    """Each asynchronous side's median stall and cost over ``async_mcore``'s (the default writer)."""
    base = summary.get("async_mcore")
    if base is None:
        return {}
    return {side: {key: values[key] / base[key] if base[key] else None for key in ("stall_s", "cost_s", "written_s")}
            for side, values in summary.items() if side.startswith("async_") and side != "async_mcore"}


if __name__ == "__main__":
    sys.exit(main())
