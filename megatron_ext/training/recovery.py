"""What a long run does about its own bad steps and about time: non-finite steps counted, loss spikes
watched, bad steps rolled back, saves on a wall-clock cadence; ``RunRecovery`` holds them for the loop.

- **Non-finite steps** (``training.max_nonfinite_steps``): the engine skips a step whose loss or
  gradient norm is not finite; that many in a row stop the run (``NonFiniteLossError``, one line).

- **Loss spikes** (``training.loss_spike_factor``): a step whose loss exceeds the factor times the
  mean of the previous ``loss_spike_window`` finite losses of its phase (objectives' losses are
  different quantities, so a phase starts a new window). The loss is the global mean, the same on
  every rank, so every rank judges alike without a collective.
- **Rollbacks** (``training.spike_rollbacks``): on a spike, or where the non-finite stop would end
  the run, the model and optimizer are reloaded from the newest complete checkpoint before the bad
  steps and training goes on with the next step's batch: the batches read since that checkpoint are
  never trained again (OLMo's and PaLM's restart-and-skip, without the restart). Data positions
  stay a function of the step, so a resume reads what the uninterrupted run reads.
- **Timed saves** (``checkpoint.save_interval_minutes``): a save after the first step that ends that
  long after the last one, decided in the stop decision's all-reduce (MAX) so that every rank saves
  the same step without a collective of its own.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass


from typing import TYPE_CHECKING

from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.checkpoint.resume import TrainingState
from megatron_ext.config_loading import UserError

if TYPE_CHECKING:  # types of the arguments only
    from megatron_ext.phases import ResolvedPhase
    from megatron_ext.training.megatron_engine import MegatronEngine, StepOutcome
    from megatron_ext.training.run_checkpoints import RunCheckpoints
    from megatron_ext.training.step_log import StepLogger
    from megatron_ext.training.watchdog import HangWatchdog


@dataclass(frozen=True, kw_only=True)
class Spike:
    """A step whose loss jumped (``LossSpikeWatch.check``)."""

    step: int
    loss: float
    mean: float
    """The running mean it is compared with."""
    factor: float
    """``training.loss_spike_factor``."""
    window: int

    def describe(self) -> str:
        return (f"loss spike at step {self.step}: loss {self.loss:.4f} is {self.loss / self.mean:.1f}x the mean "
                f"{self.mean:.4f} of the previous {self.window} steps (training.loss_spike_factor={self.factor:g})")


class LossSpikeWatch:
    """The running mean of each phase's last ``window`` finite losses, and the steps above
    ``factor`` times it (module docstring). ``factor`` None: nothing is judged."""

    def __init__(self, factor: float | None, window: int, saved: dict | None = None):
        self.factor, self.window = factor, window
        self.phase: int | None = None if saved is None else saved["phase"]
        self.losses: deque[float] = deque(() if saved is None else saved["losses"], maxlen=window)

    def state(self) -> dict:
        """What a checkpoint keeps (the trainer state's ``loss_window``), so that a resumed run
        judges its next steps as the uninterrupted run does."""
        return {"phase": self.phase, "losses": list(self.losses)}

    def check(self, step: int, loss: float, phase: int) -> Spike | None:
        """The spike at ``step`` (of phase index ``phase``), or None; a spike's loss does not enter
        the window, a normal one does (so after a rollback the window is still the losses before the
        spike, and the steps after it are judged against them)."""
        if self.factor is None:
            return None
        if phase != self.phase:
            self.phase, self.losses = phase, deque(maxlen=self.window)
        if not math.isfinite(loss):
            return None  # the non-finite guard's, not a spike
        if len(self.losses) == self.window:
            mean = sum(self.losses) / len(self.losses)
            if loss > self.factor * mean:
                return Spike(step=step, loss=loss, mean=mean, factor=self.factor, window=self.window)
        self.losses.append(loss)
        return None


class TimedSaves:
    """``checkpoint.save_interval_minutes``: whether that long has passed since the last save, on
    this rank; every rank saves the same step because the stop decision's all-reduce carries it
    (``StopPolicy.agree``)."""

    def __init__(self, minutes: float | None):
        self.minutes = minutes
        self.last = time.monotonic()

    def elapsed(self) -> bool:
        """Whether a save is due here (False without a cadence); no collective."""
        return self.minutes is not None and time.monotonic() - self.last >= 60 * self.minutes

    def saved(self) -> None:
        """A save (of any cause) just happened: the next is due ``minutes`` from now."""
        self.last = time.monotonic()


class Rollbacks:
    """``training.spike_rollbacks``: the rollbacks the run has made (saved in the trainer state, so
    that the bound holds across restarts) and the next one (module docstring)."""

    def __init__(self, limit: int, save_dir: str | None, *, save_interval: int, keep_steps: tuple[int, ...] = (),
                 done: list[dict] | None = None):
        self.limit, self.save_dir = limit, save_dir
        self.save_interval, self.keep_steps = save_interval, keep_steps
        self.done: list[dict] = list(done or [])

    def is_point(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` may be rolled back to: a step of the save cadence, a
        kept step or an earlier rollback's, which every run of the recipe saves, resumed or not (a
        save at a stop or on the wall clock is not: the run resumed from it would roll back
        elsewhere than the uninterrupted run)."""
        return step % self.save_interval == 0 or step in self.keep_steps or any(r["step"] == step for r in self.done)

    def protected(self, step: int) -> tuple[int, ...]:
        """The newest rollback point up to ``step``, kept by the checkpoint pruning while rollbacks
        are left (none otherwise)."""
        if self.left == 0:
            return ()
        points = [s for s in (step // self.save_interval * self.save_interval, *self.keep_steps,
                              *(r["step"] for r in self.done)) if 0 < s <= step]
        return (max(points),) if points else ()

    @property
    def left(self) -> int:
        return max(0, self.limit - len(self.done))

    def roll_back(self, target: TrainingState, *, step: int, first_bad: int, reason: str) -> dict | None:
        """Reload ``target``'s model and optimizer from the newest complete checkpoint of the save
        directory at a rollback point (:meth:`is_point`) before step ``first_bad``, after ``step``
        (the last bad one) was trained; the
        rollback's record, or None when none is left or no checkpoint comes before ``first_bad``.
        Every rank calls it at the same step (the decision is a function of the global loss)."""
        if self.left == 0 or self.save_dir is None:
            return None
        before = [checkpoint for checkpoint in Checkpoint.every(self.save_dir)
                  if checkpoint.step < first_bad and self.is_point(checkpoint.step)]
        if not before:
            return None
        checkpoint = before[-1]
        with target.checkpointing():
            checkpoint.load(model=target.checkpoint_model, optimizer=target.optimizer_state)
        record = {"step": step, "to_step": checkpoint.step, "skipped_steps": [checkpoint.step + 1, step],
                  "reason": reason, "rollback": len(self.done) + 1, "of": self.limit}
        self.done.append(record)
        return record

    @staticmethod
    def describe(record: dict) -> str:
        first, last = record["skipped_steps"]
        skipped = f"the batch of step {first} is" if first == last else f"the batches of steps {first}-{last} are"
        return (f"rolled back to step {record['to_step']}'s weights and optimizer after step {record['step']} "
                f"({record['reason']}); {skipped} skipped, training goes on with step {record['step'] + 1} "
                f"(rollback {record['rollback']} of training.spike_rollbacks={record['of']})")


class NonFiniteLossError(UserError):
    """Too many consecutive steps had a non-finite loss or gradient norm: caused by the data or the
    learning rate, so reported as one line (exit code 2) like any bad input."""


class NonFiniteGuard:
    """Counts steps the engine skipped for a non-finite loss or gradient norm; stops the run once
    ``training.max_nonfinite_steps`` come in a row. Both counters are saved with checkpoints."""

    def __init__(self, limit: int, *, in_a_row: int = 0, total: int = 0):
        self.limit, self.in_a_row, self.total = limit, in_a_row, total

    def update(self, step: int, outcome: StepOutcome, phase: ResolvedPhase) -> None:
        if not outcome.skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row < self.limit:
            return
        where = (f"step {step}: loss {outcome.loss} / grad norm {outcome.grad_norm} non-finite for {self.in_a_row} "
                 f"consecutive steps (training.max_nonfinite_steps={self.limit})")
        if outcome.scored_tokens == 0:  # 0/0: nothing to learn from, whatever the learning rate
            raise NonFiniteLossError(
                f"{where}: the last step scored no token, so its loss is 0/0: phase {phase.name}'s objective selected "
                "nothing in the batch; raise its masking ratio or data.seq_length, or check that the data holds "
                "tokens the objective may select (not only special tokens)")
        raise NonFiniteLossError(f"{where}; lower the learning rate, check the data, or resume from an earlier "
                                 "checkpoint")


@dataclass(kw_only=True)
class RunRecovery:
    """What the run does about its bad steps and its save cadence (module docstring), and this
    rank's heartbeat for the hang watchdog."""

    spikes: LossSpikeWatch
    rollbacks: Rollbacks
    timed_saves: TimedSaves
    watchdog: HangWatchdog | None = None
    """``training.hang_timeout_minutes``: this rank's heartbeat and watch (None: not watched)."""

    def step_finished(self, step: int) -> None:
        """``step`` is done, with its validation and save: the heartbeat."""
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def after_step(self, step: int, loss: float, phase: ResolvedPhase, *, nonfinite: NonFiniteLossError | None,
                   guard: NonFiniteGuard, engine: MegatronEngine, checkpoints: RunCheckpoints,
                   log: StepLogger) -> dict | None:
        """After ``step``: a spike said, and a spike or the non-finite stop (``nonfinite``) rolled
        back while rollbacks are left; the rollback's record, or None. Raises ``nonfinite`` when no
        checkpoint comes before the bad steps."""
        spike = self.spikes.check(step, loss, phase.index)
        if spike is not None:
            log.spike(spike)
        if nonfinite is None and (spike is None or not self.rollbacks.left):
            return None
        reason, first_bad = ((f"{guard.in_a_row} non-finite steps in a row", step - guard.in_a_row + 1)
                             if nonfinite is not None else (f"loss spike {spike.loss:.4f}", step))
        checkpoints.wait()  # the newest checkpoint before the bad steps is complete, or not there
        record = self.rollbacks.roll_back(engine, step=step, first_bad=first_bad, reason=reason)
        if record is None:
            if nonfinite is not None:
                raise NonFiniteLossError(f"{nonfinite} (no checkpoint of checkpoint.save before step {first_bad} "
                                         "to roll back to)") from None
            log.note(f"no checkpoint before step {first_bad} to roll back to: the spike is only said")
            return None
        guard.in_a_row = 0
        log.rollback(record, Rollbacks.describe(record))
        return record
