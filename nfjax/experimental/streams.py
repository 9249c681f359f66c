"""EXPERIMENTAL, not part of the engine: a layer schedule's stream k >= 1 steps in GPU stream regions.

A strategy may record a step on stream k (`Strategy.execute(..., stream=k)`, a NanoFlow plan's stream orders);
the engine runs every step on the program's one stream in recorded order. Here such a step instead runs in
a `compute_on("gpu_stream:k")` region. Measured on H100 with jax 0.11.2, two-stream NanoFlow plans ran at
0.77-0.95x Sequential: XLA's scheduler puts a region's done right after its start, so the streams do not
overlap (docs/design.md section 4; scheduling-group annotations around the region reached neither the region's
call-start/done nor the fusions). The overlap the engine uses is a horizontal kernel
(nfjax/schedule/beside.py). Kept for bench/probes/stream_probe.py, bench/probes/stream_schedule.py and
bench/nanoflow.py (`--streams`, the R -> P table).

Cache writers and collectives are never recorded on stream k >= 1 (`nfjax.schedule.graph.OpNode.main_stream_only`),
so every step that reaches a region may run there.

Use: `use_streams(runner)` after building a `Runner` and before `runner.compile_all()`; the variants whose
layer schedule names a stream then compile with regions (and without command buffers: a CUDA graph ran every
region's kernels on one stream, docs/design.md section 4).
"""
from __future__ import annotations

import dataclasses

import jax

from nfjax.compat import NO_COMMAND_BUFFERS, bind_params, compute_on_fn
from nfjax.schedule.api import LayerSchedule, Step
from nfjax.schedule.executor import schedule_layer_fn
from nfjax.schedule.variants import Variant


def on_stream(fn, stream: int):
    """`fn` placed on the extra GPU stream `stream` (>= 1) inside the enclosing jitted program: XLA wraps its
    ops in an async call carrying `_xla_stream_annotation`. Other backends compile the annotation away.

    The region holds primitives only (`inline_calls`): XLA 0.11.2 turns a nested call inside the region (the
    `jit(_pad)` of `jnp.pad`, any non-inlined jit) into a second annotated async call that its stream
    assignment cannot reach, and rejects the program ("No ExecutionStreamId found for call-start ...";
    measured with bench/probes/stream_probe.py).
    """
    return compute_on_fn(f"gpu_stream:{int(stream)}", jax.memory.Space.Device)(inline_calls(fn))


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
            subfuns, params = bind_params(eqn.primitive, eqn.params)
            outs = eqn.primitive.bind(*subfuns, *ins, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs):
            if type(v).__name__ != "DropVar":
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _on_its_stream(step: Step, f):
    return on_stream(f, step.stream) if step.stream else f


def stream_layer_fn(layer_schedule: LayerSchedule):
    """`schedule_layer_fn` with every step recorded on stream k >= 1 in a GPU stream region."""
    return schedule_layer_fn(layer_schedule, wrap_step=_on_its_stream)


def names_streams(layer_schedule: LayerSchedule) -> bool:
    return any(st.stream for st in layer_schedule.steps)


@dataclasses.dataclass(frozen=True)
class StreamVariant(Variant):
    """A variant compiled with stream regions."""

    def layer_fn(self):
        return stream_layer_fn(self.layer_schedule)

    def compiler_options(self) -> dict:
        return {**super().compiler_options(), **NO_COMMAND_BUFFERS}


def use_streams(runner, labels=None) -> list[str]:
    """Before `runner.compile_all()`: the variants labelled in `labels` (None: all) whose layer schedule names a
    stream compile with stream regions. Returns the labels that do."""
    done = set()
    for vs in runner.variants.by_bucket.values():
        for label, v in vs.items():
            if (labels is None or label in labels) and names_streams(v.layer_schedule):
                vs[label] = StreamVariant(**{f.name: getattr(v, f.name) for f in dataclasses.fields(v)})
                done.add(label)
    return sorted(done)
