"""A searched structure as a plan in today's format (nfjax/schedule/plan.py), and the plan's modelled time.

The stream order is a list schedule of the nano-ops: each round takes the ready launch (one nano-op, or a pair
whose two parts are each ready) that comes first in layer order, nano-batches in the structure's order. That is
the hand-tuned plans' pattern: the second nano-batch runs ahead to its gate/up, which then runs beside the first
nano-batch's decode attention. Groups are the runs of consecutive ops with one nano-batching (per nano-batch or
merged); a group's ops that follow one another in the order on one nano-batch are written as "GROUP:K".
"""
from __future__ import annotations

from nfjax.models.ops import GLOBAL_VALUES
from nfjax.schedule.api import ScheduleContext
from nfjax.schedule.plan import OpGroup, Plan, StreamOrder


def _deps(graph, split, k_of, nop):
    op, k = nop
    out = []
    for v, prod in graph[op].deps:
        if prod is None:
            continue
        if v in GLOBAL_VALUES or (prod in split and op not in split):
            out += [(prod, i) for i in range(k_of(prod))]
        elif prod in split:
            out.append((prod, k))
        else:
            out.append((prod, 0))
    return out


def launch_order(graph, s, overlaps) -> list[tuple[tuple[str, int], ...]]:
    """The structure's launches in stream order: tuples of (op, nano-batch) (two for a pair; merged ops: 0)."""
    k_of = lambda op: s.k if op in s.split else 1                          # noqa: E731
    by = {o.name: o for o in overlaps}
    pairs = [((by[n].a, i), (by[n].b, j)) for n, i, j in s.pairs]
    in_pair = {x for p in pairs for x in p}
    items = [(x,) for op in graph.names for x in ((op, i) for i in range(k_of(op))) if x not in in_pair] + pairs
    rank = {k: r for r, k in enumerate(s.order)}
    key = lambda it: min((graph[op].index, rank.get(k, 0)) for op, k in it)  # noqa: E731
    done, out = set(), []
    while items:
        ready = [it for it in items if all(d in done for x in it for d in _deps(graph, s.split, k_of, x))]
        if not ready:
            raise ValueError(f"structure {s}: no launch is ready after {out}")
        it = min(ready, key=key)
        items.remove(it)
        out.append(it)
        done |= set(it)
    return out


def to_plan(graph, s, overlaps, shares: dict, *, name: str, align: int, model: str = "", device: str = "",
            tp: int = 1, min_decode: int = 0, source: str = "", description: str = "") -> Plan:
    """`shares`: (overlap name, i, j) -> (share of a, share of b); only a's is written (the kernel gives b the
    rest of the GPU)."""
    T = s.bounds[-1]
    sizes = [b - a for a, b in s.ranges()]
    groups, cur = [], []
    for op in graph.names:
        if cur and (op in s.split) != (cur[-1] in s.split):
            groups.append(cur)
            cur = []
        cur.append(op)
    groups.append(cur)
    gname = {op: f"g{i}_{g[0]}" for i, g in enumerate(groups) for op in g}
    members = {gname[g[0]]: g for g in groups}
    order = launch_order(graph, s, overlaps)
    entries, i = [], 0
    while i < len(order):
        it = order[i]
        if len(it) > 1:
            entries.append("+".join(f"{op}:{k}" for op, k in it))
            i += 1
            continue
        op, k = it[0]
        g = members[gname[op]]
        run = [x for x in order[i:i + len(g)] if len(x) == 1]
        if op == g[0] and len(g) > 1 and [x[0] for x in run] == [(o, k) for o in g]:
            entries.append(f"{gname[op]}:{k}")
            i += len(g)
        else:
            entries.append(f"{op}:{k}")
            i += 1
    by = {o.name: o for o in overlaps}
    share = {f"{by[n].a}:{i}": float(shares[(n, i, j)][0]) for n, i, j in s.pairs if (n, i, j) in shares}
    plan = Plan(name=name, bucket=T, min_bucket=T, max_bucket=T, min_decode=min_decode, align=align,
                groups=tuple(OpGroup(gname[g[0]], tuple(g), tuple(sizes) if g[0] in s.split else (T,))
                             for g in groups),
                streams=(StreamOrder(0, tuple(entries)),), share=share, model=model, device=device, tp=tp,
                source=source, description=description)
    plan.validate(graph, where=name)
    return plan


def record(plan: Plan, graph):
    """The plan recorded at its own bucket (validated by the scheduling API: dependencies, every op once)."""
    from nfjax.schedule.strategies import NanoFlow
    return NanoFlow(plan, graph=graph).record(ScheduleContext(plan.bucket, graph))


def schedule_ms(layer_schedule, model, carry: str = "x") -> float:
    """A recorded layer schedule's time under the cost model: every launch (a pair at its shares, the second
    part on the rest of the GPU) and every join of pieces a step reads across (`carry`: the residual stream
    value, which arrives in the pieces the previous layer wrote)."""
    T = layer_schedule.num_tokens
    pieces = {}
    x0 = carry
    total = 0.0
    for st in layer_schedule.steps:
        for p in st.pieces:
            for v in p.ins:
                if v in GLOBAL_VALUES:
                    continue
                have = pieces.get(v, list(layer_schedule.carry_ranges) if v == x0 else [(0, T)])
                if not any(a <= p.start and p.stop <= b for a, b in have):
                    total += model.merge_ms(v, p.stop - p.start, p.ops[0])
                elif (p.start, p.stop) not in have:          # rows of a larger piece
                    total += model.slice_ms(v, p.stop - p.start, p.ops[0])
        if st.parts:
            a, b = st.parts
            sa = a.share if a.share is not None else 1.0
            sb = b.share if b.share is not None else max(0.0, 1.0 - sa) if a.share is not None else 1.0
            total += model.pair_ms(a.ops[0], (a.start, a.stop), b.ops[0], (b.start, b.stop), (sa, sb))
        else:
            total += sum(model.op_ms(op, st.start, st.stop, st.share or 1.0) for op in st.ops)
        for p in st.pieces:
            for v in p.outs:
                pieces.setdefault(v, []).append((p.start, p.stop))
    return total
