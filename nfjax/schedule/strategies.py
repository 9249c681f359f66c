"""Strategies: schedules over the layer's op graph, all written against the `Strategy` API.

  Sequential        every op once on the whole batch (the plain forward).
  NanoBatchOnly     split, then each op on each nano-batch in turn, nothing overlapped (NanoFlow's overhead
                    baseline: what splitting alone costs).
  CommOverlap       split; a nano-batch's TP collective is issued right after its producer GEMM, before the
                    next nano-batch's GEMM (with async collectives: GEMM1 -> AR1 start -> GEMM2 -> AR1 done).
  DualBatchOverlap  two nano-batches, the second one stage behind (stages end at cache writes and network
                    ops: qkv+rope, attention block, MLP block): nano-batch 1's attention block is issued
                    together with nano-batch 0's MLP block; nano-batch 0 on the main stream, 1 on stream 1.
  FusedReduceNorm   CommOverlap with attn_reduce + ffn_norm replaced by one kernel: reduce-scatter, the
                    model's own ffn_norm op on the local 1/tp of the tokens, one all-gather of (x2, h2).
  NanoFlow(plan)    a plan file: nano-batch sizes per op group, op order per stream, resource share per op
                    (`nfjax.schedule.plan`); streams are interleaved by list scheduling in dependency order.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from nfjax.compat import all_gather_invariant
from nfjax.models.ops import Resource
from nfjax.schedule.api import Kernel, NanoOp, ScheduleContext, ScheduleError, Strategy
from nfjax.schedule.beside import HORIZONTAL_KERNELS


def split_sizes(weights, num_tokens: int, align: int) -> list[int] | None:
    """Cut `num_tokens` in proportion to `weights`, boundaries on multiples of `align`; None if a nano-batch
    would come out empty."""
    weights = [float(w) for w in weights]
    total, cum, bounds = sum(weights), 0.0, [0]
    for w in weights[:-1]:
        cum += w
        bounds.append(int(round(num_tokens * cum / total / align)) * align)
    bounds.append(num_tokens)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    return sizes if all(s > 0 for s in sizes) else None


class Sequential(Strategy):
    kind = name = "sequential"

    def __init__(self, name: str | None = None):
        if name:
            self.name = name

    @classmethod
    def from_config(cls, sc) -> "Sequential":
        return cls(name=sc.label)

    def schedule(self, ctx: ScheduleContext) -> None:
        self.split([ctx.num_tokens])
        for node in ctx.graph:
            self.execute(self.nano_op(node.name, 0))


class _Split(Strategy):
    """Base of the strategies that cut the batch by relative `split` weights (boundaries aligned)."""
    splits = True

    def __init__(self, split=(1, 1), align: int = 8, name: str | None = None):
        if len(split) < 1 or any(w <= 0 for w in split):
            raise ScheduleError(f"split weights must be positive, got {tuple(split)}")
        if align < 1:
            raise ScheduleError(f"align must be >= 1, got {align}")
        self.weights = tuple(split)
        self.align = align
        if name:
            self.name = name

    @classmethod
    def from_config(cls, sc) -> "_Split":
        return cls(sc.split, sc.align, name=sc.label)

    def sizes(self, ctx: ScheduleContext) -> list[int] | None:
        return split_sizes(self.weights, ctx.num_tokens, self.align)

    def eligible(self, ctx: ScheduleContext) -> str | None:
        if self.sizes(ctx) is None:
            return f"split {self.weights} at {self.align}-token alignment leaves an empty nano-batch"
        return None

    def _op_major(self, ctx: ScheduleContext, eager_network: bool, kernels: dict[str, Kernel] | None = None):
        """Each op over all nano-batches, in graph order; optionally issue every ready network op (or fused
        kernel containing one) of a nano-batch as soon as it becomes ready."""
        kernels = kernels or {}
        nbs = self.split(self.sizes(ctx))

        def run(nop: NanoOp):
            k = kernels.get(nop.name)
            if k is None:
                self.execute(nop)
            else:
                self.execute([self.nano_op(n, nop.nb) for n in k.replaces], kernel=k)

        for node in ctx.graph:
            for b in nbs:
                if self.is_done(node.name, b.index):
                    continue
                run(self.nano_op(node.name, b.index))
                while eager_network:
                    net = [o for o in self.get_ready_ops(b.index) if o.node.resource is Resource.NETWORK]
                    if not net:
                        break
                    run(net[0])


class NanoBatchOnly(_Split):
    kind = name = "nanobatch"

    def schedule(self, ctx: ScheduleContext) -> None:
        self._op_major(ctx, eager_network=False)


class CommOverlap(_Split):
    kind = name = "comm_overlap"

    def schedule(self, ctx: ScheduleContext) -> None:
        self._op_major(ctx, eager_network=True)


def _reduce_norm(layer, ctx, o_partial, x):
    """attn_reduce + ffn_norm as one kernel. Under TP: reduce-scatter the row-parallel partial sums over the
    tokens, run the model's own ffn_norm op on this device's 1/tp of the tokens, all-gather (x2, h2) together.
    Without TP, or when the rows do not split evenly, psum then ffn_norm (neither collective with
    `ctx.skip_collectives`, a benchmark-only switch)."""
    from nfjax.models.llama import DecoderLayer, _tp_sum
    norm = DecoderLayer.ffn_norm.__opspec__.fn
    ax = ctx.tp_axis
    t, d = o_partial.shape
    n = 1 if ax is None else lax.axis_size(ax)
    if n == 1 or t % n or ctx.skip_collectives:
        return norm(layer, ctx, x, _tp_sum(o_partial, ctx))
    o = lax.psum_scatter(o_partial, ax, scatter_dimension=0, tiled=True)          # [t / n, d]
    rows = t // n
    xs = lax.dynamic_slice_in_dim(x, lax.axis_index(ax) * rows, rows, axis=0)
    x2, h2 = norm(layer, ctx, xs, o)
    both = all_gather_invariant(jnp.concatenate([x2, h2], axis=-1), ax, axis=0, tiled=True)   # [t, 2d]
    return both[:, :d], both[:, d:]


REDUCE_NORM = Kernel("reduce_norm", replaces=("attn_reduce", "ffn_norm"), ins=("o_partial", "x"),
                     outs=("x2", "h2"), fn=_reduce_norm)


class FusedReduceNorm(_Split):
    kind = name = "fused_reduce_norm"

    def __init__(self, split=(1,), align: int = 8, name: str | None = None):
        super().__init__(split, align, name)
        self.splits = len(self.weights) > 1

    def schedule(self, ctx: ScheduleContext) -> None:
        missing = [n for n in REDUCE_NORM.replaces if n not in ctx.graph]
        if missing:
            raise ScheduleError(f"{self.name}: the layer has no op {missing[0]!r} to fuse")
        self._op_major(ctx, eager_network=True, kernels={n: REDUCE_NORM for n in REDUCE_NORM.replaces})


class DualBatchOverlap(_Split):
    kind = name = "dual_batch"

    def __init__(self, split=(1, 1), align: int = 8, name: str | None = None):
        super().__init__(split, align, name)
        if len(self.weights) != 2:
            raise ScheduleError(f"dual_batch splits into exactly 2 nano-batches, got split {self.weights}")

    def schedule(self, ctx: ScheduleContext) -> None:
        nbs = self.split(self.sizes(ctx))
        stage_of = {op: k for k, st in enumerate(ctx.graph.stages()) for op in st}
        chains = [[self.nano_op(n.name, b.index) for n in ctx.graph] for b in nbs]
        heads = [0, 0]

        def lead_done(stage: int) -> bool:       # nano-batch 0 has finished stage `stage`
            return all(self.is_done(op, 0) for op, k in stage_of.items() if k == stage)

        while heads[0] < len(chains[0]) or heads[1] < len(chains[1]):
            progressed = False
            for i in (0, 1):
                if heads[i] >= len(chains[i]):
                    continue
                nop = chains[i][heads[i]]
                if i == 1 and not lead_done(stage_of[nop.name]):
                    continue                     # nano-batch 1 runs one stage behind nano-batch 0
                if self.is_ready(nop):
                    self.execute(nop, stream=None if nop.node.main_stream_only else i)   # nano-batch 0: stream 0
                    heads[i] += 1
                    progressed = True
            if not progressed:
                raise ScheduleError(f"{self.name}: stuck at {[c[h] for c, h in zip(chains, heads) if h < len(c)]}")


class NanoFlow(Strategy):
    """Runs a `Plan`: the finest common refinement of the groups' nano-batches is the split; a group's
    nano-batch is a merge of the fine ones it spans. Each stream's order is kept; streams are interleaved one
    op per stream per round, an op waiting until its dependencies (possibly on another stream) ran."""
    kind = "nanoflow"
    splits = True

    def __init__(self, plan, name: str | None = None, graph=None):
        """`graph`: the op graph the plan is for (default the Llama layer's)."""
        from nfjax.schedule.graph import layer_graph
        self.flow_plan = plan
        self.dot_merger = plan.xla_dot_merger
        self.name = name or f"nanoflow:{plan.name}"
        plan.validate(graph if graph is not None else layer_graph())

    @classmethod
    def from_config(cls, sc) -> "NanoFlow":
        from nfjax.schedule.plan import load_plan
        return cls(load_plan(sc.plan), name=sc.label)

    def _bounds(self, ctx: ScheduleContext):
        per_group = {}
        for g in self.flow_plan.groups:
            sizes = self.flow_plan.scaled_sizes(g, ctx.num_tokens)
            if sizes is None:
                return None
            b, acc = [0], 0
            for s in sizes:
                acc += s
                b.append(acc)
            per_group[g.name] = b
        return per_group

    def eligible(self, ctx: ScheduleContext) -> str | None:
        if ctx.num_tokens < self.flow_plan.min_bucket:
            return f"plan {self.flow_plan.name!r} is for buckets >= {self.flow_plan.min_bucket}"
        if self.flow_plan.max_bucket and ctx.num_tokens > self.flow_plan.max_bucket:
            return f"plan {self.flow_plan.name!r} is for buckets <= {self.flow_plan.max_bucket}"
        if self._bounds(ctx) is None:
            return f"plan {self.flow_plan.name!r} scaled to {ctx.num_tokens} tokens leaves an empty nano-batch"
        return None

    def schedule(self, ctx: ScheduleContext) -> None:
        per_group = self._bounds(ctx)
        fine = sorted({x for b in per_group.values() for x in b})
        self.split([b - a for a, b in zip(fine, fine[1:])])
        group_of = {op: g for g in self.flow_plan.groups for op in g.ops}

        def nbs_of(op: str, k: int) -> tuple[int, ...]:
            b = per_group[group_of[op].name]
            return tuple(range(fine.index(b[k]), fine.index(b[k + 1])))

        queues = []
        for st in self.flow_plan.streams:
            q = []
            for parts in st.entries():
                if len(parts) > 1:      # "OP:K+OP:K": one horizontal kernel
                    q.append([(op, nbs_of(op, k), st.stream, self.flow_plan.share_of(op, k)) for op, k in parts])
                    continue
                name, k = parts[0]
                ops = self.flow_plan.group(name).ops if self.flow_plan.has_group(name) else (name,)
                for op in sorted(ops, key=lambda o: ctx.graph[o].index):
                    q.append([(op, nbs_of(op, k), st.stream, self.flow_plan.share_of(op, k))])
            queues.append(q)
        heads = [0] * len(queues)
        while any(h < len(q) for h, q in zip(heads, queues)):
            progressed = False
            for s, q in enumerate(queues):
                if heads[s] >= len(q):
                    continue
                item = q[heads[s]]
                per_op = [[self.nano_op(op, i) for i in nbs] for op, nbs, _, _ in item]
                if all(self.is_ready(nops) for nops in per_op):
                    if len(item) == 1:
                        _, _, stream, share = item[0]
                        self.execute(per_op[0], stream=stream or None, share=share)
                    else:
                        kernel = HORIZONTAL_KERNELS[frozenset(op for op, *_ in item)]
                        shares = {op: share for op, _, _, share in item}
                        self.execute([o for nops in per_op for o in nops], kernel=kernel,
                                     shares=[shares[op] for op in kernel.replaces])
                    heads[s] += 1
                    progressed = True
            if not progressed:
                waiting = [f"stream {self.flow_plan.streams[s].stream}: "
                           + " + ".join(f"{op} on nano-batches {list(nbs)}" for op, nbs, _, _ in q[h])
                           for s, (h, q) in enumerate(zip(heads, queues)) if h < len(q)]
                raise ScheduleError(f"{self.name}: the stream orders deadlock; every stream waits: "
                                    + "; ".join(waiting))


# The strategy kinds: `StrategyConfig.kind` -> class (nfjax.config.STRATEGY_KINDS holds the same names, without
# importing the classes; tests/schedule/test_api.py checks that they agree).
STRATEGIES: dict[str, type[Strategy]] = {cls.kind: cls for cls in (Sequential, NanoBatchOnly, CommOverlap,
                                                                    DualBatchOverlap, FusedReduceNorm, NanoFlow)}
