"""Persistent Pallas GEMM vs cuBLAS (jnp.dot) on the Llama-3-8B projection shapes, and its time as a function of
its program count (NanoFlow's resource share). One device call, under 4 minutes on an H100.

usage: python -m bench.kernels.gemm [--out DIR] [--budget-s 170] [--configs a,b] [--shapes qkv,down]
                                    [--tokens 512,2048] [--programs 100,88] [--smoke]
Writes <out>/gemm-<YYYYMMDD>.json; summary keys cublas_tflops, pgemm_tflops_full (4096x8192x8192),
pgemm_vs_cublas_<shape>_<M>, pgemm_vs_cublas_geomean, pgemm_time_ratio_p<P>_geomean.

Phase 1: per shape, cuBLAS and every tile config at one program per SM (each checked against an f32 jnp.dot).
Phase 2: per shape, the best config at fewer programs. The kernels run in a worker process that the parent
feeds one job at a time: a job that raises is recorded and the worker restarted (a CUDA error can poison the
context); a job that hangs (a barrier deadlock) is killed after --job-timeout-s, its config skipped from then
on. The parent never touches the GPU until the end (device info for the JSON).
--smoke: CPU check of this script (tiny shapes, interpret mode, no timing loop).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import select
import signal
import subprocess
import sys
import time

from bench.common import module_command, print_table, write_results  # jax-free at import

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
TOKENS = (512, 1024, 2048)
SQUARE = ("square", 4096, 8192, 8192)
PROGRAMS = (120, 100, 88, 66)          # swept below one-per-SM (that count is read from the device)
CONFIGS = ("128x256_s4_ws", "128x256_s3", "128x128_s5_ws")
TAG = "@@"                             # prefix of protocol lines on the worker's stdout


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------ worker
class Worker:
    """Runs jobs in this process (the child). Keeps one shape's rotated inputs and its f32 reference."""

    def __init__(self, smoke: bool):
        import jax
        self.jax, self.smoke, self.key, self.sets, self.ref = jax, smoke, None, None, None

    def inputs(self, m, k, n):
        jax = self.jax
        import jax.numpy as jnp
        if self.key != (m, k, n):
            self.sets = self.ref = None
            per = 2 * (m * k + k * n)
            count = 1 if self.smoke else min(8, max(2, math.ceil(160e6 / per)))   # > L2 across the rotation
            ks = jax.random.split(jax.random.key(m * 7 + k * 3 + n), 2 * count)
            self.sets = [(jax.random.normal(ks[2 * i], (m, k), jnp.bfloat16),
                          jax.random.normal(ks[2 * i + 1], (k, n), jnp.bfloat16)) for i in range(count)]
            x, w = self.sets[0]
            self.ref = jax.block_until_ready(jnp.dot(x, w, preferred_element_type=jnp.float32))
            self.key = (m, k, n)
        return self.sets

    def run(self, job):
        import functools
        import numpy as np
        import jax.numpy as jnp
        from bench.common import time_fn
        from pallas_kernels.persistent_gemm import persistent_gemm
        jax = self.jax
        if job["kind"] == "info":
            from bench.common import device_info
            from nfjax.compat import num_sms
            return {"num_sms": num_sms(), "device": device_info()}
        m, k, n = job["m"], job["k"], job["n"]
        sets = self.inputs(m, k, n)
        if job["kind"] == "cublas":
            f = jax.jit(lambda x, w: jnp.dot(x, w))
        else:
            f = jax.jit(functools.partial(persistent_gemm, num_ctas=job["programs"], config=job["config"],
                                          interpret=self.smoke))
        t0 = time.perf_counter()
        y = jax.block_until_ready(f(*sets[0]))
        first = time.perf_counter() - t0
        d = np.asarray(y, np.float32) - np.asarray(self.ref, np.float32)
        rel = float(np.linalg.norm(d) / np.linalg.norm(np.asarray(self.ref, np.float32)))
        if self.smoke:
            sec = first
        else:
            iters = 50 if 2 * m * k * n < 50e9 else 20
            sec = time_fn(f, arg_sets=sets, iters=iters, reps=5, warmup=2)["median_s"]
        return {"s": sec, "tflops": 2 * m * k * n / sec / 1e12, "relerr": rel, "first_call_s": first}


def worker_main(smoke: bool, worker_cls=None):
    """Serve jobs from stdin with `worker_cls` (default this module's Worker), one tagged JSON line each."""
    w = (worker_cls or Worker)(smoke)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            res = w.run(job)
        except Exception as ex:  # noqa: BLE001 - reported to the parent, which restarts this process
            import traceback
            traceback.print_exc()
            res = {"error": f"{type(ex).__name__}: {str(ex)[:600]}"}
        print(TAG + json.dumps({"id": job["id"], **res}), flush=True)


# ------------------------------------------------------------------------------------------------ parent
class Pool:
    """One worker subprocess (`python -m MODULE --worker`), fed one job at a time with a per-job time limit."""
    module = "bench.kernels.gemm"

    def __init__(self, smoke: bool, timeout_s: float):
        self.smoke, self.timeout_s, self.proc, self.buf = smoke, timeout_s, None, b""
        self.hard_deadline = float("inf")      # time.monotonic() after which every job is cut short

    def start(self):
        cmd = module_command(self.module, "--worker", *(["--smoke"] if self.smoke else []))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.buf = b""

    def stop(self):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.proc = None

    def run(self, job, first_extra_s: float = 60.0) -> dict:
        fresh = self.proc is None
        if fresh:
            self.start()
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.stop()
            return {"id": job["id"], "error": "worker died before the job started"}
        deadline = min(time.monotonic() + self.timeout_s + (first_extra_s if fresh else 0.0), self.hard_deadline)
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(TAG):
                    res = json.loads(text[len(TAG):])
                    if "error" in res:
                        self.stop()        # a CUDA error may have poisoned the context: next job, new worker
                    return res
                print(text, flush=True)
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                if deadline == self.hard_deadline:
                    return {"id": job["id"], "error": "cut short: time budget spent"}
                return {"id": job["id"], "error": f"timeout after {self.timeout_s:.0f}s (hang?)", "hung": True}
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    code = self.proc.wait()
                    self.proc = None
                    return {"id": job["id"], "error": f"worker died (exit {code})"}
                self.buf += chunk


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="result folder (default bench/results)")
    ap.add_argument("--name", default="gemm")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="TILE_CONFIGS names, comma-separated")
    ap.add_argument("--shapes", default="square," + ",".join(SHAPES), help="subset of: square," + ",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="M values of the Llama shapes")
    ap.add_argument("--programs", default=",".join(map(str, PROGRAMS)), help="program counts below one per SM")
    ap.add_argument("--budget-s", type=float, default=170.0, help="start no job after this many seconds")
    ap.add_argument("--job-timeout-s", type=float, default=45.0, help="a job running longer counts as hung")
    ap.add_argument("--num-sms", type=int, default=None, help="default: read from the device (in the worker)")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: interpret mode, tiny shapes")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args.smoke)

    t_start = time.perf_counter()
    configs = [c for c in args.configs.split(",") if c]
    pool = Pool(args.smoke, args.job_timeout_s)
    info = pool.run({"id": -1, "kind": "info"})
    log("device", info)
    if args.smoke:
        shapes, nsm, programs = [("tiny", 200, 256, 384)], 3, (1,)
        configs = configs[:2]
        pool.timeout_s = max(args.job_timeout_s, 240.0)
    else:
        want = args.shapes.split(",")
        shapes = ([SQUARE] if "square" in want else []) + [
            (name, m, k, n) for name, (k, n) in SHAPES.items() if name in want
            for m in map(int, args.tokens.split(","))]
        nsm = args.num_sms or info.get("num_sms") or 132
        programs = tuple(p for p in map(int, args.programs.split(",")) if p < nsm)
    jobs, results, dead_configs, rows = [], {}, set(), {}
    pool.hard_deadline = time.monotonic() + args.budget_s + args.job_timeout_s - (time.perf_counter() - t_start)
    log(f"SMs {nsm}; configs {configs}; {len(shapes)} shapes; sweep {programs}")

    def submit(kind, shape, **kw):
        name, m, k, n = shape
        job = {"id": len(jobs), "kind": kind, "shape": name, "m": m, "k": k, "n": n, **kw}
        jobs.append(job)
        if kw.get("config") in dead_configs:
            res = {"error": "skipped: this config hung earlier"}
        elif time.perf_counter() - t_start > args.budget_s:
            res = {"error": "skipped: time budget spent"}
        else:
            res = pool.run(job)
            if res.get("hung"):
                dead_configs.add(kw.get("config"))
        res.pop("id", None)
        results[job["id"]] = res
        log(f"{kind} {name} {m}x{k}x{n} {kw}: " + (
            f"{res['tflops']:.0f} TFLOP/s rel {res['relerr']:.1e}" if "tflops" in res else res["error"][:300])
            + f"  [{time.perf_counter() - t_start:.0f}s]")
        return res

    def save(final=False):
        data = {"shapes": list(rows.values()), "jobs": [dict(j, result=results.get(j["id"])) for j in jobs],
                "configs": _config_dicts(configs), "num_sms": nsm, "programs_swept": programs,
                "worker_device": info.get("device"), "wall_s": time.perf_counter() - t_start}
        if final:
            return write_results(args.name, make_summary(rows, nsm, programs), data, out_dir=args.out)
        return _write_partial(args, data)

    try:
        for shape in shapes:                                   # phase 1: cuBLAS + every config, all SMs
            name, m, k, n = shape
            r = {"shape": name, "m": m, "k": k, "n": n, "flops": 2 * m * k * n}
            r["cublas"] = submit("cublas", shape)
            r["configs"] = {c: submit("pgemm", shape, config=c, programs=nsm) for c in configs}
            ok = {c: v for c, v in r["configs"].items() if "tflops" in v and v["relerr"] < 1e-2}
            r["best_config"] = max(ok, key=lambda c: ok[c]["tflops"]) if ok else None
            rows[(name, m)] = r
            save()
        for (name, m), r in rows.items():                      # phase 2: program count, best config
            if r["best_config"] is None:
                continue
            shape, tiles = (name, m, r["k"], r["n"]), _num_tiles(r["best_config"], m, r["n"])
            # programs >= tiles run the same kernel as one per SM (the wrapper caps the grid at the tile count)
            r["sweep"] = {p: submit("pgemm", shape, config=r["best_config"], programs=p) if p < tiles else
                          dict(_best(r), note=f"{tiles} tiles <= {p} programs: same kernel") for p in programs}
            save()
    finally:
        pool.stop()
    print_tables(rows, configs, programs, nsm)
    save(final=True)


def _num_tiles(config, m, n):
    from pallas_kernels.persistent_gemm import TILE_CONFIGS, cdiv
    c = TILE_CONFIGS[config]
    return cdiv(max(m, c.block_m), c.block_m) * cdiv(max(n, c.block_n), c.block_n)


def _config_dicts(names):
    from pallas_kernels.persistent_gemm import TILE_CONFIGS
    return {c: TILE_CONFIGS[c]._asdict() for c in names if c in TILE_CONFIGS}


def _write_partial(args, data):
    """Partial results without touching the GPU (write_results queries the device)."""
    from bench.common import result_path
    path = result_path(args.name + "-partial", args.out)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    return path


def _best(r):
    c = r.get("best_config")
    return r["configs"][c] if c else {}


def make_summary(rows, nsm, programs) -> dict:
    s = {"num_sms": nsm}
    sq = rows.get((SQUARE[0], SQUARE[1]))
    if sq:
        s["cublas_tflops"] = sq["cublas"].get("tflops")
        s["pgemm_tflops_full"] = _best(sq).get("tflops")
        s["pgemm_best_config_square"] = sq.get("best_config")
    ratios = []
    for (name, m), r in rows.items():
        cu, pg = r["cublas"].get("tflops"), _best(r).get("tflops")
        ratio = pg / cu if pg and cu else None
        s[f"pgemm_vs_cublas_{name}_{m}"] = ratio
        ratios.append(ratio)
    s["pgemm_vs_cublas_geomean"] = geomean(ratios)
    for p in programs:      # time at p programs over time at one per SM (1.0 = no slower)
        s[f"pgemm_time_ratio_p{p}_geomean"] = geomean(
            [r["sweep"][p]["s"] / _best(r)["s"] for r in rows.values()
             if "s" in r.get("sweep", {}).get(p, {}) and "s" in _best(r)])
    s["errors"] = sum("error" in v for r in rows.values() for v in [r["cublas"], *r["configs"].values(),
                                                                     *r.get("sweep", {}).values()])
    return s


def print_tables(rows, configs, programs, nsm):
    def tf(v):
        return v.get("tflops") if "tflops" in v else ("ERR" if "error" in v else None)
    head = ["shape", "M", "K", "N", "cuBLAS"] + [f"{c}" for c in configs] + ["best/cuBLAS", "rel err"]
    body = []
    for r in rows.values():
        b = _best(r)
        body.append([r["shape"], r["m"], r["k"], r["n"], tf(r["cublas"])] + [tf(r["configs"][c]) for c in configs]
                    + [b.get("tflops") / r["cublas"]["tflops"] if b and "tflops" in r["cublas"] else None,
                       b.get("relerr")])
    print_table(head, body, title=f"\n== TFLOP/s at {nsm} programs (one per SM) ==")
    body = [[r["shape"], r["m"], r.get("best_config"), _best(r).get("tflops")]
            + [tf(r.get("sweep", {}).get(p, {})) for p in programs] for r in rows.values()]
    print_table(["shape", "M", "config", f"P={nsm}"] + [f"P={p}" for p in programs], body,
                title="\n== TFLOP/s against program count (best config) ==")


if __name__ == "__main__":
    main()
