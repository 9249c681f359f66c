"""Executor: traces a `LayerSchedule` into the layer body, so all nano-ops of a layer group run in one program.

`schedule_layer_fn(layer_schedule)` returns the `layer_fn(layer, ctx, env) -> env` hook of `LlamaModel.__call__`;
the runner compiles one layer-group program per (token bucket, strategy) with it. Per step of the layer
schedule, in recorded order:
  * inputs: a value produced in one piece covering the step's tokens is used as is (or statically sliced);
    a read spanning several pieces (a merge; `layer_schedule.buffered` names these values) joins them (below);
  * the op (or fused kernel) runs with a per-nano-batch context: attention metadata rebased to the
    nano-batch's tokens (`meta.nano_metadata`), `num_ctas` from the step's resource share;
  * the KV cache is threaded through the steps that write it (in-place scatters; the graph's dependency
    rule puts every read after all of the layer's writes, so XLA never has to copy the cache);
  * every step runs on the program's one stream, whatever stream the strategy recorded it on (stream regions
    measured slower and live in nfjax/experimental/streams.py, through the `wrap_step` hook). The mechanism
    that does overlap is a horizontal kernel: a step with `parts`, whose kernel runs ops of different
    nano-batches side by side in one launch (nfjax/schedule/beside.py).

Merges. The pieces of a merged read are joined by one `concatenate` of complete, never-rewritten pieces, which
XLA fuses with the pieces' producers (each producer writes its rows of the merged buffer) or into the consumer
(which reads the pieces where they are); it never needs a `copy`. Chaining in-place dynamic_update_slices into
a preallocated buffer looks cheaper but is fragile: XLA (CPU, 0.10.2) fused the last update into a consumer's
reshape and then copied the partly built buffer, and rewrote slices of the finished buffer into slices of an
earlier version, which forces a copy before the next in-place write. The residual stream crosses layers in the
pieces the layer schedule writes it in (`schedule_layer_fn`), so no merge (and no copy into the loop carry) is
needed between layers. Tests assert on the optimized HLO that no `copy` has the shape of a merged buffer, a carried
piece or the KV cache. What a merge still costs: when a producer cannot fuse (a GEMM), the concatenate moves
its piece once; a GEMM kernel that writes its tile at an output offset removes that on GPU.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from nfjax.compat import num_sms, on_gpu
from nfjax.models.ops import GLOBAL_VALUES
from nfjax.schedule.api import LayerSchedule, Step
from nfjax.schedule.meta import nano_metadata


class _Values:
    """The env of one layer under a layer schedule: every value as the pieces its steps wrote (token ranges)."""

    def __init__(self, layer_schedule: LayerSchedule, env: dict):
        self.t = layer_schedule.num_tokens
        self.pieces: dict[str, list[tuple[int, int, jax.Array]]] = {}
        self.globals = {k: v for k, v in env.items() if k in GLOBAL_VALUES}
        self.merged: list[tuple[str, int, int, tuple[int, ...]]] = []      # (value, lo, hi, shape), traced
        for k, v in env.items():
            if k in GLOBAL_VALUES:
                continue
            if isinstance(v, (tuple, list)):        # the residual stream carried in nano-batch pieces
                self.pieces[k] = [(a, b, x) for (a, b), x in zip(layer_schedule.carry_ranges, v)]
            else:
                self.pieces[k] = [(0, self.t, v)]

    def read(self, name: str, lo: int, hi: int):
        if name in GLOBAL_VALUES:
            return self.globals[name]
        for a, b, arr in self.pieces.get(name, ()):
            if a <= lo and hi <= b:
                return arr if (a, b) == (lo, hi) else lax.slice_in_dim(arr, lo - a, hi - a, axis=0)
        return self._merge(name, lo, hi)

    def _merge(self, name: str, lo: int, hi: int):
        """Tokens [lo, hi) of a value written in several pieces, as one array (see the module docstring)."""
        parts = []
        for a, b, arr in self.pieces.get(name, ()):
            x, y = max(a, lo), min(b, hi)
            if x < y:
                parts.append((x, y, arr if (x, y) == (a, b) else lax.slice_in_dim(arr, x - a, y - a, axis=0)))
        parts.sort(key=lambda p: p[0])
        edges = [lo] + [x for a, b, _ in parts for x in (a, b)] + [hi]
        if not parts or any(edges[i] != edges[i + 1] for i in range(0, len(edges), 2)):
            raise AssertionError(f"value {name!r}: pieces {[(a, b) for a, b, _ in parts]} do not tile "
                                 f"[{lo}, {hi}) (a bug in Strategy.record)")
        out = join_pieces([arr for _, _, arr in parts])
        self.merged.append((name, lo, hi, tuple(out.shape)))
        return out

    def write(self, name: str, lo: int, hi: int, arr) -> None:
        if name in GLOBAL_VALUES:
            self.globals[name] = arr
        else:
            self.pieces.setdefault(name, []).append((lo, hi, arr))


def run_layer_schedule(layer_schedule: LayerSchedule, layer, ctx, env: dict, trace: list | None = None,
                       wrap_step=None) -> dict:
    """One layer under `layer_schedule`. `trace`, if given, receives the (value, lo, hi, shape) of every merge;
    `wrap_step(step, f) -> f` may wrap the function of each step without parts (the experimental streams)."""
    vals = _Values(layer_schedule, env)
    metas: dict[tuple[int, int], object] = {}
    sms = num_sms() if on_gpu() else 0

    def step_ctx(step: Step):
        key = (step.start, step.stop)
        if key not in metas:
            metas[key] = nano_metadata(ctx.meta, *key) if ctx.meta is not None else None
        sctx = dataclasses.replace(ctx, meta=metas[key])
        if hasattr(ctx, "step_tokens"):         # a Llama LayerContext: its ops see the whole step's size
            sctx = dataclasses.replace(sctx, step_tokens=layer_schedule.num_tokens)
        if step.share is not None and sms:
            sctx = dataclasses.replace(sctx, num_ctas=max(1, round(step.share * sms)))
        return sctx

    for step in layer_schedule.steps:
        with jax.named_scope(f"{step.kernel or step.ops[0]}@{','.join(map(str, step.nbs))}"):
            if step.parts:                              # horizontal kernel: each part its own tokens and ctx
                ins = [[vals.read(v, p.start, p.stop) for v in p.ins] for p in step.parts]
                outs = step.fn(layer, [step_ctx(p) for p in step.parts], ins, step.parts)
            else:                                       # (the scope also names the op in traces)
                outs = [_call(step, layer, step_ctx(step), [vals.read(v, step.start, step.stop) for v in step.ins],
                              wrap_step)]
        for p, part_outs in zip(step.pieces, outs):
            for v, arr in zip(p.outs, part_outs):
                vals.write(v, p.start, p.stop, arr)
    if trace is not None:
        trace.extend(vals.merged)
    out = dict(vals.globals)
    if len(layer_schedule.carry_ranges) > 1:
        out["out"] = tuple(vals.read("out", a, b) for a, b in layer_schedule.carry_ranges)
    else:
        out["out"] = vals.read("out", 0, layer_schedule.num_tokens)
    return out


def join_pieces(parts):
    """Pieces in token order as one array."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _call(step: Step, layer, ctx, ins, wrap_step) -> tuple:
    def f(*args):
        res = step.fn(layer, ctx, *args)
        return tuple(res) if len(step.outs) > 1 else (res,)

    return (wrap_step(step, f) if wrap_step else f)(*ins)


def schedule_layer_fn(layer_schedule: LayerSchedule, wrap_step=None):
    """The `layer_fn` hook running `layer_schedule` on every layer (`wrap_step`: see `run_layer_schedule`).

    When the layer schedule writes the layer output in several pieces, the residual stream crosses layers as
    those pieces (`split_carry` before the layer loop, `join_carry` after it, both read by the runner and
    `LlamaModel`): the next layer's nano-batches read their own piece, and the only join is one after the last
    layer."""
    merges: list = []

    def layer_fn(layer, ctx, env):
        return run_layer_schedule(layer_schedule, layer, ctx, env, merges, wrap_step)
    layer_fn.layer_schedule = layer_schedule
    layer_fn.merges = merges            # filled while tracing: what the HLO checks look for
    if len(layer_schedule.carry_ranges) > 1:
        ranges = layer_schedule.carry_ranges
        layer_fn.split_carry = lambda x: tuple(lax.slice_in_dim(x, a, b, axis=0) for a, b in ranges)
        layer_fn.join_carry = join_pieces
    return layer_fn
