"""Policy search (FlexGen section 4.3): the placement an LP finds best for each (GPU batch size, batches per block)
pair, the pairs enumerated outside it, and the best policy whose rounded placement fits (`--offload auto`).

For one pair (and the flags: compression, CPU attention) every lane of the cost model (nfjax/offload/cost_model.py)
and every tier's memory is linear in the nine placement fractions, so

    minimize   L x t_pre + (n - 1) x L x t_dec                 (the block's time; its tokens are fixed)
    subject to t_pre >= each prefill lane, t_dec >= each decode lane,
               w_gpu + w_cpu + w_disk = 1 (and the same for the KV cache and the activations), all >= 0,
               each tier's bytes <= its cap

is an LP (pulp: HiGHS where highspy is installed, else CBC). The two KV blocks the GPU holds while loading
(budget.py) exist only when some block is off the GPU: the LP is solved with them counted, and, where the whole
KV cache could fit on the GPU, once more with the cache pinned there without them. The runtime places whole
tensors and whole (layer, batch) blocks, so the LP's fractions are rounded to the neighbouring realizable
placements; each is checked by `budget.check` and scored by the cost model layer by layer (`predict`: a layer
holding disk blocks waits for their reads, which the LP's averaged lanes spread over every layer), and the best
that fits wins.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from nfjax.config import ModelConfig
from nfjax.offload import budget
from nfjax.offload.cost_model import FRACS, KINDS, LayerCost, Workload, layer_cost, predict, value
from nfjax.offload.hardware import HardwareProfile
from nfjax.offload.policy import Policy, PolicyError, Split

GB = 1e9
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
NUM_BATCHES = (1, 2, 4, 8, 16, 32, 64)
REALIZE_TOP = 6                      # LP solutions rounded and checked, best first
GPU_HEADROOM = 0.95                  # the LP plans for this share of the GPU cap: the budget's working buffers are
#                                      an estimate, and XLA's own scratch and fragmentation are not in it


@dataclass(frozen=True)
class LPSolution:
    bs: int
    nb: int
    cpu_attention: bool
    fractions: dict
    seconds: float                   # the block's predicted time
    out_tok_s: float


@dataclass
class SearchResult:
    policy: Policy
    predicted_tok_s: float           # the cost model at the rounded placement the runtime gets
    lp: LPSolution                   # the LP solution it was rounded from
    solutions: list = field(default_factory=list)     # every feasible pair's LP optimum
    solver: str = ""
    solve_seconds: float = 0.0

    def line(self) -> str:
        p = self.policy
        return (f"offload auto ({self.solver}, {len(self.solutions)} feasible LPs, {self.solve_seconds:.1f} s): "
                f"blocks of {p.gpu_batch_size} x {p.num_gpu_batches}, weights gpu/cpu/disk {p.weights.gpu:.1f}/"
                f"{p.weights.cpu:.1f}/{p.weights.disk:.1f}%, KV {p.cache.gpu:.1f}/{p.cache.cpu:.1f}/"
                f"{p.cache.disk:.1f}%, activations {p.activations.gpu:.1f}/{p.activations.cpu:.1f}/"
                f"{p.activations.disk:.1f}%, cpu_attention {str(p.cpu_attention).lower()}; predicted "
                f"{self.predicted_tok_s:.2f} tok/s (LP before rounding {self.lp.out_tok_s:.2f})")


def _expr(e: dict, x: dict):
    import pulp
    return pulp.lpSum(c * x[k] for k, c in e.items() if k) + e.get("", 0.0)


def solve_lp(cost: LayerCost, caps: dict, kv_all_on_gpu: bool = False, slack: dict | None = None):
    """The LP of one pair: (fractions, the block's seconds), or None when infeasible. `slack` {tier: weight}:
    each such tier's cap may grow by a penalized amount (the infeasibility diagnosis); returns the growth too."""
    import pulp

    from nfjax.autosearch.milp import solve, var
    prob = pulp.LpProblem("offload_policy", pulp.LpMinimize)
    x = {f: var(prob, f, 0.0) for f in FRACS}
    tp, td = var(prob, "t_prefill", 0.0), var(prob, "t_decode", 0.0)
    grow = {t: var(prob, f"grow_{t}", 0.0) for t in (slack or {})}
    n, L = cost.gen_len, cost.layers
    objective = L * tp + (n - 1) * L * td
    # among placements of equal time, the faster tiers (a nanosecond a unit of fraction: below any real difference)
    tie = 1e-9 * pulp.lpSum(x[f] * (2.0 if f.endswith("d") else 1.0) for f in FRACS if f[1] in "cd")
    if slack:          # the diagnosis: the least (weighted) growth of the caps, whatever the time
        prob += pulp.lpSum(w * grow[t] for t, w in slack.items()) * (1.0 / GB)
    else:
        prob += objective + tie
    for e in cost.prefill.values():
        prob += tp >= _expr(e, x)
    for e in cost.decode.values():
        prob += td >= _expr(e, x)
    for fs in KINDS.values():
        prob += pulp.lpSum(x[f] for f in fs) == 1
    if kv_all_on_gpu:
        prob += x["cg"] == 1
    for t, e in cost.memory.items():
        cap = caps.get(t)
        if cap is None:
            continue
        extra = cost.kv_buffer if t == "gpu" and not kv_all_on_gpu else 0.0
        prob += _expr(e, x) + extra <= cap + (grow[t] if t in grow else 0.0)
    res = solve(prob, time_limit=10.0)
    if res.status not in ("optimal", "incumbent"):
        return None
    fr = {f: max(0.0, float(x[f].value() or 0.0)) for f in FRACS}
    secs = cost.total_time(fr)
    if slack is not None:
        return fr, secs, {t: float(g.value() or 0.0) for t, g in grow.items()}
    return fr, secs


def machine_caps(policy: Policy, device=None, offload_dir: Path | None = None) -> dict:
    """Bytes per tier: the policy's caps, else the machine's (the disk's free space in the offload folder)."""
    caps = budget.caps(policy, device, offload_dir)
    if caps.get("disk") is None and policy.disk_gb is None and offload_dir is not None:
        p = Path(offload_dir)
        while not p.exists():
            p = p.parent
        caps["disk"] = float(shutil.disk_usage(p).free)
    return caps


def _boundaries(cfg: ModelConfig, kind: str, nb: int) -> list[float]:
    """The fractions at which a placement of `kind` is realizable (whole tensors by bytes, whole blocks)."""
    import math
    if kind == "weights":
        _, shapes = budget.layer_shapes(cfg)
        sizes = [math.prod(s) for s in shapes]
        tot, acc, out = float(sum(sizes)), 0, [0.0]
        for s in sizes:
            acc += s
            out.append(acc / tot)
        return out
    n = cfg.num_layers * nb if kind == "cache" else nb
    return [i / n for i in range(n + 1)]


def _near(bounds: list[float], x: float) -> set[float]:
    lo = max((b for b in bounds if b <= x + 1e-9), default=0.0)
    hi = min((b for b in bounds if b >= x - 1e-9), default=1.0)
    return {lo, hi}


NO_DISK_STEPS = 20                   # KV splits without disk tried beside an LP solution that has some


def roundings(cfg: ModelConfig, sol: LPSolution) -> list[dict[str, Split]]:
    """The realizable placements around an LP solution: each kind's two boundaries rounded down or up; for a KV
    cache the LP put partly on disk, also splits between the GPU and host memory alone, up to its GPU share in
    `NO_DISK_STEPS` steps (the averaged lanes let disk reads look parallel, and the layers holding disk blocks ran
    slower than modelled: an LP policy with 7% of its KV on disk measured 13.0 tok/s where a grid policy with none
    measured 21.0, both predicted near 20; docs/design.md section 11)."""
    import itertools
    per_kind = []
    for kind, (g, c, d) in KINDS.items():
        b = _boundaries(cfg, kind, sol.nb)
        opts = set()
        for lo in _near(b, sol.fractions[g]):
            for hi in _near(b, sol.fractions[g] + sol.fractions[c]):
                if hi >= lo:
                    opts.add(Split(100 * lo, 100 * (hi - lo), 100 * (1 - hi)))
        if kind == "cache" and sol.fractions[d] > 1e-9:
            top = max(_near(b, sol.fractions[g]))
            for i in range(NO_DISK_STEPS + 1):
                x = max(_near(b, top * i / NO_DISK_STEPS))
                opts.add(Split(100 * x, 100 * (1 - x), 0.0))
        per_kind.append(sorted(opts, key=lambda s: (s.gpu, s.cpu)))
    return [dict(zip(KINDS, combo)) for combo in itertools.product(*per_kind)]


def search(cfg: ModelConfig, workload: Workload, hw: HardwareProfile, caps: dict, *,
           compress_weights: bool = False, compress_cache: bool = False, cpu_attention: tuple = (False, True),
           host_memory: str = "pinned", pairs: list[tuple[int, int]] | None = None, max_block: int | None = None,
           base: Policy | None = None, log=None) -> SearchResult:
    """The best predicted policy over the pairs (default: `BATCH_SIZES` x `NUM_BATCHES`, at most `max_block`
    sequences a block) and the CPU attention choices. No feasible policy: a PolicyError naming the tier that is
    too small and by how much."""
    from nfjax.autosearch.milp import solver_name
    t0 = time.perf_counter()
    plan_caps = {**caps, "gpu": None if caps.get("gpu") is None else GPU_HEADROOM * caps["gpu"]}
    if pairs is None:
        pairs = [(b, k) for b in BATCH_SIZES for k in NUM_BATCHES if max_block is None or b * k <= max_block]
    sols: list[LPSolution] = []
    for bs, nb in pairs:
        for ca in cpu_attention:
            cost = layer_cost(cfg, bs, nb, workload, hw, compress_weights, compress_cache, ca, host_memory)
            gpu_floor = value(cost.memory["gpu"], {f: 0.0 for f in FRACS} | {"wd": 1.0, "cd": 1.0, "hd": 1.0})
            if plan_caps.get("gpu") is not None and gpu_floor > plan_caps["gpu"]:
                continue                              # the fixed GPU share alone is over the cap
            cases = [False]
            full = value(cost.memory["gpu"], {f: 0.0 for f in FRACS} | {"wd": 1.0, "cg": 1.0, "hd": 1.0})
            if plan_caps.get("gpu") is None or full <= plan_caps["gpu"]:
                cases.append(True)
            for case in cases:
                r = solve_lp(cost, plan_caps, kv_all_on_gpu=case)
                if r is not None:
                    fr, secs = r
                    sols.append(LPSolution(bs, nb, ca, fr, secs, cost.block * cost.gen_len / secs))
    if not sols:
        raise infeasible(cfg, workload, hw, caps, compress_weights, compress_cache, host_memory)
    sols.sort(key=lambda s: -s.out_tok_s)
    base = base or Policy()
    best, errors = None, []
    for sol in sols[:REALIZE_TOP]:
        for splits in roundings(cfg, sol):
            pol = base.replace(gpu_batch_size=sol.bs, num_gpu_batches=sol.nb, compress_weights=compress_weights,
                               compress_cache=compress_cache, cpu_attention=sol.cpu_attention,
                               host_memory=host_memory, **splits)
            try:
                budget.check(cfg, pol, workload.context, plan_caps)
            except PolicyError as e:
                errors.append(str(e))
                continue
            tok_s = predict(cfg, pol, workload, hw).out_tok_s       # layer by layer, the policy's own wait
            if best is None or tok_s > best[1]:
                best = (pol, tok_s, sol)
    if best is None:
        raise PolicyError("--offload auto: the LP's placements do not fit once rounded to whole tensors and KV "
                          f"blocks; the closest: {errors[0]}")
    res = SearchResult(best[0], best[1], best[2], sols, solver_name(), time.perf_counter() - t0)
    if log:
        log(res.line())
    return res


def infeasible(cfg, workload, hw, caps, compress_weights, compress_cache, host_memory) -> PolicyError:
    """The error of a search with no feasible pair: the smallest policy (1 x 1) solved with each capped tier allowed
    to grow (growing the disk costs least, the GPU most), naming the tiers that had to grow and by how much (the
    GPU's in terms of its cap, of which the plan uses `GPU_HEADROOM`)."""
    cost = layer_cost(cfg, 1, 1, workload, hw, compress_weights, compress_cache, False, host_memory)
    weights = {t: w for t, w in (("disk", 1.0), ("cpu", 10.0), ("gpu", 100.0)) if caps.get(t) is not None}
    share = {t: GPU_HEADROOM if t == "gpu" else 1.0 for t in caps}
    r = solve_lp(cost, {t: None if c is None else share[t] * c for t, c in caps.items()}, slack=weights)
    flags = {"gpu": "--gpu-memory-gb", "cpu": "--cpu-memory-gb", "disk": "--disk-gb"}
    if r is None:
        return PolicyError("--offload auto: no policy fits the caps (the diagnosis LP failed too)")
    _, _, grow = r
    short = [(t, g / share[t]) for t, g in grow.items() if g > 1e-6 * max(caps[t], 1.0)]
    parts = "; ".join(f"the {t} tier is {g / GB:.4g} GB too small (has {caps[t] / GB:.4g} GB: raise {flags[t]} "
                      f"to at least {(caps[t] + g) / GB:.4g})" for t, g in short)
    return PolicyError(f"--offload auto: no policy fits, not even one sequence a block: {parts or 'unknown tier'}. "
                       f"The model's weights take {cost.layers * cost.info['layer_stored_bytes'] / GB:.3f} GB off the "
                       "GPU (a policy with compress_weights stores them in 4 bits)")


def auto_policy(cfg: ModelConfig, workload: Workload, base: Policy, *, device=None, remeasure: bool = False,
                max_block: int | None = None, log=None, **kw) -> SearchResult:
    """`--offload auto`: this machine's profile (cached), its caps (the base policy's, else the machine's), the
    search; the result's policy carries the caps, so the engine's own budget check uses the same ones."""
    import jax

    from nfjax.offload.engine import default_offload_dir
    from nfjax.offload.hardware import measure
    budget.check_model(cfg)
    device = device or jax.devices()[0]
    root = Path(base.offload_dir) if base.offload_dir else default_offload_dir()
    hw = measure(device, cfg.dtype, root, remeasure=remeasure, log=log)
    caps = machine_caps(base, device, root)
    if log:
        log("offload auto: caps " + ", ".join(f"{t} {'unlimited' if c is None else f'{c / GB:.4g} GB'}"
                                              for t, c in caps.items())
            + f"; prompt {workload.prompt_len}, output {workload.gen_len}, context {workload.context}")
    return search(cfg, workload, hw, caps, base=base, max_block=max_block, log=log, **kw)
