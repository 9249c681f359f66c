"""The MILP solver both stages use: HiGHS through highspy where it is installed, else CBC (shipped with pulp)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Solved:
    status: str          # "optimal", "incumbent" (stopped by the time limit with a feasible solution), "none"
    seconds: float
    solver: str


def var(prob, name: str, low: float | None = None, cat: str = "Continuous"):
    """A variable of `prob` (pulp 3.3 builds them through the problem; older pulp through LpVariable)."""
    import pulp
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=low, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def binary(prob, name: str):
    return var(prob, name, cat="Binary")


def solver_name() -> str:
    try:
        import highspy  # noqa: F401
        return "HiGHS"
    except ImportError:
        return "CBC"


def solve(prob, time_limit: float) -> Solved:
    import time

    import pulp
    import warnings
    name = solver_name()
    limit = max(1.0, float(time_limit))
    with warnings.catch_warnings():          # pulp 3.3 deprecates the bundled CBC for 4.0 (`pulp[cbc]` then)
        warnings.simplefilter("ignore", DeprecationWarning)
        s = pulp.HiGHS(msg=False, timeLimit=limit) if name == "HiGHS" else pulp.PULP_CBC_CMD(msg=False,
                                                                                              timeLimit=limit)
    t0 = time.perf_counter()
    try:
        prob.solve(s)
    except pulp.PulpSolverError:
        return Solved("none", time.perf_counter() - t0, name)
    dt = time.perf_counter() - t0
    sol = getattr(prob, "sol_status", None)
    if prob.status == 1 and sol in (None, pulp.LpSolutionOptimal):
        return Solved("optimal", dt, name)
    if sol == pulp.LpSolutionIntegerFeasible or (prob.status in (0, 1) and _has_values(prob)):
        return Solved("incumbent", dt, name)
    return Solved("none", dt, name)


def _has_values(prob) -> bool:
    vs = prob.variables()
    return bool(vs) and all(v.varValue is not None for v in vs)


def value(v) -> float:
    x = v.value() if hasattr(v, "value") else v
    return 0.0 if x is None else float(x)


def on(v) -> bool:
    return value(v) > 0.5
