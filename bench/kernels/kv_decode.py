"""Decode attention on compressed KV caches (issue #21), the kernel the engine runs (paged_decode_swapped.py, on
all SMs), per kv_dtype: correctness of every kernel on quantized caches against the references, then time and
bandwidth at context 1k/4k/16k, batch 64 and 256, with the bytes each format actually reads (values + aux rows +
queries) against the measured device copy, by the kernels' own time from a profiler trace (beside each call's time,
which holds the host's dispatch where that is longer). One device call; `bench/kernels/attention.py --kv-dtype` runs it.

usage: python -m bench.kernels.kv_decode [--kv-dtype bfloat16,fp8,int8,int4] [--quick] [--out DIR] [--smoke]
Writes <out>/attention_kv-<YYYYMMDD>.json (+ .png); summary keys decode_bw_fraction_of_copy_4k_<fmt>.
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_info, measure_copy_bandwidth, print_table, save_plot, time_fn, write_results
from bench.step_bench import kernel_us
from nfjax.config import pages_for
from pallas_kernels import kv_quant
from pallas_kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from pallas_kernels.paged_decode_swapped import paged_decode_attention_swapped

H, KVH, D = 32, 8, 128                   # Llama-3-8B's attention
KW = {}                                  # {"interpret": True} with --smoke (a CPU check of this script)


def log(*a):
    print(*a, flush=True)


def interpret_on_cpu() -> None:
    """--smoke's setup before the first device use. As tests/conftest.py: the interpreter runs each warpgroup's
    program on the CPU client's threads, and with the few threads of a 2-core machine's one device, warpgroups
    blocked in barrier waits starve the others (the swapped kernel on a quantized cache has 4): 8 host devices give
    it more."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def relerr(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.isfinite(out).all() else float("nan")


def make_cache(key, fmt, pages, ps, d=D, kvh=KVH):
    """One layer's cache in `fmt`, drawn directly in its stored form (no f32 copy of a 16 GB cache): fp8 from
    random bytes (NaN codes replaced), int8 / int4 random bytes, aux scales ~ 0.02, their centers ~ N(0, 0.1)."""
    ks = jax.random.split(key, 4)
    shape = (1, pages, ps, kvh, d)
    if fmt == "bfloat16":        # random bits: sign, exponent 2^-1..2^0, 7 mantissa bits (no f32 temporary)
        def bf(k):
            b = jax.random.bits(k, shape, jnp.uint16)
            return jax.lax.bitcast_convert_type((b & 0x807F) | 0x3F00, jnp.bfloat16)
        return bf(ks[0]), bf(ks[1]), None

    def vals(k):
        if fmt in kv_quant.GROUP_CODECS:
            b = jax.random.bits(k, shape[:-1] + (kv_quant.value_width(fmt, d),), jnp.uint8)
            return jax.lax.bitcast_convert_type(b, kv_quant.value_dtype(fmt, None))
        b = jax.random.bits(k, shape, jnp.uint8)
        b = jnp.where((b & 0x7F) == 0x7F, b ^ 1, b)
        return jax.lax.bitcast_convert_type(b, kv_quant.FP8)
    w = kv_quant.aux_width(fmt, d)
    aux = jax.random.uniform(ks[2], shape[:-1] + (w,), jnp.float32, 0.01, 0.03)
    if fmt in kv_quant.GROUP_CODECS:
        cen = 0.1 * jax.random.normal(ks[3], aux.shape)
        aux = jnp.where(jnp.arange(w) % 2 == 1, cen, aux)
    return vals(ks[0]), vals(ks[1]), aux.astype(jnp.bfloat16)


def read_bytes(fmt, b, ctx, d=D, kvh=KVH, h=H) -> int:
    """Bytes the decode kernel must read: every position's K, V and aux row of each kv head, and the queries."""
    return int(b * ctx * kvh * kv_quant.token_head_bytes(fmt, d, "bfloat16") + b * h * d * 2)


def page_table(lens, pages: int, ps: int, rng) -> np.ndarray:
    """[len(lens), P] int32: each sequence's pages for its length, dealt in order from a random permutation of pages
    1..pages - 1 (page 0 stays scratch), the rest of a row 0."""
    perm = rng.permutation(np.arange(1, pages))
    pt, off = np.zeros((len(lens), max(pages_for(int(n), ps) for n in lens)), np.int32), 0
    for i, n in enumerate(lens):
        k = pages_for(int(n), ps)
        pt[i, :k] = perm[off:off + k]
        off += k
    return pt


def check(rng, fmt, kernel, ps=16, g=4, d=D):
    b, max_len = (3, 200) if KW else (24, 3000)
    lens = rng.integers(1, max_len, b)
    lens[0] = 0
    pages = int(sum(pages_for(int(n), ps) for n in lens)) + 2
    kc, vc, aux = make_cache(jax.random.key(int(rng.integers(1 << 30))), fmt, pages, ps, d, kvh=2)
    q = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (b, 2 * g, d), jnp.bfloat16)
    pt = page_table(lens, pages, ps, rng)
    args = (q, kc, vc, jnp.int32(0), jnp.asarray(pt), jnp.asarray(lens, jnp.int32))
    ref = paged_decode_attention_ref(*args, d ** -0.5, aux_cache=aux)
    if kernel == "fused":
        from pallas_kernels.attention_beside_gemm import decode_attention_beside_gemm
        x = jax.random.normal(jax.random.key(1), (256, 512), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(2), (512, 512), jnp.bfloat16)
        out, y = decode_attention_beside_gemm(*args, x, (w, w), scale=d ** -0.5, attn_ctas=4 if KW else 33,
                                              aux_cache=aux, **KW)
        e = relerr(y[0].astype(jnp.float32), jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)))
        return max(relerr(out, ref), e)
    f = {"swapped": paged_decode_attention_swapped, "heads": paged_decode_attention}[kernel]
    extra = {"num_ctas": 3} if KW else {}
    return relerr(f(*args, scale=d ** -0.5, aux_cache=aux, **extra, **KW), ref)


def check_prefill(rng, fmt, ps=16, g=4, d=D):
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
    qlens, ctx = ([40, 1, 9, 3], [0, 90, 3, 20]) if KW else ([700, 1, 130, 64], [0, 900, 33, 2000])
    lens = np.add(qlens, ctx)
    pages = int(sum(pages_for(int(n), ps) for n in lens)) + 2
    kc, vc, aux = make_cache(jax.random.key(int(rng.integers(1 << 30))), fmt, pages, ps, d, kvh=2)
    q = jax.random.normal(jax.random.key(7), (sum(qlens) + 5, 2 * g, d), jnp.bfloat16)
    pt = page_table(lens, pages, ps, rng)
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    args = (q, kc, vc, jnp.int32(0), jnp.asarray(pt), jnp.asarray(lens, jnp.int32), qs, jnp.int32(1))
    out = paged_prefill_attention(*args, scale=d ** -0.5, aux_cache=aux, **KW)
    return relerr(out, paged_prefill_attention_ref(*args, d ** -0.5, aux_cache=aux))


def decode_case(fmt, b, ctx, ps, nsm, iters, live: int | None = None, **kw):
    """One timed call shape. `live`: only the first `live` rows hold `ctx` positions, the rest none (a mixed
    step's call: the kernel runs over max_seqs rows, the decodes first)."""
    live = b if live is None else min(live, b)
    p = pages_for(ctx, ps)
    n = live * p
    kc, vc, aux = make_cache(jax.random.key(b * 7 + ctx), fmt, n, ps)
    perm = np.random.default_rng(b + ctx).permutation(n).astype(np.int32).reshape(live, p)
    pt = jnp.asarray(np.concatenate([perm, np.zeros((b - live, p), np.int32)]))
    lens = jnp.asarray(np.where(np.arange(b) < live, ctx, 0).astype(np.int32))
    qs = [jax.random.normal(jax.random.key(i), (b, H, D), jnp.bfloat16) for i in range(2)]
    nbytes = read_bytes(fmt, live, ctx)
    out = {"kv_dtype": fmt, "batch": b, "live_rows": live, "ctx": ctx, "page_size": ps, "bytes": nbytes, "kw": kw}
    try:
        f = jax.jit(functools.partial(paged_decode_attention_swapped, scale=D ** -0.5, num_ctas=nsm, **kw, **KW))
        t0 = time.perf_counter()
        o = jax.block_until_ready(f(qs[0], kc, vc, jnp.int32(0), pt, lens, aux_cache=aux))
        out["first_call_s"] = time.perf_counter() - t0
        m = min(4, live)
        idx = pt[:m].reshape(-1)          # the reference on the first 4 sequences' pages only (it dequantizes)
        sub = jnp.arange(idx.shape[0], dtype=jnp.int32).reshape(m, -1)
        ref = paged_decode_attention_ref(qs[0][:m], kc[:, idx], vc[:, idx], jnp.int32(0), sub, lens[:m], D ** -0.5,
                                         aux_cache=None if aux is None else aux[:, idx])
        out["relerr_first4"] = relerr(o[:m], ref)
        t = time_fn(lambda qq: f(qq, kc, vc, jnp.int32(0), pt, lens, aux_cache=aux), arg_sets=[(qq,) for qq in qs],
                    iters=iters, reps=3)
        out.update(s=t["median_s"], bytes_per_s=nbytes / t["median_s"], timing=t)
        if jax.default_backend() == "gpu":     # the kernel's own time: `s` holds the host's dispatch when longer
            k = kernel_us(lambda: f(qs[1], kc, vc, jnp.int32(0), pt, lens, aux_cache=aux), (), 1) / 1e6
            out.update(kernel_s=k, kernel_bytes_per_s=nbytes / k)
    except Exception as ex:  # noqa: BLE001 - report and go on
        traceback.print_exc()
        out["error"] = f"{type(ex).__name__}: {str(ex)[:400]}"
    del kc, vc, aux
    gc.collect()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtype", default="bfloat16,fp8,int8,int4", help="comma-separated formats")
    ap.add_argument("--quick", action="store_true", help="checks + context 4k only")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--compare-dequant-wgs", action="store_true", help="also time one dequantizing warpgroup")
    ap.add_argument("--repeat", type=int, default=1,
                    help="--compare-dequant-wgs: time the consumer path and one dequantizer this many times, "
                         "alternating (fp8 at batch 64 was 0.48 ms in one process and 2.14 in another)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="attention_kv")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: interpret mode, tiny shapes")
    args = ap.parse_args()
    global H, KVH
    if args.smoke:
        interpret_on_cpu()
        H, KVH = 8, 2
        KW["interpret"] = True
        args.quick = True
    fmts = [f for f in args.kv_dtype.split(",") if f]
    t0 = time.perf_counter()
    dev = device_info()
    log("device", dev)
    nsm = 4 if KW else (dev.get("num_sms") or 132)
    rng = np.random.default_rng(0)
    checks = {}
    for fmt in ([] if args.no_checks else [f for f in fmts if f != "bfloat16"]):
        for kind in ("swapped", "heads", "prefill") + (() if KW else ("fused",)):   # no CPU interpreter for fused
            for g, d in ((4, 128), (8, 64)) if kind in ("swapped", "prefill") else ((4, 128),):
                name = f"{fmt} {kind} G={g} D={d}"
                try:
                    checks[name] = check_prefill(rng, fmt, g=g, d=d) if kind == "prefill" else \
                        check(rng, fmt, kind, g=g, d=d)
                except Exception as ex:  # noqa: BLE001
                    traceback.print_exc()
                    checks[name] = f"error: {type(ex).__name__}: {str(ex)[:300]}"
                log(f"check {name}: {checks[name]}  [{time.perf_counter() - t0:.0f}s]")
    copy = measure_copy_bandwidth((2 << 30) if not KW else (1 << 20), iters=10, reps=5)
    cbw = copy["bytes_per_s"]
    log(f"copy {cbw / 1e12:.2f} TB/s (read+write)")
    shapes = [(2, 256)] if KW else [(64, 4096), (256, 4096)] if args.quick else \
        [(64, 1024), (64, 4096), (64, 16384), (256, 1024), (256, 4096), (256, 16384)]
    decode, variants = [], []
    for b, ctx in shapes:
        for fmt in fmts:
            r = decode_case(fmt, b, ctx, args.page_size, nsm, iters=10 if args.quick else 20)
            decode.append(r)
            log(f"decode {fmt} b={b} ctx={ctx}: {r.get('s', 0) * 1e3:.3f} ms "
                f"{r.get('bytes_per_s', 0) / 1e12:.2f} TB/s = {r.get('bytes_per_s', 0) / cbw:.2f} of copy "
                f"relerr {r.get('relerr_first4')}  {r.get('error', '')[:200]}  [{time.perf_counter() - t0:.0f}s]")
    for rep in range(args.repeat if args.compare_dequant_wgs else 0):
        for fmt in [f for f in fmts if f != "bfloat16"]:
            for b, ctx in [s for s in shapes if s[1] == 4096] or shapes:
                for nd in ((0, 1) if args.repeat > 1 else (1,)):
                    r = decode_case(fmt, b, ctx, args.page_size, nsm, iters=10, dequant_wgs=nd)
                    r["repeat"] = rep
                    variants.append(r)
                    log(f"decode {fmt} b={b} ctx={ctx} dequant_wgs={nd} (repeat {rep}): {r.get('s', 0) * 1e3:.3f} "
                        f"ms {r.get('bytes_per_s', 0) / cbw:.2f} of copy {r.get('error', '')[:200]}")
    rows = [[r["kv_dtype"], r["batch"], r["ctx"], r.get("s", 0) * 1e3, r.get("kernel_s", 0) * 1e3, r["bytes"] / 1e9,
             rate(r) / 1e12, rate(r) / cbw, r.get("error", "")[:40]] for r in decode]
    table = print_table(["kv_dtype", "batch", "ctx", "ms a call", "kernel ms", "GB read", "TB/s", "of copy", "error"],
                        rows,
                        title=f"\n== decode attention, swapped kernel on {nsm} SMs (H={H}, KVH={KVH}, D={D}, page "
                              f"{args.page_size}); copy {cbw / 1e12:.2f} TB/s ==")
    summary = {"copy_tb_s": cbw / 1e12, "quick": args.quick,
               "checks_pass": all(isinstance(e, float) and e < 1e-2 for e in checks.values())}
    for fmt in fmts:
        fr = [rate(r) / cbw for r in decode if r["kv_dtype"] == fmt and r["ctx"] == 4096 and "s" in r]
        summary[f"decode_bw_fraction_of_copy_4k_{fmt}"] = min(fr) if fr else None
        for r in decode:
            if r["kv_dtype"] == fmt and "s" in r:
                summary[f"decode_ms_b{r['batch']}_ctx{r['ctx']}_{fmt}"] = round(r["s"] * 1e3, 4)
                if "kernel_s" in r:
                    summary[f"decode_kernel_ms_b{r['batch']}_ctx{r['ctx']}_{fmt}"] = round(r["kernel_s"] * 1e3, 4)
    for r in variants:                               # the slowest of the repeats: a stall shows, noise does not hide it
        if "s" in r:
            k = f"decode_ms_b{r['batch']}_ctx{r['ctx']}_{r['kv_dtype']}_dwgs{r['kw']['dequant_wgs']}_max"
            summary[k] = max(summary.get(k, 0.0), round(r["s"] * 1e3, 4))
    log("summary", summary)
    path = write_results(args.name, summary, {"checks": checks, "copy": copy, "decode": decode, "table": table,
                                              "dequant_wgs_runs": variants,
                                              "shape": {"heads": H, "kv_heads": KVH, "head_dim": D},
                                              "wall_s": time.perf_counter() - t0}, out_dir=args.out)
    save_plot(path[:-5] + ".png", [
        {"title": f"decode attention, batch {b}", "xlabel": "context", "ylabel": "fraction of copy bandwidth",
         "logx": True, "hlines": {"0.8": 0.8},
         "series": {fmt: ([r["ctx"] for r in decode if r["kv_dtype"] == fmt and r["batch"] == b and "s" in r],
                          [rate(r) / cbw for r in decode if r["kv_dtype"] == fmt and r["batch"] == b
                           and "s" in r]) for fmt in fmts}} for b in sorted({b for b, _ in shapes})])


def rate(r: dict) -> float:
    """Bytes read per second of a timed case: by the kernel's own time where a profiler trace gave it (on a GPU),
    else by the time a call took (which holds the host's dispatch where that is longer: ~0.3 ms a call on the
    H200's host, more than a batch-64 decode at context 1k reads in; bench/NOTES.md 30.4)."""
    return r.get("kernel_bytes_per_s") or r.get("bytes_per_s", 0.0)


if __name__ == "__main__":
    main()
