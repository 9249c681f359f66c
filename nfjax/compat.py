"""The few places where jax 0.10.2 (CPU dev/CI, Python 3.11) and jax 0.11.2 (GPU machines, Python 3.12) differ.

Keep every version check here so the rest of the code reads the same under both.
"""
from __future__ import annotations

import jax

JAX_VERSION: tuple[int, ...] = tuple(int(x) for x in jax.__version__.split(".")[:3] if x.isdigit())


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def mosaic_gpu_interpret_params(**kw):
    """`InterpretGPUParams` for running Pallas Mosaic GPU kernels on CPU (interpret mode).

    0.11 exports it as `jax.experimental.pallas.mosaic_gpu.InterpretGPUParams`; 0.10.2 has the same class
    only under `jax._src` (interpret mode itself works there).
    """
    try:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
    except ImportError:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(**kw)


# Known gap: the 0.10.2 GPU interpreter cannot run wgmma on a transposed shared-memory operand (q @ k.T) nor
# with the left operand in registers (p @ v), and has no CPU rule for layout casts. Kernels therefore use
# plain jnp matmuls on loaded SMEM tiles and no layout hints when interpreting (pallas_kernels/_mgpu.py).


def num_sms(default: int = 132) -> int:
    """Streaming multiprocessors of the first GPU (the natural program count of a persistent kernel)."""
    try:
        d = jax.devices()[0]
        n = getattr(d, "core_count", None)
        return int(n) if n else default
    except Exception:   # noqa: BLE001 - no device / attribute: fall back
        return default


def on_stream(fn, stream: int):
    """`fn` placed on the extra GPU stream `stream` (>= 1) inside the enclosing jitted program: XLA wraps its
    ops in an async call carrying `_xla_stream_annotation`. Other backends compile the annotation away.

    0.11 names the function form `compute_on(f, compute_type=..., out_memory_spaces=...)`; in 0.10 `compute_on`
    is a context manager and the same function form is `compute_on2`.
    """
    from jax.experimental import compute_on as _co
    deco = _co.compute_on if JAX_VERSION >= (0, 11) else _co.compute_on2
    return deco(compute_type=f"gpu_stream:{int(stream)}", out_memory_spaces=jax.memory.Space.Device)(fn)


# XLA's dot merger fuses the GEMMs of sibling nano-batches back into one (undoing a split); split schedules
# compile with it off. A DebugOptions field: accepted per compile on both versions and ignored off GPU.
NO_DOT_MERGER = {"xla_gpu_dot_merger_threshold_mb": 0}


def all_gather_invariant(x, axis_name, *, axis: int = 0, tiled: bool = False):
    """All-gather whose result is typed invariant over `axis_name` inside shard_map (plain `all_gather` is typed
    varying, which a scan carry or a replicated out_spec rejects). Public in newer jax; 0.10.2 has it only
    under `jax._src`."""
    fn = getattr(jax.lax, "all_gather_invariant", None)
    if fn is None:
        from jax._src.lax.parallel import all_gather_invariant as fn
    return fn(x, axis_name, axis=axis, tiled=tiled)


# XLA's CUDA-graph command buffers off: the empty list of command types. A DebugOptions field as well; the
# candidate cause of the host waiting in dispatch for the GPU's step time (bench/NOTES.md section 3).
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
