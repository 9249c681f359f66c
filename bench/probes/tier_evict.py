"""What evicting prefix-cache pages to host memory costs the steps beside it (issue #23, GPU).

A loop of fake steps (a chain of bf16 GEMMs writing a few positions of a real 8B-shaped KV cache, donated, one
step launched ahead of the read of the one before, as the engine runs) with `--rows` pages evicted before every
step, by each way of moving a page row to the host:
  none        no eviction: the reference time
  inprog      `TierCopies` with pinned rows: the gather program writes its rows to pinned host memory itself
  pool        `HostPool`: rows written into slots of one pinned array allocated at start (a tier of 4x the rows
              a step evicts, its oldest rows dropped as new ones come)
  numpy       `TierCopies` with numpy rows: device rows, `copy_to_host_async`, read back one step later
  put         device rows, then `jax.device_put` to pinned host on the engine thread (the first pinned version)
  put_thread  device rows, then `jax.device_put` to pinned host on a worker thread
For each: ms a step, the overhead against `none`, the host ms a step spent launching the eviction, and a check
that a row read back holds its page's bytes.

    python -m bench.probes.tier_evict [--rows 16] [--steps 60] [--gemms 24] [--pages 2048] [--prewarm-gb 8]
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

METHODS = ("none", "pool", "inprog", "numpy", "put", "put_thread")


def build(args):
    import jax
    import jax.numpy as jnp
    from nfjax.compat import pinned_host_sharding
    from nfjax.config import CacheConfig
    from nfjax.kv.cache import KVCache
    from nfjax.kv.prefix_cache import TierCopies
    from nfjax.models.random_init import SHAPES

    dev = jax.devices()[0]
    rep = jax.sharding.SingleDeviceSharding(dev)
    cfg = CacheConfig(num_pages=args.pages, page_size=16)
    kv = KVCache.create(SHAPES[args.shape], cfg, sharding=rep)
    kv = kv.with_arrays([jax.random.normal(jax.random.key(i), a.shape, a.dtype) for i, a in enumerate(kv.arrays())])
    pinned = pinned_host_sharding(rep)
    copies = {"inprog": TierCopies(kv, rep, rep, args.pages, 64, host_sharding=pinned),
              "numpy": TierCopies(kv, rep, rep, args.pages, 64, host_sharding=None)}
    from nfjax.kv.host_pool import HostPool
    copies["pool"] = HostPool(kv, rep, rep, pinned, 4 * args.rows, copies["numpy"].row_bytes, 64)
    w = jax.random.normal(jax.random.key(7), (args.dim, args.dim), jnp.bfloat16) / args.dim ** 0.5

    def step(kv, x, w, slot):
        for _ in range(args.gemms):
            x = jnp.tanh(x @ w)
        n = kv.k.shape[2] * kv.k.shape[3] * kv.k.shape[4]
        k = kv.k.at[:, slot].set(x.reshape(-1)[:n].reshape(kv.k.shape[2:])[None].astype(kv.k.dtype))
        return KVCache(k, kv.v, kv.aux, kv.kv_dtype), x, x[0, :8].astype(jnp.float32)
    x = jax.random.normal(jax.random.key(8), (args.dim, args.dim), jnp.bfloat16)
    step_c = jax.jit(step, donate_argnums=0).lower(kv, x, w, jnp.int32(0)).compile()
    return kv, x, w, step_c, copies, pinned


def run_method(method, kv, x, w, step_c, copies, pinned, args, pool):
    """(kv, x, {step_ms, evict_host_ms, ok}) after `args.steps` steps with `method`'s evictions."""
    import jax
    rng = np.random.default_rng(0)
    kept = []                                  # (page, row, kv array snapshot id) of a few rows to check
    lazies, futs, tier = [], [], []
    evict_s = 0.0
    prev = None
    t0 = time.perf_counter()
    for i in range(args.steps):
        pages = sorted(rng.choice(np.arange(1, args.pages), args.rows, replace=False).tolist())
        te = time.perf_counter()
        if method in ("inprog", "numpy"):
            rows = copies[method].to_host_async(kv, pages)
            if method == "numpy":
                lazies.append(rows)
                if len(lazies) > 2:          # read back one step later, as the engine settles them
                    [r.get() for r in lazies.pop(0)]
        elif method == "pool":
            tier = tier[-3 * args.rows:]             # the oldest rows dropped: their slots free again
            rows = copies["pool"].put(kv, pages)
            tier.extend(rows)
        elif method in ("put", "put_thread"):
            dev_rows = copies["numpy"]._pack[args.rows](kv, np.asarray(pages, np.int32))
            if method == "put":
                rows = [jax.device_put(r, pinned) for r in dev_rows]
            else:
                rows = pool.submit(lambda rs: [jax.device_put(r, pinned) for r in rs], dev_rows)
                futs.append(rows)
        else:
            rows = None
        evict_s += time.perf_counter() - te
        if i == 2 and rows is not None:     # a page's bytes before the steps overwrite anything more
            want = np.asarray(copies["numpy"]._pack[1](kv, np.asarray(pages[:1], np.int32))[0])
            kept.append((want, rows))
        kv, x, out = step_c(kv, x, w, np.int32(i % args.pages))
        if prev is not None:
            np.asarray(prev)                # the engine reads step i-1 after launching step i
        prev = out
    np.asarray(prev)
    for f in futs:
        f.result()
    jax.block_until_ready(kv.k)
    dt = time.perf_counter() - t0
    ok = True
    for want, rows in kept:
        r = rows.result() if hasattr(rows, "result") else rows
        got = r[0].get() if hasattr(r[0], "get") else np.asarray(r[0])
        ok = ok and bool(np.array_equal(np.asarray(got), want))
    return kv, x, dict(step_ms=dt / args.steps * 1e3, evict_host_ms=evict_s / args.steps * 1e3, ok=ok)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--pages", type=int, default=2048)
    p.add_argument("--rows", type=int, default=16, help="pages evicted before each step (a compiled size)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--gemms", type=int, default=24, help="GEMMs a fake step (~0.9 ms each at --dim 8192)")
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--prewarm-gb", type=float, default=0.0,
                   help="grow the pinned host pool this far first (TierCopies.reserve_pinned)")
    p.add_argument("--name", default="tier_evict")
    args = p.parse_args(argv)
    from bench.common import device_info, print_table, write_results
    kv, x, w, step_c, copies, pinned = build(args)
    if args.prewarm_gb:
        print(f"pinned pool of {args.prewarm_gb:g} GB in {copies['inprog'].reserve_pinned(int(args.prewarm_gb * 2 ** 30)):.2f} s")
    results = {}
    with ThreadPoolExecutor(1) as pool:
        kv, x, _ = run_method("none", kv, x, w, step_c, copies, pinned, args, pool)     # warm-up
        for rep in range(args.repeat):
            for m in args.methods.split(","):
                kv, x, r = run_method(m, kv, x, w, step_c, copies, pinned, args, pool)
                results.setdefault(m, []).append(r)
    base = min(r["step_ms"] for r in results["none"])
    rows = []
    row_mb = copies["numpy"].row_bytes / 2 ** 20
    for m, rs in results.items():
        best = min(rs, key=lambda r: r["step_ms"])
        best["overhead_pct"] = (best["step_ms"] / base - 1) * 100
        rows.append([m, f"{best['step_ms']:.3f}", f"{best['overhead_pct']:.2f}", f"{best['evict_host_ms']:.3f}",
                     all(r["ok"] for r in rs)])
    print_table(["method", "ms a step", "overhead %", "host ms a step", "rows ok"], rows,
                title=f"{args.rows} rows of {row_mb:.2f} MiB evicted a step ({args.rows * row_mb:.0f} MiB)")
    summary = {f"overhead_pct_{m}": min(r["step_ms"] for r in rs) / base * 100 - 100 for m, rs in results.items()}
    write_results(args.name, summary, dict(args=vars(args), device=device_info(), results=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
