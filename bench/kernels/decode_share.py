"""Decode attention on a share of the SMs: bandwidth against persistent program count for the heads-as-rows
kernel (pallas_kernels/paged_decode_attention.py) and the positions-as-rows one (paged_decode_swapped.py).
NanoFlow's overlap needs decode attention to reach HBM bandwidth on few SMs; this measures how few.
Correctness of both kernels on the device against the jnp reference comes first. One device call.

usage: python -m bench.kernels.decode_share [--out DIR] [--smoke]
Writes <out>/decode_share-<YYYYMMDD>.json (+ .png); summary: per kernel, TB/s at 33 and 132 programs and
the fewest programs reaching 90% of the measured copy bandwidth (8B heads, batch 256 x context 1280).
"""
from __future__ import annotations

import argparse
import functools
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_info, measure_copy_bandwidth, print_table, save_plot, time_fn, write_results
from nfjax.config import pages_for
from pallas_kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from pallas_kernels.paged_decode_swapped import paged_decode_attention_swapped

KERNELS = {"heads": paged_decode_attention, "swapped": paged_decode_attention_swapped}
# name -> (kernel, kwargs); the heads kernel's default is its measured best (bench/kernels/attention.py)
CONFIGS = {"heads_bkv128_s2": ("heads", {}),
           "swapped_bkv128_s2": ("swapped", {"num_stages": 2}),
           "swapped_bkv128_s3": ("swapped", {"num_stages": 3}),
           "swapped_bkv192_s2": ("swapped", {"block_kv": 192, "num_stages": 2}),
           "swapped_bkv64_s4": ("swapped", {"block_kv": 64, "num_stages": 4})}
H, KVH, D = 32, 8, 128
# the swapped kernel's softmax-denominator variants (see paged_decode_swapped.attention_kernel); its copy-only and
# L2 probes (bench/results/decode_share-{probe,ablate}-fused-20261123.json) left the kernel after those runs
VARIANTS = {"kernel": {}, "kernel_reduce_sums": {"row_sums": "reduce"}}


def log(*a):
    print(*a, flush=True)


def cache_case(b, ctx, ps, seed, ragged=False, interpret=False, cache_gb: float = 0.0):
    """Queries, K/V caches, page table and lengths. `cache_gb`: make each of K and V at least this large, with
    the batch's pages scattered over all of it (as in an engine's cache) instead of packed together."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, ctx + 1, b) if ragged else np.full(b, ctx)
    if ragged:
        lens[0] = 0
    pages = [pages_for(int(n), ps) for n in lens]
    p = max(1, max(pages))
    used = sum(pages)
    n = max(used + 1, int(cache_gb * 2 ** 30 / (ps * KVH * D * 2)))
    perm = rng.permutation(np.arange(1, n))[:used]
    table = np.zeros((b, p), np.int32)
    off = 0
    for i, k in enumerate(pages):
        table[i, :k] = perm[off:off + k]
        off += k
    # zeros, with the batch's pages (random values) where the page table puts them
    kc, vc = (jnp.zeros((1, n, ps, KVH, D), jnp.bfloat16).at[:, jnp.asarray(perm)].set(
        jax.random.normal(jax.random.key(seed + j), (1, used, ps, KVH, D), jnp.bfloat16)) for j in (0, 1))
    q = jax.random.normal(jax.random.key(seed + 2), (b, H, D), jnp.bfloat16)
    return q, kc, vc, jnp.asarray(table), jnp.asarray(lens, jnp.int32)


def relerr(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.isfinite(out).all() else float("nan")


def checks(kw) -> dict:
    res = {}
    b, ctx = (3, 100) if kw else (24, 3000)
    for ps in (16, 64):
        q, kc, vc, pt, lens = cache_case(b, ctx, ps, seed=ps, ragged=True)
        ref = paged_decode_attention_ref(q, kc, vc, jnp.int32(0), pt, lens, D ** -0.5)
        for name, (kern, cfg) in CONFIGS.items():
            try:
                out = KERNELS[kern](q, kc, vc, jnp.int32(0), pt, lens, scale=D ** -0.5, num_ctas=40, **cfg,
                                    **kw)
                res[f"{name} ps={ps}"] = relerr(out.astype(jnp.float32), ref.astype(jnp.float32))
            except Exception as ex:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                res[f"{name} ps={ps}"] = f"error: {type(ex).__name__}: {str(ex)[:300]}"
    print_table(["check vs f32 reference (ragged, one empty)", "rel err"],
                [[k, v if isinstance(v, str) else f"{v:.2e}"] for k, v in res.items()], title="\n== correctness ==")
    return res


def sweep(b, ctx, ps, programs, kw) -> dict:
    q, kc, vc, pt, lens = cache_case(b, ctx, ps, seed=7)
    q2 = q[::-1]
    nbytes = 2 * b * ctx * KVH * D * 2
    out = {"batch": b, "ctx": ctx, "page_size": ps, "bytes": nbytes, "rows": {}}
    for name, (kern, cfg) in CONFIGS.items():
        rows = []
        for p in programs:
            try:
                f = jax.jit(functools.partial(KERNELS[kern], scale=D ** -0.5, num_ctas=p, **cfg, **kw))
                t = time_fn(f, arg_sets=[(qq, kc, vc, jnp.int32(0), pt, lens) for qq in (q, q2)], iters=10, reps=3)
                rows.append({"programs": p, "s": t["median_s"], "bytes_per_s": nbytes / t["median_s"]})
            except Exception as ex:  # noqa: BLE001
                traceback.print_exc()
                rows.append({"programs": p, "error": f"{type(ex).__name__}: {str(ex)[:300]}"})
        out["rows"][name] = rows
        log(f"b={b} ctx={ctx} ps={ps} {name}: "
            + " ".join(f"{r['programs']}:{r.get('bytes_per_s', 0) / 1e12:.2f}" for r in rows))
    return out


def variant_table(kw, programs, page_sizes, cache_gb: float = 0.0, names=None) -> list[dict]:
    """The swapped kernel alone on `programs` SMs, per variant: TB/s of K/V streamed (batch 256 x context
    1280)."""
    b, ctx = (4, 64) if kw else (256, 1280)
    rows = []
    for ps in page_sizes:
        q, kc, vc, pt, lens = cache_case(b, ctx, ps, seed=5, cache_gb=cache_gb)
        # the reference reads the whole cache in f32: no check on a large one
        ref = None if cache_gb else paged_decode_attention_ref(q, kc, vc, jnp.int32(0), pt, lens, D ** -0.5)
        nbytes = 2 * b * ctx * KVH * D * 2
        for name, cfg in ((n, VARIANTS[n]) for n in (names or VARIANTS)):
            for p in ((2,) if kw else programs):
                r = {"page_size": ps, "variant": name, "programs": p}
                try:
                    f = jax.jit(functools.partial(paged_decode_attention_swapped, scale=D ** -0.5, num_ctas=p,
                                                  **cfg, **kw))
                    out = f(q, kc, vc, jnp.int32(0), pt, lens)
                    if ref is not None:
                        r["relerr"] = relerr(out.astype(jnp.float32), ref.astype(jnp.float32))
                    t = time_fn(f, q, kc, vc, jnp.int32(0), pt, lens, iters=10, reps=3)["median_s"]
                    r.update(ms=t * 1e3, tbs=nbytes / t / 1e12, gbs_per_sm=nbytes / t / 1e9 / p)
                except Exception as ex:  # noqa: BLE001
                    traceback.print_exc()
                    r["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
                rows.append(r)
                log("variant " + ", ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}"
                                           for k_, v in r.items()))
    return rows


def fused_pairs(kw, programs=(22, 33, 44, 55), page_sizes=(16,), widths=(14336, 28672),
                spreads=(True,), configs=(None,)) -> list[dict]:
    """Decode attention (8B heads, batch 256 x context 1280) beside an MLP GEMM of the other 1792 tokens, in
    one kernel (pallas_kernels/attention_beside_gemm.py), against the two kernels one after the other on all
    SMs. Also each part alone on the programs it gets in the fused kernel (attention on A, the GEMM on the
    rest): the larger of the two is what the fused kernel would take if the halves did not slow each other.
    Outputs are checked against the separate kernels."""
    from pallas_kernels.attention_beside_gemm import decode_attention_beside_gemm
    from pallas_kernels.persistent_gemm import persistent_gemm
    from nfjax.compat import num_sms
    b, ctx, m, k = (4, 64, 128, 128) if kw else (256, 1280, 1792, 4096)
    x = jax.random.normal(jax.random.key(12), (m, k), jnp.bfloat16)
    rows = []
    for ps in page_sizes:
        q, kc, vc, pt, lens = cache_case(b, ctx, ps, seed=11)
        attn_at, gemm_at = {}, {}

        def attn_ms(a):
            if a not in attn_at:
                f = jax.jit(functools.partial(paged_decode_attention_swapped, scale=D ** -0.5, num_ctas=a,
                                              **kw))
                attn_at[a] = time_fn(f, q, kc, vc, jnp.int32(0), pt, lens, iters=10, reps=3)["median_s"] * 1e3
            return attn_at[a]

        attn = jax.jit(functools.partial(paged_decode_attention_swapped, scale=D ** -0.5, **kw))
        ref_o = attn(q, kc, vc, jnp.int32(0), pt, lens)
        t_attn = time_fn(attn, q, kc, vc, jnp.int32(0), pt, lens, iters=10, reps=3)["median_s"]
        for n in ((256,) if kw else widths):
            w = jax.random.normal(jax.random.key(13), (k, n), jnp.bfloat16) * 0.02
            gemm = jax.jit(functools.partial(persistent_gemm, **kw))
            xla = jax.jit(jnp.dot)
            ref_y = gemm(x, w)
            t_gemm = time_fn(gemm, x, w, iters=10, reps=3)["median_s"]
            t_xla = time_fn(xla, x, w, iters=10, reps=3)["median_s"]
            for a, spread, cf in [(a, sp, cf) for a in ((2,) if kw else programs) for sp in spreads
                                  for cf in configs]:
                r = {"page_size": ps, "n": n, "attn_programs": a, "spread": spread, "gemm_config": cf or "default",
                     "attn_alone_ms": t_attn * 1e3,
                     "gemm_alone_ms": t_gemm * 1e3, "xla_gemm_ms": t_xla * 1e3}
                try:
                    if not kw:     # each half alone on its own share of the SMs
                        if (n, a) not in gemm_at:
                            g_a = jax.jit(functools.partial(persistent_gemm, num_ctas=num_sms() - a))
                            gemm_at[n, a] = time_fn(g_a, x, w, iters=10, reps=3)["median_s"] * 1e3
                        r["attn_on_share_ms"], r["gemm_on_share_ms"] = attn_ms(a), gemm_at[n, a]
                    tiny = {"gemm_ctas": 1, "block_kv": 64} if kw else {}
                    f = jax.jit(functools.partial(decode_attention_beside_gemm, scale=D ** -0.5, attn_ctas=a,
                                                  spread=spread, **({"config": cf} if cf else {}), **tiny, **kw))
                    o, y = f(q, kc, vc, jnp.int32(0), pt, lens, x, w)
                    r["relerr_attn"], r["relerr_gemm"] = relerr(o, ref_o), relerr(y, ref_y)
                    t = time_fn(f, q, kc, vc, jnp.int32(0), pt, lens, x, w, iters=10, reps=3)["median_s"]
                    r.update(fused_ms=t * 1e3, serial_ms=(t_attn + t_gemm) * 1e3, gain=(t_attn + t_gemm) / t,
                             gain_vs_xla_gemm=(t_attn + t_xla) / t)
                    if "gemm_on_share_ms" in r:
                        r["fused_vs_halves"] = t * 1e3 / max(r["attn_on_share_ms"], r["gemm_on_share_ms"])
                except Exception as ex:  # noqa: BLE001
                    traceback.print_exc()
                    r["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
                rows.append(r)
                log(f"fused ps={ps} n={n} attn_programs={a}: " + ", ".join(
                    f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in r.items()))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="decode_share")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script (interpret mode, tiny)")
    ap.add_argument("--fused-only", action="store_true", help="only the fused attention + GEMM table")
    ap.add_argument("--fused-programs", default="22,33,44,55", help="attention programs in the fused table")
    ap.add_argument("--fused-page-sizes", default="16", help="KV page sizes in the fused table")
    ap.add_argument("--fused-spread", default="1",
                    help="1 (the kernel's default), 0 or 0,1: attention programs spread over the grid")
    ap.add_argument("--fused-widths", default="14336,28672", help="GEMM N in the fused table (K=4096, M=1792)")
    ap.add_argument("--fused-configs", default="",
                    help="GEMM tile configs of the fused kernel (names in persistent_gemm.TILE_CONFIGS; default: its "
                         "own)")
    ap.add_argument("--cache-gb", type=float, default=0.0,
                    help="variants table: K and V caches of at least this many GiB each, the batch's pages "
                         "scattered over them (default: just the batch's pages); no reference check then")
    ap.add_argument("--variants", default=None,
                    help="also (before the fused table) the swapped kernel's variants alone on these "
                         "program counts, e.g. 22,33,44,132")
    ap.add_argument("--variant-names", default=None,
                    help=f"only these variants, comma-separated (of {', '.join(VARIANTS)})")
    args = ap.parse_args()
    names = args.variant_names.split(",") if args.variant_names else None
    if names and set(names) - set(VARIANTS):
        ap.error(f"--variant-names: unknown {sorted(set(names) - set(VARIANTS))}; known: {', '.join(VARIANTS)}")
    kw = {"interpret": True} if args.smoke else {}
    t0 = time.perf_counter()
    ints = lambda v: tuple(int(x) for x in v.split(","))      # noqa: E731
    variants = (variant_table(kw, ints(args.variants), ints(args.fused_page_sizes), args.cache_gb, names)
                if args.variants else None)
    if variants:
        print_table(["page", "variant", "programs", "ms", "TB/s", "GB/s per SM", "rel err"],
                    [[r["page_size"], r["variant"], r["programs"], r.get("ms"), r.get("tbs"), r.get("gbs_per_sm"),
                      r.get("relerr", r.get("error"))] for r in variants],
                    title="\n== swapped decode kernel alone: variants ==")
    if args.fused_only:
        rows = fused_pairs(kw, ints(args.fused_programs), ints(args.fused_page_sizes), ints(args.fused_widths),
                           tuple(bool(v) for v in ints(args.fused_spread)),
                           tuple(args.fused_configs.split(",")) if args.fused_configs else (None,))
        ok = [r for r in rows if "gain" in r]
        summary = {"fused_best_gain": max((r["gain"] for r in ok), default=None),
                   "fused_best_gain_vs_xla_gemm": max((r["gain_vs_xla_gemm"] for r in ok), default=None)}
        print_table(["page", "N", "attn progs", "spread", "gemm config", "attn ms", "gemm ms", "XLA gemm ms",
                     "attn on A", "gemm on rest", "fused ms", "fused/halves", "gain", "gain vs XLA", "err attn",
                     "err gemm"],
                    [[r["page_size"], r["n"], r["attn_programs"], r["spread"], r["gemm_config"], r["attn_alone_ms"],
                      r["gemm_alone_ms"], r["xla_gemm_ms"], r.get("attn_on_share_ms"), r.get("gemm_on_share_ms"),
                      r.get("fused_ms"), r.get("fused_vs_halves"), r.get("gain"), r.get("gain_vs_xla_gemm"),
                      r.get("relerr_attn"), r.get("relerr_gemm")] for r in rows],
                    title="\n== decode attention beside a GEMM, one kernel ==")
        path = write_results(args.name + "-fused", summary,
                             {"device": device_info(), "fused": rows, "variants": variants}, out_dir=args.out)
        log(f"wrote {path}  [{time.perf_counter() - t0:.0f}s]")
        return
    data = {"device": device_info(), "checks": checks(kw)}
    copy = measure_copy_bandwidth((2 << 30) if not kw else (1 << 20), iters=10, reps=5)
    cbw = data["copy_bytes_per_s"] = copy["bytes_per_s"]
    log(f"copy {cbw / 1e12:.2f} TB/s  [{time.perf_counter() - t0:.0f}s]")
    programs = [2, 4] if kw else [16, 22, 33, 44, 66, 99, 132]
    cases = [(4, 64, 16)] if kw else [(256, 1280, 16), (64, 4096, 16), (256, 1280, 64)]
    data["sweeps"] = []
    summary = {}
    for b, ctx, ps in cases:
        data["sweeps"].append(sweep(b, ctx, ps, programs if ps == 16 else programs[2:], kw))
        write_results(args.name, {"partial": True}, data, out_dir=args.out)
    head = data["sweeps"][0]
    for name, rows in head["rows"].items():
        ok = [r for r in rows if "bytes_per_s" in r]
        by = {r["programs"]: r["bytes_per_s"] for r in ok}
        summary[f"{name}_tbs_33"] = by.get(33, 0) / 1e12 or None
        summary[f"{name}_tbs_full"] = by.get(programs[-1], 0) / 1e12 or None
        summary[f"{name}_programs_for_90pct_copy"] = min((p for p, v in by.items() if v >= 0.9 * cbw), default=None)
    summary["copy_tbs"] = cbw / 1e12
    for s in data["sweeps"]:
        names = list(s["rows"])
        progs = [r["programs"] for r in s["rows"][names[0]]]
        rows = [[p] + [next((r.get("bytes_per_s", 0) / 1e12 for r in s["rows"][n] if r["programs"] == p), None)
                       for n in names] for p in progs]
        print_table(["programs"] + [f"{n} TB/s" for n in names], rows,
                    title=f"\n== decode b={s['batch']} ctx={s['ctx']} page {s['page_size']}; copy {cbw / 1e12:.2f} TB/s ==")
    path = write_results(args.name, summary, data, out_dir=args.out)
    save_plot(path.replace(".json", ".png"), [
        {"title": f"decode b={s['batch']} ctx={s['ctx']} page {s['page_size']}", "xlabel": "programs (SMs)",
         "ylabel": "TB/s", "hlines": {"copy": cbw / 1e12},
         "series": {n: ([r["programs"] for r in rs if "bytes_per_s" in r],
                        [r["bytes_per_s"] / 1e12 for r in rs if "bytes_per_s" in r]) for n, rs in s["rows"].items()}}
        for s in data["sweeps"]])
    log(f"wrote {path}  [{time.perf_counter() - t0:.0f}s]")


if __name__ == "__main__":
    main()
