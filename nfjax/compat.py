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


def on_stream(fn, stream: int):
    """`fn` placed on the extra GPU stream `stream` (>= 1) inside the enclosing jitted program: XLA wraps its
    ops in an async call carrying `_xla_stream_annotation`. Other backends compile the annotation away.

    The region holds primitives only (`inline_calls`): XLA 0.11.2 turns a nested call inside the region (the
    `jit(_pad)` of `jnp.pad`, any non-inlined jit) into a second annotated async call that its stream
    assignment cannot reach, and rejects the program ("No ExecutionStreamId found for call-start ...";
    measured with bench/stream_probe.py). 0.11 names the function form `compute_on(f, compute_type=...,
    out_memory_spaces=...)`; in 0.10 `compute_on` is a context manager and the function form is `compute_on2`.
    """
    from jax.experimental import compute_on as _co
    deco = _co.compute_on if JAX_VERSION >= (0, 11) else _co.compute_on2
    return deco(compute_type=f"gpu_stream:{int(stream)}", out_memory_spaces=jax.memory.Space.Device)(
        inline_calls(fn))


# Call-like primitives whose body `inline_calls` splices into the caller, and the param holding that body.
_CALL_BODIES = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
                "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "checkpoint": "jaxpr",
                "remat": "jaxpr"}


def inline_calls(fn):
    """`fn` traced as primitives only: every nested call (jit, custom_jvp/vjp, checkpoint) has its body
    spliced in. Kernels (`pallas_call`) and control flow stay as they are. Positional array arguments."""
    def run(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _eval_inlined(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    return run


def _eval_inlined(jaxpr, consts, args) -> list:
    env = {}

    def read(v):
        return v.val if type(v).__name__ == "Literal" else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        body = eqn.params.get(_CALL_BODIES.get(eqn.primitive.name, ""))
        if body is not None:
            outs = _eval_inlined(getattr(body, "jaxpr", body), getattr(body, "consts", ()), ins)
        else:
            bound = eqn.primitive.get_bind_params(eqn.params)
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)   # 0.10.2: params only
            outs = eqn.primitive.bind(*subfuns, *ins, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs):
            if type(v).__name__ != "DropVar":
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


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
