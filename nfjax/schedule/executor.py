"""Executor: traces a `Program` into the layer body, so a whole step (all nano-ops of every layer) is one program.

`program_layer_fn(program)` returns the `layer_fn(layer, ctx, env) -> env` hook of `LlamaModel.__call__`; the
runner jits one step per (token bucket, strategy) with it. Per step of the program, in program order:
  * inputs: a value produced in one piece covering the step's tokens is used as is (or statically sliced);
    a read spanning several pieces (a merge; `program.buffered` names these values) gets them in one buffer;
  * the op (or fused kernel) runs with a per-nano-batch context: attention metadata rebased to the
    nano-batch's tokens (`meta.nano_metadata`), `num_programs` from the step's resource share;
  * merged pieces are written with `lax.dynamic_update_slice` into one buffer (the layer output: into the
    scan carry's own buffer), so a merge is in place: no concatenate, no copy (tests assert it on the
    optimized HLO);
  * the KV cache is threaded through the steps that write it (each write is an in-place scatter);
  * `stream` k >= 1 wraps the call in `compat.on_stream` (compute_on "gpu_stream:k") when streams are on.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from nfjax.compat import num_sms, on_gpu, on_stream
from nfjax.models.ops import GLOBAL_VALUES
from nfjax.schedule.api import Program, Step
from nfjax.schedule.meta import nano_metadata


class _Values:
    """The env of one layer under a program: every value as the pieces its steps wrote (token ranges)."""

    def __init__(self, program: Program, env: dict, output: str = "out", carry: str = "x"):
        self.t = program.num_tokens
        self.pieces: dict[str, list[tuple[int, int, jax.Array]]] = {}
        self.merged: dict[tuple[str, int, int], jax.Array] = {}
        self.globals = {k: v for k, v in env.items() if k in GLOBAL_VALUES}
        self.output, self.carry = output, carry
        self.carry_readers: list = []          # outputs of the steps that read the carry (ordering only)
        for k, v in env.items():
            if k not in GLOBAL_VALUES:
                self.pieces[k] = [(0, self.t, v)]

    def read(self, name: str, lo: int, hi: int):
        if name in GLOBAL_VALUES:
            return self.globals[name]
        for a, b, arr in self.pieces.get(name, ()):
            if a <= lo and hi <= b:
                return arr if (a, b) == (lo, hi) else lax.slice_in_dim(arr, lo - a, hi - a, axis=0)
        key = (name, lo, hi)
        if key not in self.merged:
            self.merged[key] = self._merge(name, lo, hi)
        return self.merged[key]

    def _merge(self, name: str, lo: int, hi: int):
        """Tokens [lo, hi) of a value written in several pieces, as one array: each piece goes into one buffer
        with an in-place dynamic_update_slice (XLA fuses an elementwise producer into it, so the producer
        writes straight into its slice). Only complete ranges are merged and a merged buffer is never written
        again, so no reader can make XLA copy it."""
        parts = sorted((a, b, arr) for a, b, arr in self.pieces.get(name, ()) if lo <= a and b <= hi)
        edges = [lo] + [x for a, b, _ in parts for x in (a, b)] + [hi]
        if not parts or any(edges[i] != edges[i + 1] for i in range(0, len(edges), 2)):
            raise AssertionError(f"value {name!r}: pieces {[(a, b) for a, b, _ in parts]} do not tile "
                                 f"[{lo}, {hi}) (planner bug)")
        shape, dtype = (hi - lo,) + parts[0][2].shape[1:], parts[0][2].dtype
        buf = None
        if (name, lo, hi) == (self.output, 0, self.t):
            # The layer output goes straight into the scan carry's buffer (the loop then needs no copy into its
            # carry). The barrier makes every step that read the carry a data predecessor of these writes, so
            # XLA overwrites the carry in place instead of copying it.
            c = self.pieces[self.carry][0][2] if self.carry in self.pieces else None
            if c is not None and c.shape == shape and c.dtype == dtype:
                buf = lax.optimization_barrier((c, tuple(self.carry_readers)))[0]
        if buf is None:
            buf = jnp.zeros(shape, dtype)
        for a, _, arr in parts:
            buf = lax.dynamic_update_slice_in_dim(buf, arr, a - lo, axis=0)
        return buf

    def write(self, name: str, lo: int, hi: int, arr) -> None:
        if name in GLOBAL_VALUES:
            self.globals[name] = arr
        else:
            self.pieces.setdefault(name, []).append((lo, hi, arr))


def run_program(program: Program, layer, ctx, env: dict, streams: bool = False) -> dict:
    vals = _Values(program, env)
    metas: dict[tuple[int, int], object] = {}
    sms = num_sms() if on_gpu() else 0
    for step in program.steps:
        key = (step.start, step.stop)
        if key not in metas:
            metas[key] = nano_metadata(ctx.meta, *key) if ctx.meta is not None else None
        sctx = dataclasses.replace(ctx, meta=metas[key])
        if step.share is not None and sms:
            sctx = dataclasses.replace(sctx, num_programs=max(1, round(step.share * sms)))
        ins = [vals.read(v, step.start, step.stop) for v in step.ins]
        outs = _call(step, layer, sctx, ins, streams)
        if vals.carry in step.ins:
            vals.carry_readers.extend(o for v, o in zip(step.outs, outs) if v not in GLOBAL_VALUES)
        for v, arr in zip(step.outs, outs):
            vals.write(v, step.start, step.stop, arr)
    out = dict(vals.globals)
    out["out"] = vals.read("out", 0, program.num_tokens)
    return out


def _call(step: Step, layer, ctx, ins, streams: bool) -> tuple:
    def f(*args):
        res = step.fn(layer, ctx, *args)
        return tuple(res) if len(step.outs) > 1 else (res,)

    if streams and step.stream:
        f = on_stream(f, step.stream)
    return f(*ins)


def program_layer_fn(program: Program, streams: bool = False):
    """The `layer_fn` hook running `program` on every layer."""
    def layer_fn(layer, ctx, env):
        return run_program(program, layer, ctx, env, streams)
    layer_fn.program = program
    return layer_fn
