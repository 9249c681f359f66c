"""Grouped (MoE) GEMM: the Pallas grouped kernel vs a dense GEMM of the same FLOPs and vs XLA's ragged_dot, on
Mixtral-8x7B's expert shapes, and the kernel's time against its program count (NanoFlow's resource share).
One device call, a few minutes on an H100.

usage: python -m bench.kernels.grouped_gemm [--out DIR] [--tokens 512,1024,2048] [--programs 100,66]
                                            [--no-ragged-dot] [--budget-s 240] [--smoke]
Writes <out>/grouped_gemm-<YYYYMMDD>.json; summary keys moe_grouped_gemm_vs_dense (geomean over shapes of
grouped TFLOP/s / dense TFLOP/s), grouped_vs_dense_<shape>_<T>, grouped_tflops_<shape>_<T>,
ragged_dot_vs_dense_geomean, grouped_time_ratio_p<P>_geomean.

A case: T tokens routed top-2 over 8 experts (router probabilities drawn at random, seeded: near-uniform loads,
as a trained router gives on average), the T * 2 rows sorted by expert with each group padded to the kernel's
128-row tile (nfjax/models/moe_routing.py's layout). FLOPs counted are the useful ones, 2 * T * 2 * K * N, for
every path; the dense GEMM is [T * 2, K] @ [K, N] (one weight: what the same FLOPs cost without the grouping).
Every output is checked against an f32 reference on the routed rows. The jobs run in a worker process fed one at
a time, killed after --job-timeout-s (bench/kernels/gemm.py's Pool: a hung barrier or CUDA error costs one job).
--smoke: CPU check of this script (tiny shapes, interpret mode, no timing loop).
"""
from __future__ import annotations

import argparse
import time

from bench.common import print_table, write_results  # jax-free at import
from bench.kernels import gemm as dense_bench

SHAPES = {"up": (4096, 14336), "down": (14336, 4096)}     # Mixtral-8x7B: gate/up and down of one expert
TOKENS = (512, 1024, 2048)
PROGRAMS = (100, 66)
EXPERTS, TOP_K = 8, 2


class Worker(dense_bench.Worker):
    def case(self, t, k, n, e, top_k, align):
        """(x rows [R, K], w [E, K, N], padded group sizes [E], dest [T, top_k], f32 reference rows)."""
        import jax
        import jax.numpy as jnp
        from nfjax.models.moe_routing import sort_by_expert, top_k_routing
        from pallas_kernels.grouped_gemm_ref import grouped_gemm_ref
        if self.key != (t, k, n, e):
            self.sets = self.ref = None
            kx, kw, kr = jax.random.split(jax.random.key(t * 7 + k * 3 + n), 3)
            h = jax.random.normal(kx, (t, k), jnp.bfloat16)
            _, experts = top_k_routing(jax.random.normal(kr, (t, e)), top_k, True)
            xs, sizes, dest = sort_by_expert(h, experts, e, align)
            w = jax.random.normal(kw, (e, k, n), jnp.bfloat16) * 0.05
            self.sets = (xs, w, sizes, dest)
            self.ref = jax.block_until_ready(grouped_gemm_ref(xs.astype(jnp.float32), w.astype(jnp.float32), sizes))
            self.key = (t, k, n, e)
        return self.sets, self.ref

    def run(self, job):
        import functools
        import numpy as np
        import jax.numpy as jnp
        from bench.common import time_fn
        from pallas_kernels.grouped_gemm import group_alignment, grouped_gemm
        jax = self.jax
        if job["kind"] == "info":
            from bench.common import device_info
            from nfjax.compat import num_sms
            return {"num_sms": num_sms(), "device": device_info()}
        t, k, n, e, top_k = job["t"], job["k"], job["n"], job["experts"], job["top_k"]
        (xs, w, sizes, dest), ref = self.case(t, k, n, e, top_k, group_alignment(job.get("config", "128x256_s4_ws")))
        rows = np.unique(np.asarray(dest).reshape(-1))             # the routed rows (not the padding)
        if job["kind"] == "dense":
            x2 = xs[:t * top_k]
            f, args, check = jax.jit(lambda x, w: jnp.dot(x, w)), (x2, w[0]), None
        elif job["kind"] in ("swiglu", "unfused"):
            # the gate/up GEMM over a joined weight interleaved for the epilogue: act="swiglu" writes silu(gate) *
            # up; "unfused" runs the kernel to [R, 2F] and XLA's swiglu after it (the path before the epilogue)
            from nfjax.models.llama import swiglu
            from pallas_kernels.grouped_gemm import swiglu_block
            from pallas_kernels.grouped_gemm_ref import deinterleave
            blk, cfg = swiglu_block(job["config"]), job["config"]
            if job["kind"] == "swiglu":
                f = jax.jit(functools.partial(grouped_gemm, num_ctas=job["programs"], config=cfg, act="swiglu",
                                              interpret=self.smoke))
            else:
                f = jax.jit(lambda x, w, s: swiglu(*deinterleave(
                    grouped_gemm(x, w, s, num_ctas=job["programs"], config=cfg, interpret=self.smoke), blk)))
            args, check = (xs, w, sizes), rows
            ref = swiglu(*deinterleave(ref, blk))
        elif job["kind"] == "ragged_dot":
            f = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s))
            args, check = (xs, w, sizes), rows
        else:
            f = jax.jit(functools.partial(grouped_gemm, num_ctas=job["programs"], config=job["config"],
                                          interpret=self.smoke))
            args, check = (xs, w, sizes), rows
        t0 = time.perf_counter()
        y = jax.block_until_ready(f(*args))
        first = time.perf_counter() - t0
        rel = None
        if check is not None:
            d = np.asarray(y, np.float32)[check] - np.asarray(ref, np.float32)[check]
            rel = float(np.linalg.norm(d) / np.linalg.norm(np.asarray(ref, np.float32)[check]))
        sec = first if self.smoke else time_fn(f, *args, iters=20, reps=5, warmup=2)["median_s"]
        flops = 2 * t * top_k * k * n
        return {"s": sec, "tflops": flops / sec / 1e12, "relerr": rel, "first_call_s": first,
                "rows": int(xs.shape[0]), "routed_rows": int(len(rows))}


class Pool(dense_bench.Pool):
    module = "bench.kernels.grouped_gemm"


def make_summary(rows: dict, programs) -> dict:
    geo = dense_bench.geomean
    s, ratios, ragged = {}, [], []
    for (name, t), r in rows.items():
        g, d, x = (r[kind].get("tflops") for kind in ("grouped", "dense", "ragged_dot"))
        s[f"grouped_tflops_{name}_{t}"] = g
        s[f"dense_tflops_{name}_{t}"] = d
        ratios.append(g / d if g and d else None)
        s[f"grouped_vs_dense_{name}_{t}"] = ratios[-1]
        ragged.append(x / d if x and d else None)
    s["moe_grouped_gemm_vs_dense"] = geo(ratios)
    s["ragged_dot_vs_dense_geomean"] = geo(ragged)
    for p in programs:
        s[f"grouped_time_ratio_p{p}_geomean"] = geo([r["sweep"][p]["s"] / r["grouped"]["s"] for r in rows.values()
                                                     if "s" in r["sweep"].get(p, {}) and "s" in r["grouped"]])
    s["max_relerr"] = max((v["relerr"] for r in rows.values() for v in [r["grouped"], r["ragged_dot"],
                                                                          *r["sweep"].values()]
                           if v.get("relerr") is not None), default=None)
    s["errors"] = sum("error" in v for r in rows.values() for v in [r["grouped"], r["dense"], r["ragged_dot"],
                                                                     *r["sweep"].values()])
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="result folder (default bench/results)")
    ap.add_argument("--name", default="grouped_gemm")
    ap.add_argument("--config", default="128x256_s4_ws", help="the kernel's TILE_CONFIGS name")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens T (T * 2 routed rows)")
    ap.add_argument("--programs", default=",".join(map(str, PROGRAMS)), help="program counts below one per SM")
    ap.add_argument("--no-ragged-dot", action="store_true", help="skip XLA's ragged_dot (slow if XLA densifies it)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no job after this many seconds")
    ap.add_argument("--job-timeout-s", type=float, default=60.0, help="a job running longer counts as hung")
    ap.add_argument("--swiglu", action="store_true",
                    help="also the gate/up GEMM with its SwiGLU epilogue (N = 2 x 14336, interleaved) against the "
                         "kernel plus XLA's swiglu")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: interpret mode, tiny shapes")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return dense_bench.worker_main(args.smoke, Worker)

    t_start = time.perf_counter()
    pool = Pool(args.smoke, args.job_timeout_s)
    info = pool.run({"id": -1, "kind": "info"})
    print("device", info, flush=True)
    if args.smoke:
        cases, experts, programs = [("tiny", 64, 128, 384)], 3, (2,)
        pool.timeout_s = max(args.job_timeout_s, 240.0)
    else:
        cases = [(name, t, k, n) for name, (k, n) in SHAPES.items() for t in map(int, args.tokens.split(","))]
        experts = EXPERTS
        nsm = info.get("num_sms") or 132
        programs = tuple(p for p in map(int, args.programs.split(",")) if p < nsm)
    pool.hard_deadline = time.monotonic() + args.budget_s + args.job_timeout_s
    jobs, rows, swiglu_rows = [], {}, {}

    def submit(kind, case, **kw):
        name, t, k, n = case
        job = {"id": len(jobs), "kind": kind, "t": t, "k": k, "n": n, "experts": experts, "top_k": TOP_K,
               "config": args.config, **kw}
        jobs.append(job)
        res = pool.run(job) if time.perf_counter() - t_start <= args.budget_s else {"error": "skipped: budget"}
        res.pop("id", None)
        job["result"] = res
        print(f"{kind} {name} T={t} {k}x{n} {kw}: " + (f"{res['tflops']:.0f} TFLOP/s rel {res['relerr']}"
                                                        if "tflops" in res else res["error"][:300]), flush=True)
        return res

    try:
        for case in cases:
            name, t, k, n = case
            r = {"shape": name, "t": t, "k": k, "n": n, "experts": experts, "top_k": TOP_K,
                 "dense": submit("dense", case), "grouped": submit("grouped", case, programs=None),
                 "ragged_dot": {} if args.no_ragged_dot else submit("ragged_dot", case)}
            r["sweep"] = {p: submit("grouped", case, programs=p) for p in programs}
            rows[(name, t)] = r
        if args.swiglu:
            for name, t, k, n in cases:
                if name in ("up", "tiny"):          # the joined gate/up weight: twice the columns
                    case = (name, t, k, 2 * n if name == "up" else 512)
                    swiglu_rows[t] = {"swiglu": submit("swiglu", case, programs=None),
                                      "unfused": submit("unfused", case, programs=None)}
    finally:
        pool.stop()
    body = [[r["shape"], r["t"], r["k"], r["n"], r["dense"].get("tflops"), r["grouped"].get("tflops"),
             r["ragged_dot"].get("tflops"), r["grouped"].get("relerr")]
            + [r["sweep"][p].get("tflops") for p in programs] for r in rows.values()]
    print_table(["shape", "T", "K", "N", "dense", "grouped", "ragged_dot", "rel err"] + [f"P={p}" for p in programs],
                body, title="\n== TFLOP/s (useful FLOPs) ==")
    summary = make_summary(rows, programs)
    for t, r in swiglu_rows.items():
        r["speedup"] = r["unfused"]["s"] / r["swiglu"]["s"] if "s" in r["swiglu"] and "s" in r["unfused"] else None
        summary[f"swiglu_epilogue_speedup_{t}"] = r["speedup"]
        summary[f"swiglu_epilogue_relerr_{t}"] = r["swiglu"].get("relerr")
    if swiglu_rows:
        print_table(["T", "epilogue ms", "unfused ms", "speedup", "rel err"],
                    [[t, r["swiglu"].get("s", 0) * 1e3, r["unfused"].get("s", 0) * 1e3, r["speedup"],
                      r["swiglu"].get("relerr")] for t, r in swiglu_rows.items()],
                    title="\n== gate/up GEMM + SwiGLU: epilogue vs unfused ==")
    write_results(args.name, summary, {"rows": list(rows.values()), "swiglu": swiglu_rows, "jobs": jobs,
                                                            "device": info.get("device"),
                                                            "wall_s": time.perf_counter() - t_start},
                  out_dir=args.out)


if __name__ == "__main__":
    main()
