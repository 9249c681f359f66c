"""Stage II (NanoFlow section 3.3.2): the resource share of every nano-op that runs beside another, minimizing the
layer's time with the shares of ops running at the same time summing to at most the budget (1: the whole GPU).

A group is a set of nano-ops that run concurrently (here: the parts of one horizontal kernel launch). Each
member's share comes from its profiled share grid; the group's time at a choice of shares is what the cost
model gives (each part at its share, times the profiled interference). The product share x time is not
linearized by McCormick envelopes but enumerated exactly over the profiled grid: y[g][c] = 1 picks the share
combination c of group g, among the combinations within the budget;
  minimize  sum_g sum_c y[g][c] time_g(c)   s.t.  sum_c y[g][c] = 1.
A horizontal kernel gives its last part what the others leave (`Group.fill`): only the others are enumerated.
Ops that run alone keep the whole GPU (a smaller share only slows them). Launches follow one another on the
stream, so the groups do not constrain each other and the MILP's optimum is each group's best combination; the
formulation keeps cross-group terms possible for a mechanism whose concurrency spans launches.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from nfjax.autosearch import milp

EPS = 1e-9


@dataclass(frozen=True)
class Group:
    name: object                                      # a hashable key
    members: tuple[str, ...]
    grids: tuple[tuple[float, ...], ...]              # share options per member
    time: Callable[[tuple[float, ...]], float]        # the group's time at these shares
    fill: bool = False            # the last member takes what the others leave (its grid is not used)


@dataclass(frozen=True)
class Stage2Result:
    shares: dict                      # group name -> tuple of shares (one per member)
    times: dict                       # group name -> ms
    total: float
    status: str
    seconds: float = 0.0


def combos(g: Group, budget: float = 1.0) -> list[tuple[float, ...]]:
    """The share combinations of `g` within the budget."""
    if g.fill:
        return [c + (round(budget - sum(c), 9),) for c in itertools.product(*g.grids[:-1]) if sum(c) < budget - EPS]
    return [c for c in itertools.product(*g.grids) if sum(c) <= budget + EPS]


def solve_stage2(groups: list[Group], budget: float = 1.0, time_limit: float = 20.0) -> Stage2Result:
    if not groups:
        return Stage2Result({}, {}, 0.0, "optimal")
    import pulp
    prob = pulp.LpProblem("stage2", pulp.LpMinimize)
    ys, cost = {}, {}
    for gi, g in enumerate(groups):
        cs = combos(g, budget)
        if not cs:
            return Stage2Result({}, {}, float("inf"), "none")
        for ci, c in enumerate(cs):
            ys[gi, ci] = milp.binary(prob, f"y_{gi}_{ci}")
            cost[gi, ci] = (g.time(c), c)
        prob += pulp.lpSum(ys[gi, ci] for ci in range(len(cs))) == 1
        # the budget, stated on the chosen shares (the enumeration already keeps to it)
        prob += pulp.lpSum(ys[gi, ci] * sum(cost[gi, ci][1]) for ci in range(len(cs))) <= budget + EPS
    prob += pulp.lpSum(ys[key] * cost[key][0] for key in ys)
    res = milp.solve(prob, time_limit)
    if res.status == "none":
        return Stage2Result({}, {}, float("inf"), "none", res.seconds)
    shares, times = {}, {}
    for gi, g in enumerate(groups):
        ci = max((ci for (gj, ci) in ys if gj == gi), key=lambda ci: milp.value(ys[gi, ci]))
        t, c = cost[gi, ci]
        shares[g.name], times[g.name] = c, t
    return Stage2Result(shares, times, sum(times.values()), res.status, res.seconds)
