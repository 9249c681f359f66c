"""Executor: traces a `LayerSchedule` into the layer body, so a whole step (all nano-ops of every layer) is one program.

`schedule_layer_fn(program)` returns the `layer_fn(layer, ctx, env) -> env` hook of `LlamaModel.__call__`; the
runner jits one step per (token bucket, strategy) with it. Per step of the program, in program order:
  * inputs: a value produced in one piece covering the step's tokens is used as is (or statically sliced);
    a read spanning several pieces (a merge; `program.buffered` names these values) joins them (below);
  * the op (or fused kernel) runs with a per-nano-batch context: attention metadata rebased to the
    nano-batch's tokens (`meta.nano_metadata`), `num_ctas` from the step's resource share;
  * the KV cache is threaded through the steps that write it (in-place scatters; the graph's dependency
    rule puts every read after all of the layer's writes, so XLA never has to copy the cache);
  * with streams on, a step of plan stream k >= 1 runs in a `compat.on_stream` region (compute_on
    "gpu_stream:k"; `gpu_stream`), except cache writers and collectives; stream 0 is the program's own.
    XLA's scheduler puts a region's done right after its start. The region and the main-stream steps the plan
    runs beside it (those after it in program order, up to the first reader of its outputs) therefore share an
    XLA scheduling group (`_scheduling_group_id`), which asks XLA to keep that work between start and done.
    Measured on jax 0.11.2, it does not: the attribute reaches neither the region's call-start/done nor the
    fusions (bench/NOTES.md section 6). The mechanism that does overlap is a horizontal kernel: a step with
    `parts`, whose kernel runs ops of different nano-batches side by side in one launch;

Merges. The pieces of a merged read are joined by one `concatenate` of complete, never-rewritten pieces, which
XLA fuses with the pieces' producers (each producer writes its rows of the merged buffer) or into the consumer
(which reads the pieces where they are); it never needs a `copy`. Chaining in-place dynamic_update_slices into
a preallocated buffer looks cheaper but is fragile: XLA (CPU, 0.10.2) fused the last update into a consumer's
reshape and then copied the partly built buffer, and rewrote slices of the finished buffer into slices of an
earlier version, which forces a copy before the next in-place write. The residual stream crosses layers in the
pieces the program writes it in (`schedule_layer_fn`), so no merge (and no copy into the loop carry) is needed
between layers. Tests assert on the optimized HLO that no `copy` has the shape of a merged buffer, a carried
piece or the KV cache. What a merge still costs: when a producer cannot fuse (a GEMM), the concatenate moves
its piece once; a GEMM kernel that writes its tile at an output offset removes that on GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools

import jax
import jax.numpy as jnp
from jax import lax

from jax.experimental.xla_metadata import set_xla_metadata

from nfjax.compat import num_sms, on_gpu, on_stream
from nfjax.models.ops import GLOBAL_VALUES, Resource
from nfjax.schedule.api import LayerSchedule, Step
from nfjax.schedule.meta import nano_metadata


class _Values:
    """The env of one layer under a program: every value as the pieces its steps wrote (token ranges)."""

    def __init__(self, program: LayerSchedule, env: dict):
        self.t = program.num_tokens
        self.pieces: dict[str, list[tuple[int, int, jax.Array]]] = {}
        self.globals = {k: v for k, v in env.items() if k in GLOBAL_VALUES}
        self.merged: list[tuple[str, int, int, tuple[int, ...]]] = []      # (value, lo, hi, shape), traced
        for k, v in env.items():
            if k in GLOBAL_VALUES:
                continue
            if isinstance(v, (tuple, list)):        # the residual stream carried in nano-batch pieces
                self.pieces[k] = [(a, b, x) for (a, b), x in zip(program.carry_ranges, v)]
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
                                 f"[{lo}, {hi}) (planner bug)")
        out = join_pieces([arr for _, _, arr in parts])
        self.merged.append((name, lo, hi, tuple(out.shape)))
        return out

    def write(self, name: str, lo: int, hi: int, arr) -> None:
        if name in GLOBAL_VALUES:
            self.globals[name] = arr
        else:
            self.pieces.setdefault(name, []).append((lo, hi, arr))


class _OverlapGroups:
    """Scheduling groups of one layer: a stream region opens a group; main-stream steps join the open group
    until one reads the region's outputs on its tokens (or the next region opens). Ids come from `ids` (unique
    per module)."""

    def __init__(self, ids):
        self.ids, self.open, self.outs, self.span = ids, None, set(), (0, 0)

    def enter(self, step: Step, region: bool) -> int | None:
        reads = self.outs.intersection(step.ins) and step.start < self.span[1] and self.span[0] < step.stop
        if self.open is not None and (region or reads):
            self.open, self.outs = None, set()
        if region:
            self.open, self.outs, self.span = next(self.ids), set(step.outs), (step.start, step.stop)
        return self.open


def _group_scope(gid: int | None):
    return set_xla_metadata(_scheduling_group_id=str(gid)) if gid is not None else contextlib.nullcontext()


def run_layer_schedule(program: LayerSchedule, layer, ctx, env: dict, streams: bool = False, trace: list | None = None,
                group_ids=None) -> dict:
    """One layer under `program`. `trace`, if given, receives the (value, lo, hi, shape) of every merge;
    `group_ids`: the scheduling-group id source shared by all layers of a step (streams only)."""
    vals = _Values(program, env)
    groups = _OverlapGroups(group_ids or itertools.count()) if streams else None
    metas: dict[tuple[int, int], object] = {}
    sms = num_sms() if on_gpu() else 0

    def step_ctx(step: Step):
        key = (step.start, step.stop)
        if key not in metas:
            metas[key] = nano_metadata(ctx.meta, *key) if ctx.meta is not None else None
        sctx = dataclasses.replace(ctx, meta=metas[key])
        if step.share is not None and sms:
            sctx = dataclasses.replace(sctx, num_ctas=max(1, round(step.share * sms)))
        return sctx

    for step in program.steps:
        k = gpu_stream(step) if streams else None
        gid = groups.enter(step, k is not None) if groups else None
        with jax.named_scope(f"{step.kernel or step.ops[0]}@{','.join(map(str, step.nbs))}"), _group_scope(gid):
            if step.parts:                              # horizontal kernel: each part its own tokens and ctx
                ins = [[vals.read(v, p.start, p.stop) for v in p.ins] for p in step.parts]
                outs = step.fn(layer, [step_ctx(p) for p in step.parts], ins, step.parts)
            else:
                outs = [_call(step, layer, step_ctx(step), [vals.read(v, step.start, step.stop) for v in step.ins],
                              k)]                       # (the scope also names the op in traces)
        for p, part_outs in zip(step.pieces, outs):
            for v, arr in zip(p.outs, part_outs):
                vals.write(v, p.start, p.stop, arr)
    if trace is not None:
        trace.extend(vals.merged)
    out = dict(vals.globals)
    if len(program.carry_ranges) > 1:
        out["out"] = tuple(vals.read("out", a, b) for a, b in program.carry_ranges)
    else:
        out["out"] = vals.read("out", 0, program.num_tokens)
    return out


def join_pieces(parts):
    """Pieces in token order as one array."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _call(step: Step, layer, ctx, ins, stream: int | None) -> tuple:
    def f(*args):
        res = step.fn(layer, ctx, *args)
        return tuple(res) if len(step.outs) > 1 else (res,)

    if stream:
        f = on_stream(f, stream)
    return f(*ins)


def gpu_stream(step: Step) -> int | None:
    """The GPU stream of a step when streams are on: plan stream k >= 1 on GPU stream k, plan stream 0 on the
    program's own (None). Cache writers and collectives stay on the main stream."""
    if any(v in GLOBAL_VALUES for v in step.outs) or step.resource is Resource.NETWORK:
        return None
    return step.stream or None


def schedule_layer_fn(program: LayerSchedule, streams: bool = False):
    """The `layer_fn` hook running `program` on every layer; `streams`: put its steps in stream regions
    (decided by `Variant.streams`, which turns them off for a program that names no stream).

    When the program writes the layer output in several pieces, the residual stream crosses layers as those
    pieces (`split_carry` before the layer loop, `join_carry` after it, both read by `LlamaModel`): the next
    layer's nano-batches read their own piece, and the only join is one after the last layer."""
    merges: list = []
    group_ids = itertools.count()

    def layer_fn(layer, ctx, env):
        return run_layer_schedule(program, layer, ctx, env, streams, merges, group_ids)
    layer_fn.program = program
    layer_fn.merges = merges            # filled while tracing: what the HLO checks look for
    if len(program.carry_ranges) > 1:
        layer_fn.split_carry = lambda x: tuple(lax.slice_in_dim(x, a, b, axis=0) for a, b in program.carry_ranges)
        layer_fn.join_carry = join_pieces
    return layer_fn
