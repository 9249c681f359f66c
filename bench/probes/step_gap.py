"""Probe: where in a run one engine loses time against another, from two `bench.offline` result files' per-step
records (`per_step`: each step's kind, decode tokens and cycle = host ms + ms blocked on the read, in order). Prints
the two runs' time per range of steps and the difference, and writes nothing.

usage: python -m bench.probes.step_gap bench/results/A.json bench/results/B.json --workload 1024x512 \
           [--engine-a NAME] [--engine-b NAME] [--ranges 8]
"""
from __future__ import annotations

import argparse
import json


def per_step(path: str, workload: str, engine: str | None) -> tuple[str, dict]:
    """(engine name, its `per_step` record for `workload`) from a bench.offline result file."""
    with open(path) as f:
        engines = json.load(f)["data"]["engines"]
    name = engine or next(iter(engines))
    if name not in engines:
        raise SystemExit(f"{path}: no engine {name!r} (it has {sorted(engines)})")
    res = engines[name]["results"].get(workload)
    if res is None or "per_step" not in res:
        raise SystemExit(f"{path}: engine {name!r} has no per-step record for workload {workload!r}")
    return name, res["per_step"]


def ranges(a: dict, b: dict, n: int) -> list[dict]:
    """Both runs' seconds over `n` equal ranges of step indices (the shorter run's length), with each range's most
    common kind in run a and its mean decode tokens."""
    steps = min(len(a["cycle_ms"]), len(b["cycle_ms"]))
    edges = [round(i * steps / n) for i in range(n + 1)]
    out = []
    for lo, hi in zip(edges, edges[1:]):
        if hi <= lo:
            continue
        kinds = a["kind"][lo:hi]
        out.append({"steps": f"{lo}-{hi - 1}", "kind_a": max(set(kinds), key=kinds.count),
                    "decode_a": sum(a["decode_tokens"][lo:hi]) / (hi - lo),
                    "s_a": sum(a["cycle_ms"][lo:hi]) / 1e3, "s_b": sum(b["cycle_ms"][lo:hi]) / 1e3})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--workload", default="1024x512")
    ap.add_argument("--engine-a", default=None, help="variant name in file a (default its first)")
    ap.add_argument("--engine-b", default=None, help="variant name in file b (default its first)")
    ap.add_argument("--ranges", type=int, default=8)
    args = ap.parse_args()
    na, a = per_step(args.a, args.workload, args.engine_a)
    nb, b = per_step(args.b, args.workload, args.engine_b)
    print(f"a = {na} ({len(a['cycle_ms'])} steps, {sum(a['cycle_ms']) / 1e3:.2f} s), "
          f"b = {nb} ({len(b['cycle_ms'])} steps, {sum(b['cycle_ms']) / 1e3:.2f} s)")
    print(f"{'steps':>11}  {'kind in a':>22}  {'decodes':>7}  {'a s':>6}  {'b s':>6}  {'b - a':>6}")
    for r in ranges(a, b, args.ranges):
        print(f"{r['steps']:>11}  {r['kind_a']:>22}  {r['decode_a']:7.0f}  {r['s_a']:6.2f}  {r['s_b']:6.2f}  "
              f"{r['s_b'] - r['s_a']:+6.2f}")


if __name__ == "__main__":
    main()
