"""The few places where jax 0.10.2 (CPU dev/CI, Python 3.11) and jax 0.11.2 (GPU machines, Python 3.12) differ.

Keep every version check here so the rest of the code reads the same under both (the kernels' own live in
pallas_kernels/_compat.py, which imports nothing from nfjax; its helpers are re-exported here).
"""
from __future__ import annotations

import jax

from pallas_kernels._compat import mosaic_gpu_interpret_params, num_sms  # noqa: F401 - the kernels' own, re-exported

JAX_VERSION: tuple[int, ...] = tuple(int(x) for x in jax.__version__.split(".")[:3] if x.isdigit())


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def compute_on_fn(compute_type: str, out_memory_spaces):
    """The function form of `jax.experimental.compute_on` (nfjax/experimental/streams.py): 0.11 names it
    `compute_on(f, compute_type=..., out_memory_spaces=...)`; in 0.10 `compute_on` is a context manager and
    the function form is `compute_on2`."""
    from jax.experimental import compute_on as _co
    deco = _co.compute_on if JAX_VERSION >= (0, 11) else _co.compute_on2
    return deco(compute_type=compute_type, out_memory_spaces=out_memory_spaces)


def bind_params(primitive, params: dict) -> tuple:
    """(subfuns, params) to re-bind a jaxpr equation's primitive: `get_bind_params` returns both in 0.11, the
    params only in 0.10.2."""
    bound = primitive.get_bind_params(params)
    return bound if isinstance(bound, tuple) else ((), bound)


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
# candidate cause of the host waiting in dispatch for the GPU's step time (docs/design.md sections 2-3).
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}


# XLA's rematerialization pass off. Before buffer assignment it counts a donated input and its aliased output apart,
# so a step program that updates the KV pool in place looks twice the pool's size (H200: "only reduced to 247 GiB"
# against a 126 GiB limit) and the pass recomputes what it can, printing a warning for each program. End to end it
# measured neutral (1024/512 bf16 25,673 tok/s off, 25,654 on; docs/design.md section 1); off, the warnings and the
# pass's misread go. A repeated DebugOptions field; a comma list on both versions.
NO_REMAT = {"xla_disable_hlo_passes": "rematerialization"}


def use_compile_cache(folder: str) -> None:
    """JAX's persistent compilation cache in `folder`, for every program however short its compile (the step
    programs of a small model compile in well under the default 1 s threshold). Process-wide."""
    import os
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pinned_host_sharding(sharding):
    """`sharding` in the `pinned_host` memory kind (page-locked host memory: host<->device copies are DMAs at
    the full rate, 8x pageable numpy's on the H100), or None where the backend or this jax has no such memory
    kind. jax 0.10.2's CPU backend has one (tests run the pinned path there); GPUs have it on 0.10 and 0.11."""
    import numpy as np
    try:
        s = sharding.with_memory_kind("pinned_host")
        x = jax.device_put(np.zeros(8, np.uint8), s)
        jax.device_put(x, sharding).block_until_ready()
        return s
    except Exception:  # noqa: BLE001 - no such memory kind here
        return None


def backends_started() -> bool:
    """Whether JAX's backends (the GPU client) exist yet: settings read at their start (XLA_PJRT_* variables)
    no longer apply after."""
    from jax._src import xla_bridge
    return bool(getattr(xla_bridge, "backends_are_initialized", lambda: True)())
