"""Stage I and stage II against brute-force enumeration on small op graphs with random costs: the same optimum,
and every share assignment within the budget."""
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from brute import stage1_optimum, stage2_optimum, time_of
from nfjax.autosearch.stage1 import Overlap, Problem, solve_stage1, stage1_time
from nfjax.autosearch.stage2 import Group, combos, solve_stage2


def random_problem(seed: int, n_ops: int = 5, tokens: int = 64, grid: int = 16, dependent: bool = True,
                   ties: bool = False, min_overlaps: int = 0, shared: bool = False, slices: bool = False,
                   hides: bool = False) -> Problem:
    """A chain of ops (each reads its predecessor), random costs with a fixed launch cost, a size term and
    a position term (like decode attention, whose cost follows the decode rows at the front), random join costs,
    one overlap pair; `slices`: random costs of a split op reading its merged predecessor's rows; `hides`: the
    pair's kappa < 0 (the fused kernel faster than its longer part alone)."""
    rng = random.Random(seed)
    ops = tuple(f"op{i}" for i in range(n_ops))
    coef = {op: (rng.uniform(0.5, 2.0), rng.uniform(0.0, 0.1), rng.uniform(0.0, 0.001), rng.uniform(0, 0.05),
                 rng.randrange(0, tokens, grid)) for op in ops}

    def cost(op, lo, hi):
        launch, per, sq, front, edge = coef[op]
        n = hi - lo
        return launch + per * n + sq * n * n + front * max(0, min(hi, edge) - lo)
    edges = tuple((a, b, rng.choice([0.0, rng.uniform(0.0, 1.5)])) for a, b in zip(ops, ops[1:]))
    i = rng.randrange(0, n_ops - 2)
    j = rng.randrange(i + 1, n_ops)
    ov = Overlap("k", ops[i], ops[j], ops[i:j + 1] if dependent else (ops[i], ops[j]), dependent,
                 rng.choice([0, grid, 2 * grid]))
    tie = ((ops[0], ops[1]),) if ties else ()
    pc = {}
    if shared:       # the parts inside the pair slower (on a share of the GPU) and a partial overlap (kappa)
        sa, sb, kap = rng.uniform(1.0, 2.0), rng.uniform(1.0, 1.5), rng.uniform(-0.4 if hides else 0.0, 1.0)
        pc = {"k": (lambda lo, hi: sa * cost(ov.a, lo, hi), lambda lo, hi: sb * cost(ov.b, lo, hi), kap)}
    sl = tuple((a, b, rng.uniform(0.0, 1.0)) for a, b in zip(ops, ops[1:])) if slices else ()
    return Problem(ops, tokens, grid, cost, edges, (ov,), tie, min_overlaps, pc, sl)


CASES = [dict(seed=s, k=k) for s in range(4) for k in (2, 3)] + [
    dict(seed=11, k=2, dependent=False), dict(seed=12, k=3, dependent=False),
    dict(seed=13, k=2, ties=True), dict(seed=14, k=3, min_overlaps=1), dict(seed=15, k=3, min_overlaps=2),
    dict(seed=22, k=2, shared=True), dict(seed=22, k=3, shared=True), dict(seed=32, k=3, shared=True),
    dict(seed=18, k=3, shared=True, min_overlaps=1), dict(seed=41, k=2, slices=True),
    dict(seed=42, k=3, slices=True, shared=True), dict(seed=41, k=2, shared=True, hides=True),
    dict(seed=41, k=3, shared=True, hides=True, slices=True), dict(seed=57, k=2, shared=True, hides=True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_stage1_matches_brute_force(case):
    case = dict(case)
    k = case.pop("k")
    pr = random_problem(**case)
    want, _ = stage1_optimum(pr, k)
    got, notes = solve_stage1(pr, k, top=1, time_limit=60)
    if want is None:
        assert not got
        return
    assert got and got[0].status == "optimal", notes
    s = got[0]
    assert s.objective == pytest.approx(want, rel=1e-6, abs=1e-6)
    # the structure read back is what the objective says: the brute-force costing of it agrees
    assert time_of(pr, s.bounds, s.split, s.pairs) == pytest.approx(s.objective, rel=1e-9)
    assert stage1_time(pr, s) == pytest.approx(s.objective, rel=1e-9)
    assert len(s.bounds) == k + 1 and all(b % pr.grid == 0 for b in s.bounds)


def test_stage1_top_structures_are_distinct_and_ranked():
    pr = random_problem(3)
    got, _ = solve_stage1(pr, 2, top=4, time_limit=60)
    keys = [(s.split, s.pairs) for s in got]
    assert len(keys) == len(set(keys)) >= 2
    assert [s.objective for s in got] == sorted(s.objective for s in got)


def test_stage1_k1_is_sequential():
    pr = random_problem(5)
    (s,), _ = solve_stage1(pr, 1)
    assert s.bounds == (0, pr.tokens) and not s.split and s.objective == pytest.approx(stage1_optimum(pr, 1)[0])


def random_groups(seed: int, n: int = 3, fill: bool = False):
    rng = random.Random(seed)
    out = []
    for gi in range(n):
        m = rng.choice([2, 3])
        grids = tuple(tuple(sorted(rng.sample([0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0], 4)))
                      for _ in range(m))
        base = [rng.uniform(0.2, 2.0) for _ in range(m)]
        power = [rng.uniform(0.3, 1.0) for _ in range(m)]
        inter = rng.uniform(1.0, 1.3)

        def t(c, base=base, power=power, inter=inter):   # slower on a smaller share; the group: slowest x inter
            return inter * max(b / max(s, 1e-3) ** p for b, p, s in zip(base, power, c))
        out.append(Group(("g", gi), tuple(f"m{i}" for i in range(m)), grids if not fill else grids[:-1] + ((),),
                         t, fill=fill))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fill", [False, True])
def test_stage2_matches_brute_force(seed, fill):
    groups = random_groups(seed, fill=fill)
    want, _ = stage2_optimum(groups)
    res = solve_stage2(groups, time_limit=30)
    if want is None:
        assert res.status == "none"
        return
    assert res.status == "optimal"
    assert res.total == pytest.approx(want, rel=1e-6)
    for g in groups:
        assert sum(res.shares[g.name]) <= 1.0 + 1e-9


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.sampled_from([0.1, 0.2, 0.3, 0.45, 0.5, 0.7, 0.9, 1.0]), min_size=1, max_size=4),
                min_size=2, max_size=3),
       st.floats(0.5, 1.0), st.integers(0, 1000))
def test_stage2_never_exceeds_the_share_budget(grids, budget, seed):
    rng = random.Random(seed)
    weights = [rng.uniform(0.1, 3.0) for _ in grids]
    g = Group("g", tuple(f"m{i}" for i in range(len(grids))), tuple(tuple(sorted(set(x))) for x in grids),
              lambda c: max(w / s for w, s in zip(weights, c)))
    res = solve_stage2([g], budget=budget, time_limit=20)
    if not combos(g, budget):
        assert res.status == "none"
        return
    assert sum(res.shares["g"]) <= budget + 1e-9
    assert res.total == pytest.approx(stage2_optimum([g], budget)[0], rel=1e-6)
