"""What a run reports: one readable line per logged step, and every record to its sinks.

``StepLogger`` keeps the window since the last line (mean loss, tokens/s, MFU, ETA) and prints the
step line that :func:`format_step_line` builds, a line where a phase begins, and the evaluations'
lines; :class:`MetricSinks` writes every record (each step, each validation, the test evaluation)
to ``metrics.jsonl`` and, when enabled, to Weights & Biases. Only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch.distributed as dist

from megatron_ext import hardware
from megatron_ext.fileio import write_atomic
from megatron_ext.phases import ResolvedPhase
from megatron_ext.progress import duration
from megatron_ext.training.config import LoggingConfig, RunConfig
from megatron_ext.performance.devices import peak_flops_per_device
from megatron_ext.performance.flops import MFU_CONVENTION, flops_per_token, lm_head_share


def format_step_line(*, step: int, total_steps: int, phase: ResolvedPhase, loss: float, lr: float, grad_norm: float,
                     tokens_per_s: float, mfu: float | None, elapsed_s: float, eta_s: float, skipped: int,
                     name_width: int = 7, global_batch: int | None = None) -> str:
    """The step log line, e.g. ``step  40/100 | mlm-30  | loss 5.2692 | lr 1.00e-03 | gnorm 0.912 |
    12,345 tok/s | MFU 41.2% | elapsed 1m02s | ETA 1m33s``; the phase name is padded to
    ``name_width`` (the run's longest), so a run's columns line up. ``loss`` is what the caller
    averaged (``StepLogger``: the steps since the last line); ``skipped`` counts those steps that
    were skipped for a non-finite loss or gradient norm (Megatron's "number of skipped
    iterations")."""
    line = (f"step {step:>{len(str(total_steps))}}/{total_steps} | {phase.name:<{name_width}} | loss {loss:.4f} | "
            f"lr {lr:.2e} | gnorm {grad_norm:.3f} | {tokens_per_s:,.0f} tok/s")
    if mfu is not None:
        line += f" | MFU {100 * mfu:.1f}%"
    line += f" | elapsed {duration(elapsed_s)} | ETA {duration(eta_s)}"
    if global_batch is not None:  # a batch-size ramp-up (data.rampup_batch_size): the step's global batch
        line += f" | batch {global_batch}"
    if skipped:
        line += f" | {skipped} step{'s' if skipped > 1 else ''} SKIPPED (non-finite)"
    return line


def is_writer() -> bool:
    """Whether this process reports (rank 0, or a process outside torch.distributed)."""
    return not dist.is_initialized() or dist.get_rank() == 0


class MetricSinks:
    """``<log_dir>/metrics.jsonl`` (appended, so a resumed run continues it) and W&B (resumed by
    run id). Does nothing on ranks other than 0.

    The file holds each step once: a run resumed from step ``start_step`` first drops the rows of
    steps after it (a previous attempt went on past its last checkpoint; those steps are redone,
    and a torn last line of a killed writer goes with them), so every reader can take the rows as
    they are. Each start adds a ``{"kind": "run", "step": start_step, ...}`` header row (``header``).

    W&B is quiet (``WANDB_SILENT``, unless the environment sets it): the run's folder is named once,
    in one line; ``WANDB_SILENT=false`` shows wandb's own output."""

    def __init__(self, config: LoggingConfig, *, run_config: dict, wandb_run_id: str | None, start_step: int = 0):
        self.wandb = None
        self.wandb_run_id = wandb_run_id
        self.metrics = None
        if not is_writer():
            return
        log_dir = Path(config.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        drop_superseded_rows(log_dir / "metrics.jsonl", start_step)
        self.metrics = open(log_dir / "metrics.jsonl", "a", encoding="utf-8")
        if config.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self.wandb = wandb.init(
                project=config.wandb_project, name=config.wandb_exp_name or log_dir.name, dir=str(log_dir),
                mode=config.wandb_mode, config=run_config, id=wandb_run_id, resume="allow",
            )
            self.wandb_run_id = self.wandb.id
            sync = f"; `wandb sync {self.wandb.settings.sync_dir}` uploads it" if config.wandb_mode == "offline" else ""
            print(f"wandb: {config.wandb_mode} run {self.wandb.id} in {self.wandb.settings.sync_dir}{sync}", flush=True)

    def header(self, values: dict, step: int) -> None:
        """The header row of this start of the run (what it reads: the blend's weights and shares)."""
        if self.metrics is None:
            return
        self.metrics.write(json.dumps({"kind": "run", "step": step, **values}) + "\n")
        self.metrics.flush()

    def record(self, kind: str, step: int, values: dict) -> None:
        """One record: a JSON line ``{"kind", "step", **values}``; numbers also to W&B as ``kind/key``."""
        if self.metrics is None:
            return
        self.metrics.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        self.metrics.flush()
        if self.wandb is not None:
            self.wandb.log({f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.wandb is not None:
            self.wandb.finish()


def drop_superseded_rows(path: Path, start_step: int) -> int:
    """Rewrite ``path`` (atomically) without the rows of steps after ``start_step``, the header rows
    of starts at or after it, and lines that do not parse (a killed writer's torn last line);
    returns how many went. Nothing happens when there is nothing to drop."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1
            continue
        if step > start_step or (row.get("kind") == "run" and step >= start_step):
            dropped += 1
        else:
            kept.append(line + "\n")
    if dropped:
        write_atomic(path, "".join(kept))
    return dropped


class StepLogger:
    """A line every ``training.log_interval`` steps (and at the last), a record at every step.

    The line's loss is the mean over the steps since the last line that were not skipped, as
    Megatron-LM's (which averages its losses over ``--log-interval``): one step's loss is noisy, and
    a line every N steps would otherwise show one sample of N. A phase that begins between two lines
    starts its own mean (a CLM and an MLM loss measure different things; the line names the phase
    of its steps), and a mean of no step (all skipped) is NaN. The lr and gradient norm are the
    last step's; tokens/s and MFU are over the steps since the last line. ``metrics.jsonl`` keeps
    every step's own loss."""

    def __init__(self, config: RunConfig, sinks: MetricSinks, *, total_steps: int, start_step: int):
        self.config = config
        self.sinks = sinks
        self.total_steps = total_steps
        self.start_step = start_step
        name = hardware.device_name()
        self.peak = peak_flops_per_device(name) if name else None
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.run_start = self.window_start = time.perf_counter()
        self.window_steps = 0
        self.window_flops = 0.0
        self.window_tokens = 0
        self.line_loss = _LineLoss()
        self.name_width = max([7, *(len(phase.name) for phase in config.resolved_phases)])

    def banner(self, phases: list[ResolvedPhase], rank_nodes: list[str]) -> None:
        """What the run will do and where: its phases, the MFU convention, the engine and device."""
        if is_writer():
            contexts = self.config.phase_contexts
            shown = len({(c.seq_length, c.rotary_base, c.global_batch_size) for c in contexts}) > 1
            print(f"training {self.total_steps} steps from step {self.start_step}: " + ", ".join(
                f"{p.name} [{p.start}, {p.end})" + (f" at {c.seq_length} tokens x {c.global_batch_size}, RoPE base "
                                                    f"{c.rotary_base:g}" if shown else "")
                for p, c in zip(phases, contexts)) + f"; MFU convention: {MFU_CONVENTION}", flush=True)
            print(f"engine: megatron; {hardware.placement(rank_nodes)}; {hardware.accelerator_summary()}", flush=True)

    def phase_begins(self, step: int, phase: ResolvedPhase) -> None:
        """One line where this run enters ``phase``, before its step ``step`` (0-based): the phase's
        first step, or a resumed run's first step inside it. It names the phase, its objective and
        what the step reads (sequence length, RoPE base, global batch: a ramp-up's at that step),
        each with the step before's value where the phase changes it: the banner lists every phase
        up front, this line says when the run crosses into one (e.g. a long-context phase)."""
        if not is_writer():
            return
        contexts = self.config.phase_contexts
        context = contexts[phase.index]
        begins = step == phase.start
        before = contexts[phase.index - 1] if begins and phase.index > 0 else None

        def setting(label: str, value: float, previous: float | None) -> str:
            changed = previous is not None and previous != value
            return f"{label} {value:g}" + (f" (was {previous:g})" if changed else "")

        settings = [
            setting("seq_length", context.seq_length, None if before is None else before.seq_length),
            setting("RoPE base", context.rotary_base, None if before is None else before.rotary_base),
            setting("global batch", self.config.global_batch_size_at(step),
                    None if before is None else self.config.global_batch_size_at(step - 1))]
        print(f"phase {phase.index + 1}/{len(contexts)} {phase.name} [{phase.start}, {phase.end}) "
              f"{'begins' if begins else 'continues'} with step {step + 1}: objective {phase.objective.describe()}, "
              + ", ".join(settings), flush=True)

    def step(self, step: int, phase: ResolvedPhase, loss: float, lr: float, grad_norm: float, skipped: bool) -> None:
        self.window_steps += 1
        self.line_loss.add(phase.index, loss, skipped)
        # ``step`` counts completed steps: this is the update of step ``step - 1``.
        context = self.config.phase_contexts[phase.index]  # the phase's length and batch (training.context)
        share = lm_head_share(phase, step - 1, seq_length=context.seq_length,
                              scored_only=self.config.training.lm_head_scored_only)
        global_batch = self.config.global_batch_size_at(step - 1)  # a ramp-up's (data.rampup_batch_size)
        tokens = global_batch * context.seq_length
        self.window_tokens += tokens
        self.window_flops += tokens * flops_per_token(
            self.config.model, context.seq_length, lm_head_share=share)
        values = {"objective": phase.objective.tag, "phase": phase.name, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "skipped": skipped, "seq_length": context.seq_length, "global_batch_size": global_batch}
        interval = self.config.training.log_interval
        if interval and (step % interval == 0 or step == self.total_steps):
            now = time.perf_counter()
            window_s = max(now - self.window_start, 1e-9)
            values["tokens_per_s"] = self.window_tokens / window_s
            mfu = self.window_flops / window_s / (self.peak * self.world) if self.peak else None
            if mfu is not None:
                values["mfu"] = mfu
            elapsed = now - self.run_start
            if is_writer():
                print(format_step_line(
                    step=step, total_steps=self.total_steps, phase=phase, loss=self.line_loss.mean, lr=lr,
                    grad_norm=grad_norm, tokens_per_s=values["tokens_per_s"], mfu=mfu, elapsed_s=elapsed,
                    skipped=self.line_loss.skipped, name_width=self.name_width,
                    global_batch=global_batch if self.config.data.rampup_batch_size is not None else None, eta_s=elapsed / max(step - self.start_step, 1) * (self.total_steps - step)), flush=True)
            self.window_start, self.window_steps, self.window_flops, self.window_tokens = now, 0, 0.0, 0
            self.line_loss = _LineLoss()
        self.sinks.record("train", step, values)

    def validation(self, step: int, losses: dict[str, float], by_source: dict[str, dict[str, float]]) -> None:
        """A validation's losses: a ``valid`` record and the line ``validation at step N: ...``;
        with a blend of several sources, each source's (``by_source`` in the record, one more line)."""
        self._evaluation("valid", "validation", step, losses, by_source)

    def spike(self, spike) -> None:
        """A loss spike (``training.recovery.Spike``): one line and a ``spike`` record."""
        self.sinks.record("spike", spike.step, {"loss": spike.loss, "mean": spike.mean, "factor": spike.factor,
                                                "window": spike.window})
        if is_writer():
            print(spike.describe(), flush=True)

    def rollback(self, record: dict, line: str) -> None:
        """A rollback (``training.recovery.Rollbacks``): one line and a ``rollback`` record."""
        self.sinks.record("rollback", record["step"], {k: v for k, v in record.items() if k != "step"})
        if is_writer():
            print(line, flush=True)

    def note(self, line: str) -> None:
        """One line on rank 0."""
        if is_writer():
            print(line, flush=True)

    def test(self, step: int, losses: dict[str, float], by_source: dict[str, dict[str, float]]) -> None:
        """The test split's losses at the end of training: a ``test`` record and ``test at step N: ...``."""
        self._evaluation("test", "test", step, losses, by_source)

    def _evaluation(self, kind: str, title: str, step: int, losses: dict[str, float],
                    by_source: dict[str, dict[str, float]]) -> None:
        self.sinks.record(kind, step, {**losses, "by_source": by_source} if by_source else losses)
        if is_writer():
            measured = self.config.validation_objectives()
            print(f"{title} at step {step}: " + " | ".join(
                f"{objective.name} loss {losses[key]:.4f}" for key, objective in measured.items()), flush=True)
            if by_source:
                print("  by source: " + " | ".join(
                    f"{name} " + " ".join(f"{objective.name} {source[key]:.4f}" for key, objective in measured.items())
                    for name, source in by_source.items()), flush=True)


class _LineLoss:
    """The step line's loss: the mean over the steps since the last line that were not skipped, and
    how many were skipped; restarted where a phase begins (``StepLogger``)."""

    def __init__(self) -> None:
        self.phase: int | None = None
        self.total, self.steps, self.skipped = 0.0, 0, 0

    def add(self, phase: int, loss: float, skipped: bool) -> None:
        if phase != self.phase:
            self.phase, self.total, self.steps, self.skipped = phase, 0.0, 0, 0
        if skipped:
            self.skipped += 1
        else:
            self.total += loss
            self.steps += 1

    @property
    def mean(self) -> float:
        return self.total / self.steps if self.steps else math.nan
