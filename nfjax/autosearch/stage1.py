"""Stage I (NanoFlow section 3.3.1): nano-batch count and sizes, which ops run per nano-batch, which nano-ops run
side by side, and their order, minimizing one layer's time with every op on the whole GPU and no interference.

The layer runs as one sequence of launches (the engine issues one GPU stream; docs/design.md section 4); two
nano-ops overlap only inside a horizontal kernel (`Overlap`: ops a and b side by side, one launch). So a layer's
time is the sum of its launches: a merged op (all T tokens once), an op per nano-batch, a pair (stage I: the
slower of its two parts), plus the joins of split values that a merged op reads.

The MILP for K nano-batches (K = 1 is Sequential and needs no solve):
  * z[k][a,b] = 1: nano-batch k is the tokens [a, b), boundaries on multiples of `grid` (a path 0 -> T of K arcs);
  * m[op] = 1: op runs per nano-batch (0: merged); ops in one `ties` set share m;
  * p[o,i,j] = 1: overlap o runs a@i beside b@j. If b depends on a, i != j, the ops on every a -> b path run per
    nano-batch, and nano-batch j's a runs before nano-batch i's (order binaries r[i][j], antisymmetric and
    transitive, so the pairs admit an order); each nano-op is in at most one pair;
  * e[op][k] >= cost(op, arc of k) - U (1 - m[op]) - U paired(op, k)   (a split nano-op outside any pair);
    P[o,i,j] >= cost(a, arc i) - U (1 - p), P >= cost(b, arc j) - U (1 - p)   (the pair: max of its parts);
    u[edge] >= m[producer] - m[consumer]  (a merged reader joins the producer's pieces);
    w[edge] >= m[consumer] - m[producer]  (a split GEMM copies its rows of a merged producer's value);
  * minimize  sum (1 - m) merged cost + sum e + sum P + sum u join cost + sum w slice cost.
`solve_stage1` returns the best structures for K, each new one excluded from the next solve by a cut on its
(m, p) pattern, so every candidate differs in which ops split or pair (the search ranks them after stage II).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from nfjax.autosearch import milp


@dataclass(frozen=True)
class Overlap:
    name: str                        # the horizontal kernel
    a: str
    b: str
    path: tuple[str, ...]            # ops that must run per nano-batch for the pair (a, b and those between)
    dependent: bool                  # b depends on a (then a@i beside b@j needs i != j and j's a first)
    min_tokens_b: int = 0            # smallest nano-batch b takes in the kernel (its tile)


@dataclass
class Problem:
    ops: tuple[str, ...]                                  # in layer order
    tokens: int
    grid: int                                             # nano-batch boundaries on multiples of this
    cost: Callable[[str, int, int], float]                # op on tokens [lo, hi), whole GPU
    edges: tuple[tuple[str, str, float], ...] = ()        # (producer, consumer, join cost for a merged consumer)
    overlaps: tuple[Overlap, ...] = ()
    ties: tuple[tuple[str, ...], ...] = ()
    min_overlaps: int = 0                                 # at least this many pairs (0: as the optimum says)
    # overlap name -> (cost of a on [lo, hi), cost of b on [lo, hi), kappa) inside the pair: the pair takes
    # max(a, b) + kappa min(a, b) (kappa: the share of the shorter part the overlap does not hide). Default: `cost`
    # and kappa 0 (stage I's view: each part on the whole GPU, no interference). The search also solves with the
    # parts at a profiled share and its measured kappa, which moves the sizes to where the pair really balances.
    pair_costs: dict = field(default_factory=dict)
    # (producer, consumer, cost): what a consumer run per nano-batch pays to read its rows of a merged producer's
    # value (a GEMM's operand rows are copied; 0 for readers that take them in place)
    slices: tuple[tuple[str, str, float], ...] = ()

    def part_cost(self, o: "Overlap", which: int) -> Callable[[int, int], float]:
        f = self.pair_costs.get(o.name)
        if f is not None:
            return f[which]
        op = o.a if which == 0 else o.b
        return lambda lo, hi: self.cost(op, lo, hi)

    def kappa(self, o: "Overlap") -> float:
        f = self.pair_costs.get(o.name)
        return float(f[2]) if f is not None else 0.0

    def points(self) -> list[int]:
        return list(range(0, self.tokens + 1, self.grid)) + ([self.tokens] if self.tokens % self.grid else [])


@dataclass(frozen=True)
class Structure:
    bounds: tuple[int, ...]                               # (0, b1, ..., T): K nano-batches
    split: frozenset = frozenset()                        # ops run per nano-batch
    pairs: tuple[tuple[str, int, int], ...] = ()          # (overlap name, i, j): a@i beside b@j
    order: tuple[int, ...] = (0,)                         # nano-batch order (a pair's j before its i)
    objective: float = 0.0                                # stage I time (ms)
    status: str = "optimal"

    @property
    def k(self) -> int:
        return len(self.bounds) - 1

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds, self.bounds[1:]))


def stage1_time(pr: Problem, s: Structure, pair_ms: Callable | None = None) -> float:
    """A structure's layer time; `pair_ms((name, i, j), overlap, range_a, range_b)` replaces stage I's
    max(a, b) for each pair."""
    rg = s.ranges()
    over = {o.name: o for o in pr.overlaps}
    paired = {(over[n].a, i) for n, i, _ in s.pairs} | {(over[n].b, j) for n, _, j in s.pairs}
    t = 0.0
    for op in pr.ops:
        if op not in s.split:
            t += pr.cost(op, 0, pr.tokens)
        else:
            t += sum(pr.cost(op, *r) for k, r in enumerate(rg) if (op, k) not in paired)
    for n, i, j in s.pairs:
        o = over[n]
        if pair_ms:
            t += pair_ms((n, i, j), o, rg[i], rg[j])
        else:
            a, b = pr.part_cost(o, 0)(*rg[i]), pr.part_cost(o, 1)(*rg[j])
            t += max(a, b) + pr.kappa(o) * min(a, b)
    t += sum(c for p, q, c in pr.edges if p in s.split and q not in s.split)
    t += sum(c for p, q, c in pr.slices if q in s.split and p not in s.split)
    return t


def sequential(pr: Problem) -> Structure:
    s = Structure((0, pr.tokens))
    return Structure(s.bounds, objective=stage1_time(pr, s))


def solve_stage1(pr: Problem, k: int, top: int = 1, time_limit: float = 30.0) -> tuple[list[Structure], list[str]]:
    """Up to `top` best structures with `k` nano-batches, and notes (time limits, infeasibility)."""
    if k == 1:
        return ([sequential(pr)] if pr.min_overlaps == 0 else []), []
    import pulp
    pts = pr.points()
    if len(pts) - 1 < k:
        return [], [f"K={k}: {pr.tokens} tokens on a {pr.grid}-token grid cannot make {k} nano-batches"]
    T, g = pr.tokens, pr.grid
    prob = pulp.LpProblem("stage1", pulp.LpMinimize)
    arcs = {kk: [(a, b) for a in pts for b in pts if a < b and a >= kk * g and b <= T - (k - 1 - kk) * g]
            for kk in range(k)}
    arcs[0] = [(a, b) for a, b in arcs[0] if a == 0]
    arcs[k - 1] = [(a, b) for a, b in arcs[k - 1] if b == T]
    z = {(kk, a, b): milp.binary(prob, f"z_{kk}_{a}_{b}") for kk in range(k) for a, b in arcs[kk]}
    for kk in range(k):
        prob += pulp.lpSum(z[kk, a, b] for a, b in arcs[kk]) == 1
        if kk:
            for x in pts:
                prob += (pulp.lpSum(z[kk - 1, a, b] for a, b in arcs[kk - 1] if b == x)
                         == pulp.lpSum(z[kk, a, b] for a, b in arcs[kk] if a == x))
    m = {op: milp.binary(prob, f"m_{i}") for i, op in enumerate(pr.ops)}
    for tie in pr.ties:
        for a, b in zip(tie, tie[1:]):
            prob += m[a] == m[b]
    prob += pulp.lpSum(m.values()) >= 1                  # K > 1 with every op merged is Sequential
    cost = {(op, a, b): pr.cost(op, a, b) for op in pr.ops for kk in range(k) for a, b in arcs[kk]}
    big = {op: max(cost[op, a, b] for kk in range(k) for a, b in arcs[kk]) + 1e-6 for op in pr.ops}

    part = {}                        # (op, a, b) -> the least a nano-op of op costs inside any pair
    for o in pr.overlaps:            # (a pair takes max(x, y) + kappa min(x, y) >= (1 + min(kappa, 0)) x)
        low = 1.0 + min(pr.kappa(o), 0.0)
        for w, op in ((0, o.a), (1, o.b)):
            f = pr.part_cost(o, w)
            for kk in range(k):
                for a, b in arcs[kk]:
                    part[op, a, b] = min(part.get((op, a, b), float("inf")), low * f(a, b))

    def lower(op, a, b):
        c = cost[op, a, b] if (op, a, b) in cost else pr.cost(op, a, b)
        return min(c, part.get((op, a, b), c))
    cheapest = {op: _cheapest_split(pts, k, lambda a, b, op=op: lower(op, a, b)) for op in pr.ops}

    def arc_cost(op, kk):
        return pulp.lpSum(cost[op, a, b] * z[kk, a, b] for a, b in arcs[kk])

    p, paired = {}, {}
    for oi, o in enumerate(pr.overlaps):
        for i, j in itertools.product(range(k), repeat=2):
            if o.dependent and i == j:
                continue
            v = p[o.name, i, j] = milp.binary(prob, f"p_{oi}_{i}_{j}")
            paired.setdefault((o.a, i), []).append(v)
            paired.setdefault((o.b, j), []).append(v)
            for op in o.path:
                prob += v <= m[op]
            if o.min_tokens_b:
                prob += v <= pulp.lpSum(z[j, a, b] for a, b in arcs[j] if b - a >= o.min_tokens_b)
    for vs in paired.values():
        prob += pulp.lpSum(vs) <= 1
    if pr.min_overlaps:
        prob += pulp.lpSum(p.values()) >= pr.min_overlaps
    r = {(i, j): milp.binary(prob, f"r_{i}_{j}") for i in range(k) for j in range(k) if i != j}
    for i, j in itertools.combinations(range(k), 2):
        prob += r[i, j] + r[j, i] == 1
    for i, j, l in itertools.permutations(range(k), 3):
        prob += r[i, j] + r[j, l] + r[l, i] <= 2
    by_name = {o.name: o for o in pr.overlaps}
    for (n, i, j), v in p.items():
        if by_name[n].dependent:
            prob += v <= r[j, i]
    obj, pair_of = [], {}
    for (n, i, j), v in p.items():
        o = by_name[n]
        pv = milp.var(prob, f"P_{pr.overlaps.index(o)}_{i}_{j}", 0)
        parts, ub = [], 1e-6
        for w, kk in ((0, i), (1, j)):
            f = pr.part_cost(o, w)
            ub += max(f(a, b) for a, b in arcs[kk])
            parts.append(pulp.lpSum(f(a, b) * z[kk, a, b] for a, b in arcs[kk]))
        kap = pr.kappa(o)     # max(x, y) + kappa min(x, y) = max(x + kappa y, y + kappa x) for kappa <= 1
        big_p = ub * (1 + max(kap, 0.0))                    # each side's most (kappa < 0: at most ub)
        prob += pv >= parts[0] + kap * parts[1] - big_p * (1 - v)
        prob += pv >= parts[1] + kap * parts[0] - big_p * (1 - v)
        pair_of.setdefault(o.a, []).append(pv)
        pair_of.setdefault(o.b, []).append(pv)
        obj.append(pv)
    for op in pr.ops:
        obj.append((1 - m[op]) * pr.cost(op, 0, T))
        es = []
        for kk in range(k):
            e = milp.var(prob, f"e_{pr.ops.index(op)}_{kk}", 0)
            prob += e >= arc_cost(op, kk) - big[op] * (1 - m[op]) - big[op] * pulp.lpSum(paired.get((op, kk), []))
            es.append(e)
        # a valid cut that tightens the relaxation: a split op costs at least its cheapest K-way split (a
        # shortest path of K arcs), each nano-batch either alone (e) or inside its pair (P >= its part)
        prob += pulp.lpSum(es) + pulp.lpSum(pair_of.get(op, [])) >= cheapest[op] * m[op]
        obj += es
    for ei, (a, b, c) in enumerate(pr.edges):
        if c > 0:
            u = milp.var(prob, f"u_{ei}", 0)
            prob += u >= m[a] - m[b]
            obj.append(c * u)
    for si, (a, b, c) in enumerate(pr.slices):
        if c > 0:
            w = milp.var(prob, f"w_{si}", 0)
            prob += w >= m[b] - m[a]
            obj.append(c * w)
    prob += pulp.lpSum(obj)
    out, notes = [], []
    deadline = time.perf_counter() + time_limit
    for _ in range(top):
        left = deadline - time.perf_counter()
        if left <= 0.5:
            notes.append(f"K={k}: time limit reached after {len(out)} structure(s)")
            break
        res = milp.solve(prob, left)
        if res.status == "none":
            if not out:
                notes.append(f"K={k}: no feasible structure ({res.solver}, {res.seconds:.1f} s)")
            break
        if res.status == "incumbent":
            notes.append(f"K={k}: {res.solver} stopped at the time limit; using its best incumbent")
        s = _read(pr, k, arcs, z, m, p, r, res.status)
        out.append(s)
        ones = [m[op] for op in pr.ops if op in s.split] + [p[key] for key in s.pairs]
        zeros = [m[op] for op in pr.ops if op not in s.split] + [v for key, v in p.items() if key not in s.pairs]
        prob += pulp.lpSum(1 - v for v in ones) + pulp.lpSum(zeros) >= 1
    return out, notes


def _cheapest_split(pts, k: int, c) -> float:
    """The least total cost of k consecutive ranges from pts[0] to pts[-1] (boundaries in pts)."""
    best = {pts[0]: 0.0}
    for _ in range(k):
        nxt = {}
        for a, ca in best.items():
            for b in pts:
                if b > a and ca + c(a, b) < nxt.get(b, float("inf")):
                    nxt[b] = ca + c(a, b)
        best = nxt
    return best.get(pts[-1], 0.0)


def _read(pr: Problem, k, arcs, z, m, p, r, status: str) -> Structure:
    bounds = [0]
    for kk in range(k):
        a, b = next((a, b) for a, b in arcs[kk] if milp.on(z[kk, a, b]))
        bounds.append(b)
    split = frozenset(op for op in pr.ops if milp.on(m[op]))
    pairs = tuple(sorted(key for key, v in p.items() if milp.on(v)))
    before = {i: sum(1 for j in range(k) if j != i and milp.on(r[j, i])) for i in range(k)}
    order = tuple(sorted(range(k), key=lambda i: before[i]))
    s = Structure(tuple(bounds), split, pairs, order, 0.0, status)
    return Structure(s.bounds, s.split, s.pairs, s.order, stage1_time(pr, s), status)
