"""Every CPU-versus-GPU divergence of megatron_ext: what this machine can run (capability probes),
and the choices made for it.

The model, data, objectives and checkpoint format are shared between CPU (development, CI,
demo) and GPU (training). Where Megatron-Core 0.19 cannot run as-is on CPU, the choice is made
here, explicitly, and nowhere else: in this module, or in the two that act on it for the whole
process, ``process_group`` (divergence 1: starting ``torch.distributed`` and Megatron's
model-parallel groups) and ``cuda_on_cpu`` (divergence 7: Megatron's CUDA-only calls redirected).
The platform is "gpu" when ``torch.cuda.is_available()``.

Divergences, and why:

1. Process-group backend: ``gloo`` on CPU, ``nccl`` on GPU (nccl is CUDA-only; ``process_group``).
2. Device: ``cpu``, or ``cuda:<LOCAL_RANK>`` selected with ``torch.cuda.set_device``.
3. Parameter initialisation: ``use_cpu_initialization=True`` on CPU. Megatron's default path
   allocates weights on ``torch.cuda.current_device()`` and initialises them under the CUDA RNG
   tracker (``tensor_parallel/layers.py::_initialize_affine_weight_gpu``). The CPU path builds
   the full master weight from the default generator and keeps this rank's shard, so a seed
   gives the same full weights at every tensor-parallel size.
4. Seeding and dropout RNG: ``model_parallel_cuda_manual_seed`` needs the CUDA RNG tracker
   (``tensor_parallel/random.py``); on CPU only ``torch.manual_seed`` is set, and dropout inside
   tensor-parallel regions draws from the default generator (see ``tensor_parallel_rng``).
5. Model features that cannot run on CPU, refused by ``check_model_parallel_supported``:
   Megatron's all-gather mappings allocate on ``torch.cuda.current_device()``
   (``tensor_parallel/mappings.py::_gather_along_last_dim`` and ``_gather_along_first_dim``),
   so on CPU there is no ``gather_output`` of vocab-parallel logits (use
   ``megatron_ext.model.gather_vocab_parallel_logits``), no sequence parallelism, and no
   tensor-parallel size above the number of KV heads. Transformer Engine is GPU-only.
   Outside the model, see divergence 7.
6. Kernels (``check_run_supported``): FP8 needs Transformer Engine on compute capability >= 8.9;
   activation recomputation checkpoints the CUDA RNG tracker
   (``tensor_parallel/random.py::CheckpointFunction``), so it is GPU-only. Without Transformer
   Engine, ``transformer_impl: te`` falls back to the local spec, announced once; so do
   ``training.rope_fusion`` (TE's kernel) and ``training.gradient_accumulation_fusion`` (GPU;
   with the local spec, apex) turn off (``fusion_fallbacks``). CUDA graphs
   (``training.cuda_graphs``) are CUDA: refused on CPU (``training.cuda_graphs.machine_problem``).
7. Megatron-Core outside the model: its DDP, optimizers, gradient clipping, forward-backward
   schedules (pipeline p2p included) and the distributed-checkpoint save place small tensors
   on CUDA, use CUDA streams and check for ``torch.cuda`` tensor types even when every
   parameter is on the CPU, and pick Transformer Engine's or apex's CUDA kernels whenever they
   import. On CPU, ``process_group.init_process_group_and_model_parallel`` redirects those calls
   to the CPU for the whole process, until ``destroy_process_group_and_model_parallel``, pinned
   to the megatron-core release it was checked against (``cuda_on_cpu``), so the same Megatron
   engine (and the same checkpoint writer) runs on CPU over gloo and on GPU.
8. Asynchronous checkpoint writer (``persistent_checkpoint_writer``): a persistent worker on GPU,
   a process forked per save on CPU (where staging copies nothing).
9. Memory a process may use (``usable_memory_bytes``, checked against
   ``training.memory_fit.estimate_memory`` before a run allocates): the GPU's free memory, or on CPU
   the machine's available memory shared by the processes started on it.

Not a divergence: ``training.deterministic`` (``make_deterministic``) sets the same torch flags on
both; the CUDA libraries' environment it sets matters on GPU only (CPU steps are deterministic
already).

Not divergences: core attention is ``megatron_ext.model.attention.SDPAttention`` on both CPU and
GPU (Megatron's ``DotProductAttention`` needs ``GlobalMemoryBuffer`` and the CUDA RNG tracker);
RoPE is computed by the model from positions on the activations' device (Megatron's
``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from megatron_ext.config_loading import UserError
from megatron_ext.transformer_impl import TransformerImpl

# Megatron-Core is imported inside the functions that use it: reading and checking a recipe
# (``--dry-run``, the memory estimate) imports none of it.


def placement(rank_nodes: list[str]) -> str:
    """Where the run's ranks are (``rank_nodes[r]``: rank r's node), for the log: ``16 ranks on 2 nodes
    (gpu-a01: ranks 0-7, gpu-a02: ranks 8-15); this log is rank 0's``. A multi-node job's merged log
    then says which node each rank, and each line, comes from."""
    spans: dict[str, list[list[int]]] = {}
    for rank, node in enumerate(rank_nodes):
        runs = spans.setdefault(node, [])
        if runs and runs[-1][1] == rank - 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    world = len(rank_nodes)
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    if len(spans) == 1:
        return f"{ranks} on {rank_nodes[0]}"
    where = ", ".join(f"{node}: rank{'s' if rank_nodes.count(node) > 1 else ''} "
                      + ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs) for node, runs in spans.items())
    return f"{ranks} on {len(spans)} nodes ({where}); this log is rank 0's"


def accelerator_summary() -> str:
    """One line on the optional GPU accelerators and what runs without them."""
    import importlib.util

    te = transformer_engine_available()
    apex = importlib.util.find_spec("apex") is not None
    if not on_gpu():
        return "CPU: local SDPA attention, torch AdamW (Transformer Engine and apex are GPU-only)"
    parts = ["Transformer Engine: " + ("available" if te else "NOT installed -> local SDPA attention, torch norms"),
             "apex: " + ("available" if apex else "NOT installed -> torch optimizers")]
    return "; ".join(parts)


FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
"""Transformer Engine's FP8 GEMMs need Ada (8.9), Hopper (9.0) or newer."""


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports: Megatron-Core's own probe, the one that decides
    whether the ``te`` spec's modules exist (``megatron_ext.model.attention``)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return HAVE_TE


def check_run_supported(*, fp8_recipe: str | None, recompute_granularity: str | None,
                        bf16_autocast: bool = False, params_dtype: str = "float32") -> None:
    """Raise ``UserError`` naming the kernel setting this machine cannot run (before any model is
    built). What the config itself rules out (FP8 without the ``te`` backend, graphs with
    recomputation) is refused once, by ``RunConfig``. The run's pre-flight asks this with its other
    machine checks (``training.preflight.check_machine``: CUDA graphs on CPU, NVRx)."""
    if fp8_recipe is not None:
        if not on_gpu():
            raise UserError(f"training.fp8_recipe={fp8_recipe!r}: FP8 needs a CUDA GPU with compute capability "
                            f">= {FP8_MIN_COMPUTE_CAPABILITY[0]}.{FP8_MIN_COMPUTE_CAPABILITY[1]} "
                            "(Ada, Hopper or newer); this machine has none. Remove training.fp8_format")
        capability = torch.cuda.get_device_capability()
        if capability < FP8_MIN_COMPUTE_CAPABILITY:
            raise UserError(f"training.fp8_recipe={fp8_recipe!r}: {torch.cuda.get_device_name()} has compute "
                            f"capability {capability[0]}.{capability[1]}; FP8 needs >= "
                            f"{FP8_MIN_COMPUTE_CAPABILITY[0]}.{FP8_MIN_COMPUTE_CAPABILITY[1]}. Train in bf16 "
                            "(remove training.fp8_format)")
        if not transformer_engine_available():
            raise UserError(f"training.fp8_recipe={fp8_recipe!r} needs Transformer Engine, which does not import "
                            "here; install it (docs/gpu.md) or remove training.fp8_format")
    if recompute_granularity is not None and not on_gpu():
        raise UserError(f"training.recompute_granularity={recompute_granularity!r} runs on CUDA only (Megatron's "
                        "recomputation saves the CUDA RNG state); remove it on CPU")
    if bf16_autocast and params_dtype == "float32" and not on_gpu():
        # Megatron's linear layers compute their backward in a custom autograd function that is
        # autocast-aware on CUDA only: on CPU it multiplies bf16 gradients by fp32 weights and fails.
        raise UserError("training.bf16: true with fp32 parameters (bf16 autocast) runs on CUDA only; on CPU "
                        "train in fp32 (training.bf16: false) or with model.params_dtype: bfloat16")


def transformer_impl_fallback(transformer_impl: TransformerImpl | str) -> tuple[TransformerImpl, str | None]:
    """The layer implementation this machine runs for the requested one, and the warning to print
    once when it differs (``te`` without Transformer Engine or without a GPU -> ``local``)."""
    transformer_impl = TransformerImpl(transformer_impl)
    if not transformer_impl.uses_transformer_engine:
        return transformer_impl, None
    if not on_gpu():
        return TransformerImpl.LOCAL, ("WARNING: model.transformer_impl: te needs a CUDA GPU; this run uses the local spec "
                         "(PyTorch SDPA attention, torch RMSNorm). Checkpoints are interchangeable.")
    if not transformer_engine_available():
        return TransformerImpl.LOCAL, ("WARNING: model.transformer_impl: te but Transformer Engine does not import; this run "
                         "uses the local spec (PyTorch SDPA attention, torch RMSNorm, no fused norm+linear, no "
                         "FP8). Install Transformer Engine for speed (docs/gpu.md). Checkpoints are "
                         "interchangeable.")
    return transformer_impl, None


def megatron_linear_wgrad_fusion_available() -> bool:
    """True when Megatron's own linear layers (``ColumnParallelLinear``/``RowParallelLinear``: the LM
    head, every linear of the local spec) can fuse weight-gradient accumulation: Megatron's probe of
    apex's ``fused_weight_gradient_mlp_cuda`` (``tensor_parallel/layers.py``), without which their
    constructors raise. Transformer Engine's layers need no apex."""
    from megatron.core.tensor_parallel import layers

    return bool(layers._grad_accum_fusion_available)


def fused_rope_available() -> bool:
    """True when Megatron's ``apply_rope_fusion`` has a kernel: Transformer Engine's fused RoPE
    (``models/common/embeddings/rope_utils.py`` imports ``fused_apply_rotary_pos_emb`` from
    Megatron's TE extension; None without TE, and ``TransformerConfig`` then refuses the flag)."""
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb is not None


def fusion_fallbacks(*, rope_fusion: bool, gradient_accumulation_fusion: bool,
                     transformer_impl: TransformerImpl | str,
                     cross_entropy_fusion_impl: str = "native") -> tuple[dict[str, bool | str], list[str]]:
    """The fusion settings this machine runs for the requested ones, and one warning line to print
    once per setting turned off (never turned off silently: the GPU recipes enable them and must
    still run on CPU, in CI and in the demo). ``transformer_impl``: the backend the run uses
    (after ``transformer_impl_fallback``).

    - ``training.rope_fusion``: Transformer Engine's fused RoPE kernel (either spec) on a GPU.
    - ``training.gradient_accumulation_fusion``: writes into Megatron DDP's ``main_grad`` from the
      wgrad GEMM, a GPU kernel; TE's linears need no apex, Megatron's (the local spec's) need
      apex's ``fused_weight_gradient_mlp_cuda``. With the ``te`` spec and no apex only the LM head
      stays unfused (``megatron_ext.model.EncoderModel``), which needs no warning.
    - ``training.cross_entropy_fusion_impl: te``: Transformer Engine's Triton cross entropy, on a
      GPU (either spec); elsewhere Megatron's ``native`` fused one, which runs on any device.
    """
    settings: dict[str, bool | str] = {"rope_fusion": rope_fusion,
                                       "gradient_accumulation_fusion": gradient_accumulation_fusion,
                                       "cross_entropy_fusion_impl": cross_entropy_fusion_impl}
    warnings = []
    if cross_entropy_fusion_impl == "te" and not (on_gpu() and transformer_engine_available()):
        settings["cross_entropy_fusion_impl"] = "native"
        why = "a CUDA GPU" if not on_gpu() else "Transformer Engine, which does not import here"
        warnings.append(f"WARNING: training.cross_entropy_fusion_impl: te needs {why}; this run fuses the cross "
                        "entropy with Megatron's native kernel (same result up to rounding).")
    if rope_fusion and not (on_gpu() and fused_rope_available()):
        settings["rope_fusion"] = False
        why = "a CUDA GPU" if not on_gpu() else "Transformer Engine, which does not import here"
        warnings.append(f"WARNING: training.rope_fusion needs {why}; this run applies RoPE unfused (same result).")
    if gradient_accumulation_fusion:
        if not on_gpu():
            why = "a CUDA GPU"
        elif not TransformerImpl(transformer_impl).uses_transformer_engine and not megatron_linear_wgrad_fusion_available():
            why = ("apex's fused_weight_gradient_mlp_cuda with model.transformer_impl: local (Megatron's linear "
                   "layers), which does not import here")
        else:
            why = None
        if why is not None:
            settings["gradient_accumulation_fusion"] = False
            warnings.append(f"WARNING: training.gradient_accumulation_fusion needs {why}; this run adds weight "
                            "gradients to main_grad unfused (same result).")
    return settings, warnings


def software_versions() -> dict[str, str | None]:
    """Python, torch, CUDA, megatron-core, transformers, Transformer Engine, nvidia-resiliency-ext
    (``checkpoint.async_strategy: nvrx``) and GPU driver versions (None where absent), for benchmark
    and test records."""
    import importlib.metadata
    import platform as host
    import subprocess

    import megatron.core
    import transformers

    info: dict[str, str | None] = {
        "python": host.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "megatron_core": megatron.core.__version__, "transformers": transformers.__version__,
        "transformer_engine": None, "nvidia_resiliency_ext": None, "driver": None,
    }
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        info["nvidia_resiliency_ext"] = importlib.metadata.version("nvidia-resiliency-ext")
    try:
        import transformer_engine

        info["transformer_engine"] = transformer_engine.__version__
    except ImportError:
        pass
    if on_gpu():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, check=True).stdout
            info["driver"] = out.strip().splitlines()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            pass
    return info


DETERMINISTIC_NCCL_ALGORITHMS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
"""``NCCL_ALGO`` values whose all-reduce sums in a fixed order (Megatron-LM's ``--deterministic-mode``
list; NVLS reduces inside the NVSwitch, in no fixed order)."""
DETERMINISTIC_CUBLAS_WORKSPACES = (":4096:8", ":16:8")
"""``CUBLAS_WORKSPACE_CONFIG`` values with which cuBLAS picks the same reduction order every time."""


def make_deterministic() -> None:
    """``training.deterministic``: the same inputs give bit-identical steps, at some speed (GPU).

    For the rest of the process: torch's deterministic algorithms (an op without one raises,
    naming itself), cuDNN deterministic and without autotuning, and, unless set already, the
    environment of CUDA's libraries: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS, read when its
    handle is created: call this before any CUDA work), ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``
    (Transformer Engine's attention picks a deterministic backend, read when TE's attention is
    built; Megatron's ``TransformerConfig.deterministic_mode`` refuses TE attention without it)
    and ``NCCL_ALGO=Ring`` (read when NCCL's communicators are created: call this before the
    process group). Megatron's own half, ``deterministic_mode``, is set with the model's
    ``TransformerConfig`` (``training.megatron_engine.megatron_transformer_overrides``).

    Raises ``UserError`` naming the variable where one is set to a value that is not deterministic.
    """
    wanted = {"CUBLAS_WORKSPACE_CONFIG": DETERMINISTIC_CUBLAS_WORKSPACES, "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",),
              "NCCL_ALGO": DETERMINISTIC_NCCL_ALGORITHMS}
    defaults = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "NCCL_ALGO": "Ring"}
    for name, allowed in wanted.items():
        if name in os.environ and os.environ[name] not in allowed:
            raise UserError(f"training.deterministic: true, but the environment sets {name}={os.environ[name]!r}, "
                            f"which is not deterministic; unset it or set it to one of {', '.join(allowed)}")
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def on_gpu() -> bool:
    """True when this process trains on CUDA devices."""
    return torch.cuda.is_available()


def device_name() -> str | None:
    """The GPU's name (for its peak FLOP/s), or None on CPU."""
    return torch.cuda.get_device_name() if on_gpu() else None


def rng_state() -> dict:
    """Every random generator a training step draws from, for a checkpoint: torch's CPU
    generator and, on GPU, the CUDA generator and Megatron's model-parallel RNG tracker (dropout
    inside tensor-parallel regions), so that a resumed run draws the same dropout masks."""
    state = {"torch_rng_state": torch.get_rng_state()}
    if on_gpu():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
        from megatron.core import tensor_parallel
        # A graph-safe tracker (training.cuda_graphs) holds generators, not state tensors: saved as
        # their state tensors, so checkpoints have one format whatever the tracker.
        state["megatron_rng_tracker_states"] = {
            name: value.get_state() if isinstance(value, torch.Generator) else value
            for name, value in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` recorded (keys a checkpoint lacks are left as they are)."""
    if "torch_rng_state" in state:
        torch.set_rng_state(state["torch_rng_state"])
    if on_gpu():
        if "cuda_rng_state" in state:
            torch.cuda.set_rng_state(state["cuda_rng_state"])
        if "megatron_rng_tracker_states" in state:
            from megatron.core import tensor_parallel
            tracker = tensor_parallel.get_cuda_rng_tracker()
            current = tracker.get_states()
            if any(isinstance(value, torch.Generator) for value in current.values()):
                # Graph-safe tracker: its states are generators; set them from the saved tensors.
                for name, saved in state["megatron_rng_tracker_states"].items():
                    current[name].set_state(saved.get_state() if isinstance(saved, torch.Generator) else saved)
            else:
                tracker.set_states(state["megatron_rng_tracker_states"])


def device() -> torch.device:
    """The device of this process's parameters and activations."""
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")


def usable_memory_bytes() -> tuple[int, str]:
    """Bytes this process may allocate, and where (divergence 9)."""
    if on_gpu():
        free, _ = torch.cuda.mem_get_info()
        return free, f"GPU {torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:  # MemAvailable counts reclaimable page cache; free pages alone would be far too strict
        with open("/proc/meminfo") as meminfo:
            available = 1024 * next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):  # not Linux
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return available // local_processes, f"this machine's memory (shared by {local_processes} process(es))"


def use_cpu_initialization() -> bool:
    """Value for ``TransformerConfig.use_cpu_initialization`` (divergence 3)."""
    return not on_gpu()


def check_model_parallel_supported(
    *, tensor_parallel_size: int, num_query_groups: int, transformer_impl: TransformerImpl | str
) -> None:
    """Raise ``UserError`` for model-parallel features this platform cannot run (divergence 5)."""
    if on_gpu():
        return
    if not TransformerImpl(transformer_impl).runs_on_cpu:
        raise UserError(
            "transformer_impl='te' runs on CUDA only (Transformer Engine); "
            "use transformer_impl='local' on CPU"
        )
    if tensor_parallel_size > num_query_groups:
        raise UserError(
            f"tensor_parallel_size={tensor_parallel_size} exceeds num_query_groups="
            f"{num_query_groups}: Megatron then all-gathers QKV through a CUDA-only mapping; "
            "on CPU use tensor_parallel_size <= num_query_groups"
        )


@contextlib.contextmanager
def tensor_parallel_rng() -> Iterator[None]:
    """RNG context for dropout inside tensor-parallel regions (divergence 4).

    On GPU, Megatron's model-parallel CUDA RNG tracker gives each tensor-parallel rank its own
    dropout stream. On CPU that tracker cannot run; the default generator is used instead, so
    tensor-parallel ranks draw correlated masks (identical seeds). Dropout defaults to 0.
    """
    if on_gpu():
        from megatron.core import tensor_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork():
            yield
    else:
        yield


def persistent_checkpoint_writer() -> bool:
    """Which of Megatron's asynchronous checkpoint writers to use (divergence 8). On GPU, the
    persistent worker process: the save stages every tensor into host memory first (a copy), so
    training may change the parameters while it writes. On CPU that staging is no copy
    (``tensor.to("cpu")`` returns the tensor itself), so a persistent worker would write
    parameters that training is changing; a process forked per save
    (``TemporalAsyncCaller``) writes from its own copy-on-write snapshot of memory."""
    return on_gpu()


def seed_model_parallel(seed: int, *, cuda_graph_safe: bool = False, te_rng_tracker: bool = False) -> None:
    """Seed parameter initialisation and dropout for the current model-parallel layout.

    ``cuda_graph_safe`` (GPU, ``training.cuda_graphs``): Megatron's RNG tracker is created anew,
    graph-safe (``use_cudagraphable_rng``; Transformer Engine's tracker with ``te_rng_tracker``),
    as Megatron-LM's ``_set_random_seed`` does for graphed runs: the layers' graph managers refuse
    any other. Without it, a graph-safe tracker left by an earlier graphed run of this process is
    replaced by the plain one. The same seed draws the same streams either way."""
    if not on_gpu() and cuda_graph_safe:
        raise UserError("training.cuda_graphs: CUDA graphs need a CUDA GPU; this machine has none")
    torch.manual_seed(seed)
    if on_gpu():
        from megatron.core import tensor_parallel
        from megatron.core.tensor_parallel import random as megatron_random
        replace = cuda_graph_safe or megatron_random.is_graph_safe_cuda_rng_tracker(
            megatron_random._CUDA_RNG_STATE_TRACKER)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=te_rng_tracker,
                                                        use_cudagraphable_rng=cuda_graph_safe, force_reset_rng=replace)


def runs_elsewhere(world_size: int) -> str | None:
    """Why this machine does not run a plan of ``world_size`` processes (so its memory, and what its
    mounts lack, say nothing about the plan), or None when it does: on a GPU machine up to one process
    per local GPU; on a machine without GPUs, one process. Several CPU processes only serve tests of
    the parallel layouts (tiny models, where memory is no question), so a dry run for more processes
    on a machine without GPUs is a plan made on a login node for the compute nodes' GPUs: only
    ``--gpu KIND`` knows their memory."""
    if on_gpu():
        local = torch.cuda.device_count()
        return None if world_size <= local else f"{world_size} processes, more than this machine's {local} GPU(s)"
    return None if world_size == 1 else f"{world_size} processes, and this machine has no GPU"
