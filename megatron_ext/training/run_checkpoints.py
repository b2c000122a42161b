"""The run's saves into ``checkpoint.save``: the engine's state with the run config, the weights'
architecture (``model_config.json``, with the RoPE base the weights last trained with) and the
tokenizer reference, synchronously or in the background (``checkpoint.async_save``)."""

from __future__ import annotations

from megatron_ext.checkpoint.lock import SaveDirectoryLock
from megatron_ext.checkpoint.reader import TOKENIZER_FINGERPRINT
from megatron_ext.checkpoint.writer import CheckpointSaver
from megatron_ext.tokenizer import EncoderTokenizer
from megatron_ext.training import context as context_lib
from megatron_ext.training.config import RunConfig
from megatron_ext.training.megatron_engine import MegatronEngine
from megatron_ext.training.step_log import is_writer


class RunCheckpoints:
    """The run's saves into ``checkpoint.save``: the engine's state with the run config and the
    tokenizer reference, synchronously or in the background (``checkpoint.async_save``)."""

    def __init__(self, config: RunConfig, engine: MegatronEngine, tokenizer: EncoderTokenizer, *,
                 lock: SaveDirectoryLock | None):
        self.config = config.checkpoint
        self.phase_contexts = config.phase_contexts
        self.engine = engine
        self.lock = lock
        self.run_config = config.to_dict()
        self.tokenizer_reference = {**tokenizer.reference(), TOKENIZER_FINGERPRINT: tokenizer.fingerprint()}
        self.saver = CheckpointSaver(async_save=self.config.async_save, async_strategy=self.config.async_strategy)

    def save(self, step: int, trainer_state: dict, *, weights_step: int, protect: tuple[int, ...] = ()) -> str:
        """Save (or start saving) the state after ``step``; returns the checkpoint's path.
        ``weights_step``: the step whose training the weights hold (``step``, or after a rollback the
        step rolled back to), whose phase's RoPE base is saved as the weights' ``model.rotary_base``
        (``context.phase_contexts``, the one rule). ``protect``: steps the pruning keeps besides
        ``checkpoint.keep_steps`` (a rollback point)."""
        if self.lock is not None:
            self.lock.check_held(before=f"saving step {step}")
        rotary_base = context_lib.context_at(self.phase_contexts, max(weights_step - 1, 0)).rotary_base
        with self.engine.checkpointing():
            path = self.saver.save(
                self.config.save, step=step, model=self.engine.checkpoint_model,
                optimizer=self.engine.optimizer_state, trainer_state=trainer_state, run_config=self.run_config,
                model_config={**self.run_config["model"], "rotary_base": rotary_base},
                tokenizer_reference=self.tokenizer_reference, keep_last=self.config.keep_last,
                keep_steps=tuple(sorted({*self.config.keep_steps, *protect})), weights_step=weights_step,
            )
        if is_writer():
            print(f"{'writing checkpoint in the background' if self.saver.in_flight else 'saved checkpoint'} {path}",
                  flush=True)
        return str(path)

    def poll(self) -> None:
        """Publish the background saves every rank has finished."""
        self.saver.poll()

    def wait(self) -> None:
        """Return once every save started is complete."""
        self.saver.wait()

    def close(self, *, abort: bool) -> None:
        """Stop the background writers (``CheckpointSaver.close``): after the last save is
        published, or, after an error, at once."""
        self.saver.close(abort=abort)
