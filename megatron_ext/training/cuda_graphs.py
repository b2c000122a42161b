"""CUDA graphs of the transformer layers (``training.cuda_graphs``), through Megatron-Core's own
``local`` implementation (``megatron.core.transformer.cuda_graphs.CudaGraphManager``).

Why: the 1B model on an H200 (seq 2,048, 6 micro-batches of 3) spends 587 ms of GPU time in a
854 ms step: the host, launching Transformer Engine's modules at 200-400 us of CPU each, is the
bottleneck. A graph replays a whole layer's forward (or backward) with one launch.

How Megatron-Core does it, and what this module adds around it:

- ``TransformerConfig.cuda_graph_impl = "local"`` (with ``cuda_graph_modules = []``, the whole
  layer, as ``model.builder.transformer_config`` always sets) makes every ``TransformerLayer``
  own a ``CudaGraphManager`` (``transformer/module.py::GraphableMegatronModule.__init__``,
  ``transformer_layer.py::create_mcore_cudagraph_manager``). Until graphs exist, each training
  forward runs eagerly and is *recorded* (``_CudaGraphRunner.record_graph_capture``); at the end of
  the step's ``forward_backward`` the schedule calls ``create_cudagraphs()``
  (``pipeline_parallel/schedules.py``), which captures every recorded forward and backward in
  execution order into one shared memory pool, after ``cuda_graph_warmup_steps`` (Megatron's
  default, 3) eager passes per graph. From then on a layer call *replays* the graph of the runner
  whose recorded arguments match the call's (``CudaGraphManager.get_cudagraph_runner``,
  ``_CudaGraphRunner.get_mismatch_errors``: type, shape, dtype and device of every tensor
  argument, the value of every other) and refuses a call that matches none.
- The attention pattern travels per call in ``packed_seq_params`` (``model.attention.AttentionPattern``,
  a dataclass whose fields Megatron compares one by one, ``causal`` by value), so Megatron keeps one
  runner per layer and direction and never replays a causal graph for a bidirectional call (nor
  the reverse). The RoPE base travels in the RoPE table, a tensor argument: a phase that changes it
  replays the same graphs with other angles.
  But only the patterns recorded before ``create_cudagraphs()`` get graphs, and a biphasic run
  meets its second pattern only at the phase switch. So the engine *primes* the graphs on the
  run's first training step (``LayerGraphs.capture``): one forward-backward over the step's first
  micro-batch once per pattern the run's phases use (causal and/or bidirectional), whose
  gradients are discarded; Megatron captures both patterns' graphs at its end, in the same pool
  (captured in sequence, so the two patterns share the pool's memory: a replay of one pattern's
  forward and backward completes before the next micro-batch starts, without pipelining). The
  engine then checks that every layer holds exactly one runner per pattern. A resumed run primes
  again on its first step (graphs are runtime state: checkpoints do not change).
- The capture runs inside ``torch.autocast(cache_enabled=False)`` when the run trains under bf16
  autocast: Megatron captures after the micro-batches' own autocast regions have closed, and an
  autocast weight-cast cache would put freed cast copies into the graphs.
- Validation runs eagerly (``LayerGraphs.eager``): its micro-batches may have another shape, and
  it runs both objectives whatever the phases.
- Graph-safe RNG: the manager refuses an RNG tracker that cannot be captured
  (``CudaGraphManager.__init__``); Megatron-LM seeds its tracker with ``use_cudagraphable_rng``
  whenever graphs are on and switches to Transformer Engine's tracker when TE is the layers'
  implementation (``training/initialize.py::_set_random_seed``, ``training/arguments.py``), as
  ``prepare_rng`` does here. The tracker's states are saved in checkpoints in the same format as
  without graphs (``hardware.rng_state``).
- ``LayerGraphs.close`` deletes the graphs (``delete_cuda_graphs``: Megatron's global record,
  pool and saved-tensor observer) at the end of the run, so another model in the same process
  (tests, the benchmark) starts from a clean state; Megatron-LM does the same for its TE graphs at
  the end of ``train``.
- Megatron's DDP knows graphed layers: the manager calls its forward pre-hooks (parameter
  all-gather with ``overlap_param_gather``) before each replay, and the backward graph adds
  weight gradients into ``main_grad`` and marks them ready for the overlapped reduction
  (``distributed_data_parallel.py``, ``_cudagraph_wgrad_ready_event``). FP8 scaling state is
  saved and restored around the capture's warm-up by the runner itself.

What is refused, before anything is built: the rules are stated here, once, and asked by the
config (``training_problem`` by ``TrainingConfig``, ``run_problem`` by ``RunConfig``) and by the
pre-flight (``machine_problem``, ``training.preflight``): the ``transformer_engine`` implementation (TE's
``make_graphed_callables`` captures each layer once per micro-batch with Megatron's sample
arguments, a dense causal ``[b, 1, s, s]`` mask, and replays None as a dense zero mask:
``transformer_layer.py::get_layer_static_inputs``, ``_get_te_cuda_graph_replay_args``; the
per-call pattern would not reach the attention); ``data.reset_attention_mask`` (each micro-batch's
documents are a data-dependent packed-sequence layout, ``cu_seqlens`` of varying length, that a
captured graph cannot replay: NVIDIA/Megatron-LM#5619, until upstream supports it); activation recomputation (Megatron refuses full
recomputation with per-layer graphs; selective recomputation inside a graph is unverified here);
pipeline parallelism (Megatron then keeps one runner per micro-batch in flight, untested here);
more than one shape (phases at other lengths or batches, a batch-size ramp-up: a graph replays the
shape it captured); CPU (CUDA graphs are CUDA). The LM head and the loss stay outside the graphs, eager: the MLM head
runs on ``max_scored_per_sequence`` rows, a fixed shape, but it never needed a graph.

Measured on an H200 (2026-11-26, torch 2.11, megatron-core 0.19.2, *without* Transformer Engine:
the local spec): tests/integration/test_gpu.py's biphasic engine runs with graphs gave every training and
validation loss bitwise equal to eager mode's (fp32 parameters under bf16 autocast; bf16
parameters with the distributed optimizer and overlapped reduction), one replay per layer call;
the 1b throughput shape (seq 2,048, 6 micro-batches of 3) went from 0.741 to 0.725 s per step
(x1.02: the local spec's modules cost the host little) and from 32.3 to 23.3 GB peak allocated.
Through the trainer's loop, a graphed biphasic run stopped at step 20 and resumed trained steps
21-40 exactly as the uninterrupted graphed run, and so did its checkpoint resumed without graphs.
At the recipes' 2 micro-batches of 9 on an H100 (2026-11-27) graphs changed the 1B step's speed by
less than 1 % with either spec (TE 67,364 -> 67,259 tok/s) and lowered its peak by 9 GB. FP8 under
graphs is not measured yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from megatron_ext import hardware

LOCAL = "local"
"""The one implementation this trainer runs (Megatron's ``cuda_graph_impl`` value)."""
REFUSED_IMPLEMENTATIONS = {
    "transformer_engine": "Transformer Engine's make_graphed_callables captures each layer with Megatron's sample "
                          "arguments (a dense causal [b, 1, s, s] mask) and replays a None mask as a dense zero mask, "
                          "so the per-call attention pattern (CLM causal, MLM bidirectional) would not reach the "
                          "attention; use training.cuda_graphs: megatron (Megatron's CudaGraphManager, which graphs "
                          "Transformer Engine layers too)",
}


def training_problem(training: Any) -> str | None:
    """What in a ``TrainingConfig`` rules its ``cuda_graphs`` setting out (one line naming the
    keys), or None."""
    impl = training.cuda_graphs
    if impl == "none":
        return None
    if impl in REFUSED_IMPLEMENTATIONS:
        return f"training.cuda_graphs={impl!r} is not supported: {REFUSED_IMPLEMENTATIONS[impl]}"
    if training.recompute_granularity is not None:
        return (f"training.cuda_graphs={impl!r} with training.recompute_granularity="
                f"{training.recompute_granularity!r}: Megatron captures full recomputation only in "
                "full-iteration graphs, and recomputation inside a layer graph is unverified here; remove one "
                "(graphs keep a pool of one micro-batch's layer activations, recomputation saves memory)")
    return None


def run_problem(config: Any) -> str | None:
    """What in a ``RunConfig`` (beyond its training section) rules ``training.cuda_graphs`` out, or
    None. Asked once the config's phase contexts are resolved (``RunConfig.phase_contexts``)."""
    from megatron_ext.training.context import varies

    impl = config.training.cuda_graphs
    if impl == "none":
        return None
    if config.data.reset_attention_mask:
        return (f"training.cuda_graphs={impl!r} with data.reset_attention_mask: true: each micro-batch's documents "
                "are a data-dependent packed-sequence layout that Megatron's graphs cannot capture "
                "(NVIDIA/Megatron-LM#5619); train without one of them")
    if config.parallel.pipeline_model_parallel_size > 1:
        return (f"training.cuda_graphs={impl!r} with parallel.pipeline_model_parallel_size="
                f"{config.parallel.pipeline_model_parallel_size}: Megatron then keeps a graph per micro-batch in "
                "flight (1F1B), which this trainer has not verified; use pipeline_model_parallel_size: 1")
    if varies(config.phase_contexts) or config.data.rampup_batch_size is not None:
        return (f"training.cuda_graphs={impl!r} captures one shape; phases with other seq_length or batch sizes, "
                "and a batch-size ramp-up, need training.cuda_graphs: none")
    return None


def machine_problem(config: Any) -> str | None:
    """What this machine lacks for a ``RunConfig``'s ``training.cuda_graphs`` (a CUDA GPU), or None:
    the pre-flight's machine check (``training.preflight.check_machine``)."""
    impl = config.training.cuda_graphs
    if impl != "none" and not hardware.on_gpu():
        return (f"training.cuda_graphs={impl!r}: CUDA graphs need a CUDA GPU; this machine has none. Set "
                "training.cuda_graphs: none on CPU")
    return None


def enabled(config: Any) -> bool:
    """Whether ``config`` (a ``RunConfig``) trains with layer graphs."""
    return config.training.cuda_graphs != "none"


def uses_te_rng_tracker(config: Any) -> bool:
    """Transformer Engine's RNG tracker for graphed runs of the ``te`` spec, as Megatron-LM
    switches to it whenever graphs meet TE layers (``training/arguments.py``)."""
    return enabled(config) and config.model.transformer_impl.uses_transformer_engine and hardware.transformer_engine_available()


def transformer_overrides(config: Any) -> dict:
    """``TransformerConfig`` fields for ``training.cuda_graphs`` (none when off). The scope is the
    whole layer: ``cuda_graph_modules=[]``, set by ``model.builder.transformer_config`` for every
    run; ``cuda_graph_warmup_steps`` keeps Megatron's default (3 eager passes per graph before its
    capture). ``use_te_rng_tracker`` records the tracker ``prepare_rng`` installs."""
    if not enabled(config):
        return {}
    return {"cuda_graph_impl": LOCAL, "use_te_rng_tracker": uses_te_rng_tracker(config)}


def prepare_rng(config: Any) -> None:
    """Seed Megatron's model-parallel RNG tracker graph-safe (``training.seed``), before the model
    is built (its layers' graph managers check the tracker). Nothing to do without graphs."""
    if enabled(config):
        hardware.seed_model_parallel(config.training.seed, cuda_graph_safe=True,
                                     te_rng_tracker=uses_te_rng_tracker(config))


def attention_patterns(config: Any) -> tuple[bool, ...]:
    """The ``causal`` values the run's phases train with (``Objective.causal``), causal first."""
    return tuple(sorted({phase.objective.causal for phase in config.resolved_phases}, reverse=True))


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``TransformerLayer`` s of this pipeline stage, under DDP / Float16Module wrappers."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


class LayerGraphs:
    """The layer graphs of one engine: captured by ``capture`` on the first training step,
    bypassed by ``eager``, deleted by ``close`` (module docstring)."""

    def __init__(self, model: torch.nn.Module, *, patterns: Sequence[bool], bf16_autocast: bool):
        self.model = model
        self.patterns = tuple(patterns)
        self.bf16_autocast = bf16_autocast
        self.captured = False
        self.closed = False
        layers = _decoder_layers(model)
        missing = [layer.layer_number for layer in layers if not hasattr(layer, "cudagraph_manager")]
        if not layers or missing:
            raise RuntimeError("training.cuda_graphs: megatron, but the model's layers have no CudaGraphManager "
                               f"(layers {missing}): build the model with the engine's transformer overrides "
                               "(megatron_transformer_overrides) after cuda_graphs.prepare_rng")

    def priming_micro_batches(self, micro_batches: Sequence[Any]) -> list[Any]:
        """The step's first micro-batch once per attention pattern of the run (same shapes, same
        position ids as every micro-batch of the run: only the pattern differs)."""
        first = micro_batches[0]
        return [dataclasses.replace(first, objective=dataclasses.replace(first.objective, causal=causal))
                for causal in self.patterns]

    def capture(self, run_forward_backward: Callable[[list[Any]], object], micro_batches: Sequence[Any]) -> None:
        """Record and capture every layer's graphs: ``run_forward_backward`` runs Megatron's
        schedule (which captures at its end) over the priming micro-batches; the caller discards
        the gradients it leaves. Raises if Megatron did not capture one graph pair per layer and
        pattern."""
        from megatron.core.transformer import cuda_graphs as megatron_graphs

        if megatron_graphs._CudagraphGlobalRecord.cudagraph_created:
            raise RuntimeError("CUDA graphs of another model are alive in this process; close its engine first")
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if self.bf16_autocast
                    else contextlib.nullcontext())
        with autocast:
            run_forward_backward(self.priming_micro_batches(micro_batches))
        if not megatron_graphs._CudagraphGlobalRecord.cudagraph_created:
            raise RuntimeError("Megatron's schedule returned without capturing the layer graphs "
                               "(create_cudagraphs found nothing recorded)")
        for layer in _decoder_layers(self.model):
            runners = layer.cudagraph_manager.cudagraph_runners
            if len(runners) != len(self.patterns) or not all(r.fwd_graph is not None and r.bwd_graph is not None
                                                             for r in runners):
                raise RuntimeError(f"layer {layer.layer_number}: {len(runners)} graph runner(s) captured for "
                                   f"{len(self.patterns)} attention pattern(s); a layer argument other than the "
                                   "pattern differs between calls, which graphs cannot replay")
        self.captured = True

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """The layers run eagerly inside (validation): their graph managers are detached, so a
        call of another shape or pattern than the captured ones runs as without graphs."""
        layers = _decoder_layers(self.model)
        managers = [layer._modules.pop("cudagraph_manager") for layer in layers]
        try:
            yield
        finally:
            for layer, manager in zip(layers, managers):
                layer._modules["cudagraph_manager"] = manager

    def close(self) -> None:
        """Delete the graphs and Megatron's global graph state (its pool, its record, the
        saved-tensor observer) and return to the default stream (Megatron's managers move the
        process to a side stream until the capture). Idempotent."""
        if self.closed:
            return
        self.closed = True
        from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

        torch.cuda.synchronize()
        for layer in _decoder_layers(self.model):
            for runner in layer.cudagraph_manager.cudagraph_runners:
                runner.fwd_graph = runner.bwd_graph = None
            layer.cudagraph_manager.cudagraph_runners = []
        delete_cuda_graphs()
        torch.cuda.set_stream(torch.cuda.default_stream())
