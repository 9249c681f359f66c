"""Paged attention kernels on the GPU: correctness against the references, then decode bandwidth (vs a measured
device copy, side by side with the XLA reference and cuDNN paged attention), the decode kernel's time as a
function of its program count, and prefill TFLOP/s (vs the measured bf16 GEMM rate). One device call.

usage: python -m bench.kernels.attention [--quick] [--out DIR]
Writes <out>/attention-<YYYYMMDD>.json (+ .png); summary keys decode_bw_fraction_of_copy_4k,
prefill_tflops_fraction_of_gemm.
"""
from __future__ import annotations

import argparse
import functools
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_info, measure_copy_bandwidth, measure_gemm, print_table, save_plot, time_fn, \
    write_results
from nfjax.config import pages_for
from pallas_kernels import MASK_VALUE
from pallas_kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from pallas_kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

H, KVH, D = 32, 8, 128
DT = jnp.bfloat16
KW = {}          # extra kernel kwargs: {"interpret": True} in --smoke mode (CPU check of this script)


def log(*a):
    print(*a, flush=True)


def relerr(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def make_cache(key, layers, pages, ps):
    k1, k2 = jax.random.split(key)
    shape = (layers, pages, ps, KVH, D)
    return jax.random.normal(k1, shape, DT), jax.random.normal(k2, shape, DT)


def ragged_tables(rng, lens, ps, num_pages, reserve_zero=True):
    """Page tables giving each sequence distinct random pages."""
    p = max(1, max(pages_for(int(n), ps) for n in lens))
    first = 1 if reserve_zero else 0
    perm = rng.permutation(np.arange(first, num_pages))
    table = np.zeros((len(lens), p), np.int32)
    off = 0
    for i, n in enumerate(lens):
        k = pages_for(int(n), ps)
        table[i, :k] = perm[off:off + k]
        off += k
    assert off <= len(perm)
    return table


# ----------------------------------------------------------------------------------------------- checks
def check_decode(rng, ps, g, b=24, max_len=3000, **kw):
    if KW:
        b, max_len = 3, 200
    kvh = KVH
    lens = rng.integers(1, max_len, b)
    lens[0] = 0
    pages = int(sum(pages_for(n, ps) for n in lens)) + 2
    kc, vc = make_cache(jax.random.key(int(rng.integers(1 << 30))), 2, pages, ps)
    q = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (b, kvh * g, D), DT)
    pt = jnp.asarray(ragged_tables(rng, lens, ps, pages))
    lens = jnp.asarray(lens, jnp.int32)
    out = paged_decode_attention(q, kc, vc, jnp.int32(1), pt, lens, scale=D ** -0.5, **kw, **KW)
    ref = paged_decode_attention_ref(q, kc, vc, jnp.int32(1), pt, lens, D ** -0.5)
    return relerr(out.astype(jnp.float32), ref.astype(jnp.float32))


def check_prefill(rng, ps, g, **kw):
    qlens, ctx = ([700, 1, 130, 64], [0, 900, 33, 2000]) if not KW else ([40, 1, 9, 3], [0, 90, 3, 20])
    t = sum(qlens) + 5
    lens = np.array(qlens) + np.array(ctx)
    pages = int(sum(pages_for(n, ps) for n in lens)) + 2
    kc, vc = make_cache(jax.random.key(int(rng.integers(1 << 30))), 2, pages, ps)
    q = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (t, KVH * g, D), DT)
    pt = jnp.asarray(ragged_tables(rng, lens, ps, pages))
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    args = (q, kc, vc, jnp.int32(1), pt, jnp.asarray(lens, jnp.int32), qs, jnp.int32(1))
    out = paged_prefill_attention(*args, scale=D ** -0.5, **kw, **KW)
    ref = paged_prefill_attention_ref(*args, D ** -0.5)
    return relerr(out.astype(jnp.float32), ref.astype(jnp.float32))


def check_dispatch(rng, ps=16):
    """The engine's entry point on a mixed batch (3 decodes, 2 prefill chunks, padding)."""
    from nfjax.kv.attention import paged_attention
    from nfjax.kv.cache import KVCache
    from nfjax.kv.metadata import build_metadata
    specs = [(300, 1), (17, 1), (1000, 1), (0, 200), (450, 77)]      # (cached before, new tokens)
    num_tokens, max_seqs, max_pages = 320, 8, 128
    if KW:
        specs, num_tokens, max_seqs, max_pages = [(30, 1), (0, 20), (45, 7)], 32, 4, 8
    pages_needed = [pages_for(a + n, ps) for a, n in specs]
    kc, vc = make_cache(jax.random.key(int(rng.integers(1 << 30))), 2, sum(pages_needed) + 1, ps)
    perm = rng.permutation(np.arange(1, sum(pages_needed) + 1))
    seqs, off = [], 0
    for (a, n), k in zip(specs, pages_needed):
        seqs.append((perm[off:off + k].tolist(), a, n))
        off += k
    nd = next(i for i, (_, n) in enumerate(specs) if n != 1)
    meta = build_metadata(seqs, num_tokens, max_seqs, max_pages, ps, num_decode=nd).to_device()
    q = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (num_tokens, H, D), DT)
    kv = KVCache(kc, vc)
    f = jax.jit(functools.partial(paged_attention, scale=D ** -0.5), static_argnames=("use_kernels", "interpret"))
    out = f(q, kv, jnp.int32(1), meta, use_kernels=True, **KW)
    ref = f(q, kv, jnp.int32(1), meta, use_kernels=False)
    n_live = sum(n for _, n in specs)
    return relerr(out[:n_live].astype(jnp.float32), ref[:n_live].astype(jnp.float32))


def run_checks(quick, kinds):
    rng = np.random.default_rng(0)
    rows, res = [], {}
    cases = [("decode", 16, 4, {}), ("decode", 64, 4, {"num_splits": 3}), ("decode", 16, 1, {"num_ctas": 40}),
             ("decode", 64, 8, {"block_kv": 64, "num_stages": 4}), ("prefill", 16, 4, {}),
             ("prefill", 64, 8, {"num_ctas": 100, "num_warpgroups": 1}),
             ("prefill", 16, 1, {"block_kv": 64, "num_stages": 3}), ("prefill", 16, 4, {"pingpong": False}),
             ("prefill", 64, 8, {"num_stages": 3}), ("dispatch", 16, 4, {})]
    if quick:
        cases = cases[:2] + cases[4:5] + cases[7:8] + cases[-1:]
    for kind, ps, g, kw in cases:
        if kind not in kinds:
            continue
        name = f"{kind} ps={ps} G={g} {kw}"
        try:
            if kind == "decode":
                e = check_decode(rng, ps, g, **kw)
            elif kind == "prefill":
                e = check_prefill(rng, ps, g, **kw)
            else:
                e = check_dispatch(rng, ps)
        except Exception as ex:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            e = f"error: {type(ex).__name__}: {str(ex)[:300]}"
        res[name] = e
        rows.append([name, e if isinstance(e, str) else f"{e:.2e}",
                     "ok" if isinstance(e, float) and e < 1e-2 else "FAIL"])
    print_table(["check (vs f32 reference)", "rel err", ""], rows, title="\n== correctness on the device ==")
    return res


# ----------------------------------------------------------------------------------------------- decode
def xla_decode(q, kc, vc, layer, pt, lens, scale):
    """What plain XLA does with the same inputs: gather pages, bf16 einsums with f32 accumulation."""
    b, h, d = q.shape
    _, _, ps, kvh, _ = kc.shape
    p = pt.shape[1]
    k = kc[layer][pt].reshape(b, p * ps, kvh, d)
    v = vc[layer][pt].reshape(b, p * ps, kvh, d)
    qg = q.reshape(b, kvh, h // kvh, d)
    s = jnp.einsum("bkgd,blkd->bkgl", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where((jnp.arange(p * ps) < lens[:, None])[:, None, None, :], s, MASK_VALUE)
    w = jax.nn.softmax(s, -1).astype(q.dtype)
    return jnp.einsum("bkgl,blkd->bkgd", w, v, preferred_element_type=jnp.float32).reshape(b, h, d).astype(q.dtype)


def cudnn_paged_fn():
    try:
        from jax._src.cudnn.fused_attention_stablehlo import paged_attention as cp
    except ImportError as e:
        return None, repr(e)

    def f(q, kc, vc, pt, lens, scale):      # kc/vc have one layer: [0] is a free bitcast inside jit
        b = q.shape[0]
        return cp(q[:, None], kc[0], vc[0], jnp.ones((b,), jnp.int32), lens, pt[:, None, :, None], pt[:, None, :, None],
                  scale=scale)[:, 0]
    return f, None


def decode_case(b, ctx, ps, configs, with_xla, with_cudnn, iters):
    """Times each kernel config (and the peers) at batch b, every sequence `ctx` long."""
    p = pages_for(ctx, ps)
    n = b * p
    kc, vc = make_cache(jax.random.key(b * 7 + ctx), 1, n, ps)
    rng = np.random.default_rng(b + ctx)
    pt = jnp.asarray(rng.permutation(n).astype(np.int32).reshape(b, p))
    lens = jnp.full((b,), ctx, jnp.int32)
    qs = [jax.random.normal(jax.random.key(i), (b, H, D), DT) for i in range(2)]
    layer = jnp.int32(0)
    nbytes = 2 * b * ctx * KVH * D * 2 + 2 * b * H * D * 2
    scale = D ** -0.5
    out = {"batch": b, "ctx": ctx, "page_size": ps, "bytes": nbytes, "kernel": {}}
    ref = None
    for name, cfg in configs.items():
        try:
            f = jax.jit(functools.partial(paged_decode_attention, scale=scale, **cfg, **KW))
            t0 = time.perf_counter()
            o = jax.block_until_ready(f(qs[0], kc, vc, layer, pt, lens))
            comp = time.perf_counter() - t0
            if ref is None:
                ref = paged_decode_attention_ref(qs[0][:8], kc, vc, layer, pt[:8], lens[:8], scale)
            err = relerr(o[:8].astype(jnp.float32), ref.astype(jnp.float32)) if ref is not None else None
            t = time_fn(f, arg_sets=[(qq, kc, vc, layer, pt, lens) for qq in qs], iters=iters, reps=3)
            out["kernel"][name] = {"cfg": cfg, "s": t["median_s"], "bytes_per_s": nbytes / t["median_s"],
                                   "first_call_s": comp, "relerr_first8": err, **t}
        except Exception as ex:  # noqa: BLE001
            traceback.print_exc()
            out["kernel"][name] = {"cfg": cfg, "error": f"{type(ex).__name__}: {str(ex)[:400]}"}
    if with_xla:
        try:
            f = jax.jit(functools.partial(xla_decode, scale=scale))
            t = time_fn(f, arg_sets=[(qq, kc, vc, layer, pt, lens) for qq in qs], iters=max(3, iters // 4), reps=3)
            out["xla"] = {"s": t["median_s"], "bytes_per_s": nbytes / t["median_s"]}
        except Exception as ex:  # noqa: BLE001
            out["xla"] = {"error": f"{type(ex).__name__}: {str(ex)[:300]}"}
    if with_cudnn:
        cf, why = cudnn_paged_fn()
        if cf is None:
            out["cudnn"] = {"error": why}
        else:
            try:
                f = jax.jit(functools.partial(cf, scale=scale))
                o = jax.block_until_ready(f(qs[0], kc, vc, pt, lens))
                ref8 = paged_decode_attention_ref(qs[0][:8], kc, vc, layer, pt[:8], lens[:8], scale)
                err = relerr(o[:8].astype(jnp.float32), ref8.astype(jnp.float32))
                t = time_fn(f, arg_sets=[(qq, kc, vc, pt, lens) for qq in qs], iters=iters, reps=3)
                out["cudnn"] = {"s": t["median_s"], "bytes_per_s": nbytes / t["median_s"], "relerr_first8": err}
            except Exception as ex:  # noqa: BLE001
                out["cudnn"] = {"error": f"{type(ex).__name__}: {str(ex)[:400]}"}
    del kc, vc
    return out


def program_sweep(b, ctx, ps, programs, base_cfg, iters):
    p = pages_for(ctx, ps)
    n = b * p
    kc, vc = make_cache(jax.random.key(99), 1, n, ps)
    pt = jnp.asarray(np.random.default_rng(1).permutation(n).astype(np.int32).reshape(b, p))
    lens = jnp.full((b,), ctx, jnp.int32)
    q = jax.random.normal(jax.random.key(5), (b, H, D), DT)
    nbytes = 2 * b * ctx * KVH * D * 2
    rows = []
    for np_ in programs:
        cfg = dict(base_cfg, num_ctas=np_)
        try:
            f = jax.jit(functools.partial(paged_decode_attention, scale=D ** -0.5, **cfg, **KW))
            t = time_fn(f, q, kc, vc, jnp.int32(0), pt, lens, iters=iters, reps=3)
            rows.append({"programs": np_, "s": t["median_s"], "bytes_per_s": nbytes / t["median_s"], "cfg": cfg})
        except Exception as ex:  # noqa: BLE001
            rows.append({"programs": np_, "error": f"{type(ex).__name__}: {str(ex)[:300]}"})
    del kc, vc
    return rows


# ----------------------------------------------------------------------------------------------- prefill
def prefill_case(nseq, chunk, ctx, ps, cfg, iters):
    qlens, before = [chunk] * nseq, [ctx] * nseq
    lens = np.array(qlens) + np.array(before)
    t = nseq * chunk
    p = pages_for(int(lens.max()), ps)
    n = nseq * p + 1
    kc, vc = make_cache(jax.random.key(nseq * 31 + chunk), 1, n, ps)
    rng = np.random.default_rng(nseq + chunk)
    pt = jnp.asarray(ragged_tables(rng, lens, ps, n))
    q = jax.random.normal(jax.random.key(3), (t, H, D), DT)
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    args = (q, kc, vc, jnp.int32(0), pt, jnp.asarray(lens, jnp.int32), qs, jnp.int32(0))
    # causal FLOPs: each query at position pos attends to pos + 1 keys; QK and PV are 2*D each per (head, key)
    flops = sum(4 * H * D * sum(range(a + 1, a + c + 1)) for a, c in zip(before, qlens))
    out = {"nseq": nseq, "chunk": chunk, "ctx_before": ctx, "page_size": ps, "flops": flops, "cfg": cfg}
    try:
        f = jax.jit(functools.partial(paged_prefill_attention, scale=D ** -0.5, **cfg, **KW))
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        out["first_call_s"] = time.perf_counter() - t0
        tm = time_fn(f, *args, iters=iters, reps=3)
        out.update(s=tm["median_s"], tflops=flops / tm["median_s"] / 1e12)
    except Exception as ex:  # noqa: BLE001
        traceback.print_exc()
        out["error"] = f"{type(ex).__name__}: {str(ex)[:400]}"
    del kc, vc
    return out


# ----------------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="checks + a few timings (first look at a device)")
    ap.add_argument("--out", default=None, help="result folder (default bench/results)")
    ap.add_argument("--name", default="attention")
    ap.add_argument("--no-cudnn", action="store_true")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: interpret mode, tiny shapes")
    args = ap.parse_args()
    if args.smoke:
        global H, KVH
        H, KVH = 8, 2
        KW["interpret"] = True
        args.quick, args.no_cudnn = True, True
    t_start = time.perf_counter()
    dev = device_info()
    log("device", dev)
    nsm = 4 if KW else (dev.get("num_sms") or 132)
    quick = args.quick
    ps = args.page_size

    checks = run_checks(quick, ("decode",))
    copy = measure_copy_bandwidth((2 << 30) if not KW else (1 << 20), iters=10, reps=5)
    gemm = measure_gemm(8192 if not KW else 256, iters=10, reps=3)
    cbw = copy["bytes_per_s"]
    log(f"copy {cbw / 1e12:.2f} TB/s (read+write)  gemm {gemm['tflops']:.0f} TFLOP/s  [{time.perf_counter() - t_start:.0f}s]")

    default = {"num_ctas": nsm}
    configs = {"default": default,
               "bkv64_s4": dict(default, block_kv=64, num_stages=4),
               "bkv64_s3": dict(default, block_kv=64, num_stages=3),
               "2x_programs_bkv64_s2": dict(default, num_ctas=2 * nsm, block_kv=64, num_stages=2)}
    partial = {}

    def save():
        data = {"checks": checks, "copy": copy, "gemm": gemm, **partial,
                "shape": {"heads": H, "kv_heads": KVH, "head_dim": D, "dtype": "bfloat16"},
                "wall_s": time.perf_counter() - t_start}
        return write_results(args.name, {"partial": True}, data, out_dir=args.out)
    decode = []
    shapes = [(4, 256)] if KW else [(64, 4096), (256, 1024)] if quick else [(64, 1024), (64, 4096), (64, 16384), (256, 1024),
                                                          (256, 4096), (256, 16384)]
    for b, ctx in shapes:
        cfgs = configs if (quick or (b, ctx) == (64, 4096)) else {"default": default}
        r = decode_case(b, ctx, ps, cfgs, with_xla=b * ctx <= 256 * 4096, with_cudnn=not args.no_cudnn,
                        iters=10 if quick else 20)
        decode.append(r)
        log(f"decode b={b} ctx={ctx}: " + ", ".join(
            f"{k}={v.get('bytes_per_s', 0) / 1e12:.2f}TB/s" for k, v in r["kernel"].items())
            + f"  xla={r.get('xla', {}).get('bytes_per_s', 0) / 1e12:.2f}"
            + f"  cudnn={r.get('cudnn', {}).get('bytes_per_s', 0) / 1e12:.2f}  [{time.perf_counter() - t_start:.0f}s]")
        if "error" in r.get("cudnn", {}):
            log("  cudnn:", r["cudnn"]["error"][:300])
        partial["decode"] = decode
        save()
    if not KW:      # the same headline shape with 64-position pages
        r = decode_case(64, 4096, 64, {"default": default}, with_xla=False, with_cudnn=False, iters=20)
        r["note"] = "page_size 64"
        decode_ps64 = r
        log(f"decode b=64 ctx=4096 page 64: {r['kernel']['default'].get('bytes_per_s', 0) / 1e12:.2f} TB/s")
    else:
        decode_ps64 = None

    programs = [2, 4] if KW else [8, 16, 33, 66, 99, 132] if quick else [4, 8, 16, 24, 33, 48, 66, 88, 99, 112, 122, 132, 2 * nsm]
    programs = sorted({min(p, 2 * nsm) for p in programs} | {nsm})
    sweep = {f"b{b}_ctx{ctx}": program_sweep(b, ctx, ps, programs, dict(default), iters=10)
             for b, ctx in ([(4, 256)] if KW else [(64, 4096)] if quick else [(64, 4096), (256, 4096)])}
    log(f"program sweep done [{time.perf_counter() - t_start:.0f}s]")
    partial["program_sweep"] = sweep
    save()
    checks.update(run_checks(quick, ("prefill", "dispatch")))
    save()

    pre_cfgs = {"default": {}, "2wg_no_pingpong": {"pingpong": False}, "pingpong_s3": {"num_stages": 3},
                "1wg": {"num_warpgroups": 1}}
    pshapes = [(2, 64, 64)] if KW else [(4, 1024, 3072), (1, 4096, 0)] if quick else [(4, 1024, 3072), (1, 4096, 0), (8, 512, 0),
                                                               (2, 2048, 2048), (16, 256, 1024)]
    prefill = []
    for nseq, chunk, ctx in pshapes:
        for cname, cfg in pre_cfgs.items():
            r = prefill_case(nseq, chunk, ctx, ps, cfg, iters=10)
            r["config"] = cname
            prefill.append(r)
            log(f"prefill {nseq}x{chunk}@{ctx} {cname}: {r.get('tflops', 0):.0f} TFLOP/s  [{time.perf_counter() - t_start:.0f}s]")
            partial["prefill"] = prefill
        save()

    # ---- tables
    rows = []
    for r in decode:
        for name, k in r["kernel"].items():
            rows.append([r["batch"], r["ctx"], name, k.get("s", 0) * 1e3, k.get("bytes_per_s", 0) / 1e12,
                         k.get("bytes_per_s", 0) / cbw, r.get("xla", {}).get("bytes_per_s", 0) / 1e12 or None,
                         r.get("cudnn", {}).get("bytes_per_s", 0) / 1e12 or None, k.get("error", "")[:40]])
    print_table(["batch", "ctx", "config", "ms", "TB/s", "of copy", "XLA TB/s", "cuDNN TB/s", "error"], rows,
                title=f"\n== decode attention (H={H}, KVH={KVH}, D={D}, page {ps}); copy {cbw / 1e12:.2f} TB/s ==")
    for key, rs in sweep.items():
        print_table(["programs", "ms", "TB/s", "of copy"],
                    [[r["programs"], r.get("s", 0) * 1e3, r.get("bytes_per_s", 0) / 1e12,
                      r.get("bytes_per_s", 0) / cbw] for r in rs], title=f"\n== decode time vs program count, {key} ==")
    print_table(["seqs x chunk @ ctx", "config", "ms", "TFLOP/s", "of GEMM"],
                [[f"{r['nseq']}x{r['chunk']}@{r['ctx_before']}", r["config"], r.get("s", 0) * 1e3,
                  r.get("tflops", 0), r.get("tflops", 0) / gemm["tflops"]] for r in prefill],
                title=f"\n== prefill attention (causal, page {ps}); GEMM {gemm['tflops']:.0f} TFLOP/s ==")

    def best_frac(b, ctx):
        r = next((r for r in decode if (r["batch"], r["ctx"]) == (b, ctx)), None)
        if not r or "bytes_per_s" not in r["kernel"].get("default", {}):
            return None
        return r["kernel"]["default"]["bytes_per_s"] / cbw

    fr4 = [f for f in (best_frac(64, 4096), best_frac(256, 4096)) if f is not None]
    head = next((r for r in prefill if (r["nseq"], r["chunk"], r["ctx_before"]) == (4, 1024, 3072)
                 and r["config"] == "default" and "tflops" in r), None)
    summary = {
        "decode_bw_fraction_of_copy_4k": min(fr4) if fr4 else None,
        "decode_bw_fraction_of_copy_4k_b64": best_frac(64, 4096),
        "decode_bw_fraction_of_copy_4k_b256": best_frac(256, 4096),
        "prefill_tflops_fraction_of_gemm": head["tflops"] / gemm["tflops"] if head else None,
        "prefill_tflops_4x1024_at_3072": head["tflops"] if head else None,
        "copy_tb_s": cbw / 1e12, "gemm_tflops": gemm["tflops"],
        "checks_pass": all(isinstance(e, float) and e < 1e-2 for e in checks.values()),
        "quick": quick,
    }
    log("\nsummary", summary)
    data = {"checks": checks, "copy": copy, "gemm": gemm, "decode": decode, "decode_page64": decode_ps64,
            "program_sweep": sweep,
            "prefill": prefill, "shape": {"heads": H, "kv_heads": KVH, "head_dim": D, "dtype": "bfloat16"},
            "wall_s": time.perf_counter() - t_start}
    path = write_results(args.name, summary, data, out_dir=args.out)
    panels = [{"title": "decode bandwidth (default config)", "xlabel": "context", "ylabel": "TB/s", "logx": True,
               "series": {f"{who} b={b}": ([r["ctx"] for r in decode if r["batch"] == b],
                                           [r.get(who, {}).get("bytes_per_s", float('nan')) / 1e12 if who != "kernel" else
                                            r["kernel"]["default"].get("bytes_per_s", float('nan')) / 1e12
                                            for r in decode if r["batch"] == b])
                          for b in sorted({r["batch"] for r in decode}) for who in ("kernel", "xla", "cudnn")},
               "hlines": {"copy": cbw / 1e12}},
              {"title": "decode time vs program count", "xlabel": "programs", "ylabel": "ms", "logx": True,
               "series": {k: ([r["programs"] for r in rs if "s" in r], [r["s"] * 1e3 for r in rs if "s" in r])
                          for k, rs in sweep.items()}}]
    save_plot(path[:-5] + ".png", panels)


if __name__ == "__main__":
    main()
