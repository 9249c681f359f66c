"""Brute-force optima of the two stages, written apart from the MILPs: every structure (nano-batch bounds, split
ops, pairs) and every share combination is enumerated and costed directly."""
import itertools

from nfjax.autosearch.stage1 import Problem

EPS = 1e-9


def _feasible_order(k: int, pairs, overlaps) -> bool:
    """Some order of the nano-batches puts every dependent pair's j before its i."""
    by = {o.name: o for o in overlaps}
    edges = {(j, i) for n, i, j in pairs if by[n].dependent}
    return any(all(perm.index(a) < perm.index(b) for a, b in edges) for perm in itertools.permutations(range(k)))


def time_of(pr: Problem, bounds, split, pairs) -> float:
    rg = list(zip(bounds, bounds[1:]))
    by = {o.name: o for o in pr.overlaps}
    in_pair = {(by[n].a, i) for n, i, _ in pairs} | {(by[n].b, j) for n, _, j in pairs}
    t = 0.0
    for op in pr.ops:
        if op in split:
            t += sum(pr.cost(op, a, b) for kk, (a, b) in enumerate(rg) if (op, kk) not in in_pair)
        else:
            t += pr.cost(op, 0, pr.tokens)
    for n, i, j in pairs:
        o = by[n]
        f = pr.pair_costs.get(n)
        a = f[0](*rg[i]) if f else pr.cost(o.a, *rg[i])
        b = f[1](*rg[j]) if f else pr.cost(o.b, *rg[j])
        t += max(a, b) + (f[2] if f else 0.0) * min(a, b)
    for p, c, cost in pr.edges:
        if p in split and c not in split:
            t += cost
    for p, c, cost in pr.slices:
        if c in split and p not in split:
            t += cost
    return t


def stage1_optimum(pr: Problem, k: int):
    """(best time, one best (bounds, split, pairs)) over every structure with k nano-batches."""
    if k == 1:
        return (time_of(pr, (0, pr.tokens), frozenset(), ()), ((0, pr.tokens), frozenset(), ())) \
            if pr.min_overlaps == 0 else (None, None)
    inner = [x for x in range(pr.grid, pr.tokens, pr.grid)]
    best = (None, None)
    for cuts in itertools.combinations(inner, k - 1):
        bounds = (0, *cuts, pr.tokens)
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        for bits in itertools.product((0, 1), repeat=len(pr.ops)):
            split = frozenset(op for op, b in zip(pr.ops, bits) if b)
            if not split or any(len({op in split for op in tie}) > 1 for tie in pr.ties):
                continue
            cand = [(o.name, i, j) for o in pr.overlaps for i in range(k) for j in range(k)
                    if not (o.dependent and i == j) and all(op in split for op in o.path)
                    and sizes[j] >= o.min_tokens_b]
            for r in range(len(cand) + 1):
                for pairs in itertools.combinations(cand, r):
                    if r < pr.min_overlaps:
                        continue
                    by = {o.name: o for o in pr.overlaps}
                    used = [(by[n].a, i) for n, i, _ in pairs] + [(by[n].b, j) for n, _, j in pairs]
                    if len(used) != len(set(used)) or not _feasible_order(k, pairs, pr.overlaps):
                        continue
                    t = time_of(pr, bounds, split, pairs)
                    if best[0] is None or t < best[0] - EPS:
                        best = (t, (bounds, split, pairs))
    return best


def stage2_optimum(groups, budget: float = 1.0):
    total, choice = 0.0, {}
    for g in groups:
        if g.fill:
            opts = [c + (budget - sum(c),) for c in itertools.product(*g.grids[:-1]) if sum(c) < budget - EPS]
        else:
            opts = [c for c in itertools.product(*g.grids) if sum(c) <= budget + EPS]
        if not opts:
            return None, None
        c = min(opts, key=g.time)
        total += g.time(c)
        choice[g.name] = c
    return total, choice
