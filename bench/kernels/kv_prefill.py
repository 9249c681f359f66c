"""Prefill attention on compressed KV caches (issue #21): the prefill kernel reading each format in place (its two
warpgroups dequantize each block between their matmuls, paged_prefill_attention.py) against dequantizing the call's
pages first (one XLA gather + dequantize into a bfloat16 copy of just those pages, then the bfloat16 kernel over
it). Each query tile of a chunk re-reads and, in place, re-dequantizes the whole context before it, so the first
way repeats the dequantizing chunk / 32 times per kv head; the second does it once and writes 2 bytes a value.
Causal TFLOP/s by the kernels' own time (a profiler trace; on the CPU the call's time), one device call.

usage: python -m bench.kernels.kv_prefill [--kv-dtype bfloat16,fp8,int8,int4] [--shapes 2x1024@1024,...]
       [--variants "nw1=num_warpgroups=1;b64=block_kv=64+num_stages=3"] [--smoke]
`--variants`: more in-kernel ways, each the kernel with these keyword arguments (integers; bools as 0 / 1).
Writes <out>/kv_prefill-<YYYYMMDD>.json; summary keys prefill_tflops_<shape>_<fmt>[_<way>] (way: predeq, a variant).
"""
from __future__ import annotations

import argparse
import functools
import gc
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_info, print_table, write_results
from bench.kernels.kv_decode import interpret_on_cpu, make_cache, page_table, relerr
from bench.step_bench import kernel_us
from nfjax.config import pages_for
from pallas_kernels.kv_quant import dequantize_kv
from pallas_kernels.paged_prefill_attention import paged_prefill_attention

H, KVH, D = 32, 8, 128                   # Llama-3-8B's attention
KW = {}                                  # {"interpret": True} with --smoke
SHAPES = "2x1024@0,2x1024@1024,1x2048@2048,4x512@2048"      # sequences x chunk @ positions cached before it


def prefill_predequantized(q, k_cache, v_cache, layer, pt, lens, qs, first, *, scale, aux_cache, **kw):
    """The bfloat16 kernel over a bfloat16 copy of the pages `pt` names (every entry: [S, P] pages, the table's
    padding included), dequantized in one XLA pass; the table renumbered to the copy."""
    idx = pt.reshape(-1)
    k, v = dequantize_kv(k_cache[layer][idx], v_cache[layer][idx], aux_cache[layer][idx], jnp.bfloat16)
    table = jnp.arange(idx.shape[0], dtype=jnp.int32).reshape(pt.shape)
    return paged_prefill_attention(q, k[None], v[None], jnp.int32(0), table, lens, qs, first, scale=scale, **kw)


def parse_shapes(s: str) -> list[tuple[int, int, int]]:
    out = []
    for part in s.split(","):
        n, rest = part.split("x")
        chunk, ctx = rest.split("@")
        out.append((int(n), int(chunk), int(ctx)))
    return out


def parse_variants(s: str) -> dict[str, dict]:
    """"name=key=value+key=value;..." -> {name: {key: int value}}."""
    out = {}
    for part in [p for p in s.split(";") if p.strip()]:
        name, _, kws = part.partition("=")
        out[name.strip()] = {k: int(v) for k, v in (kw.split("=") for kw in kws.split("+") if kw)}
    return out


def prefill_case(fmt: str, nseq: int, chunk: int, ctx: int, ps: int, variants: dict | None = None) -> dict:
    qlens, lens = [chunk] * nseq, np.full(nseq, chunk + ctx)
    pages = nseq * pages_for(chunk + ctx, ps) + 2
    rng = np.random.default_rng(nseq * 7 + chunk + ctx)
    kc, vc, aux = make_cache(jax.random.key(nseq + chunk + ctx), fmt, pages, ps)
    pt = jnp.asarray(page_table(lens, pages, ps, rng))
    q = jax.random.normal(jax.random.key(3), (nseq * chunk, H, D), jnp.bfloat16)
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    args = (q, kc, vc, jnp.int32(0), pt, jnp.asarray(lens, jnp.int32), qs, jnp.int32(0))
    # causal FLOPs: a query at position p attends to p + 1 keys; QK and PV are 2 D each per (head, key)
    flops = nseq * 4 * H * D * sum(range(ctx + 1, ctx + chunk + 1))
    out = {"kv_dtype": fmt, "nseq": nseq, "chunk": chunk, "ctx_before": ctx, "page_size": ps, "flops": flops}
    ways = {"in_kernel": paged_prefill_attention}
    if aux is not None:
        ways["predeq"] = prefill_predequantized
    for name, kw in (variants or {}).items():
        ways[name] = functools.partial(paged_prefill_attention, **kw)
    results = {}
    for name, fn in ways.items():
        try:
            f = jax.jit(functools.partial(fn, scale=D ** -0.5, aux_cache=aux, **KW))
            t0 = time.perf_counter()
            results[name] = jax.block_until_ready(f(*args))
            out[f"{name}_first_call_s"] = time.perf_counter() - t0
            s = kernel_us(f, args, 1) / 1e6
            out[f"{name}_s"], out[f"{name}_tflops"] = s, flops / s / 1e12
        except Exception as ex:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            out[f"{name}_error"] = f"{type(ex).__name__}: {str(ex)[:400]}"
    for name in [n for n in results if n != "in_kernel" and "in_kernel" in results]:
        out[f"{name}_vs_in_kernel_relerr"] = relerr(results[name], results["in_kernel"])
    del kc, vc, aux, results
    gc.collect()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtype", default="bfloat16,fp8,int8,int4", help="comma-separated formats")
    ap.add_argument("--shapes", default=SHAPES, help="NSEQxCHUNK@CACHED,...")
    ap.add_argument("--variants", default="", help="NAME=key=value+key=value;... (more in-kernel ways)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="kv_prefill")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: interpret mode, tiny shapes")
    a = ap.parse_args(argv)
    global H, KVH
    if a.smoke:
        interpret_on_cpu()
        H, KVH = 8, 2
        KW["interpret"] = True
        a.shapes = "2x64@48"
    t0 = time.perf_counter()
    dev = device_info()
    print("device", dev, flush=True)
    variants = parse_variants(a.variants)
    rows, cases, summary = [], [], {}
    for nseq, chunk, ctx in parse_shapes(a.shapes):
        for fmt in [f for f in a.kv_dtype.split(",") if f]:
            r = prefill_case(fmt, nseq, chunk, ctx, a.page_size, variants)
            cases.append(r)
            shape = f"{nseq}x{chunk}@{ctx}"
            for way in ("in_kernel", "predeq", *variants):
                key = f"prefill_tflops_{shape}_{fmt}" + ("" if way == "in_kernel" else f"_{way}")
                if f"{way}_tflops" in r:
                    summary[key] = round(r[f"{way}_tflops"], 2)
                if f"{way}_s" in r or f"{way}_error" in r:
                    rows.append([shape, fmt, way, r.get(f"{way}_s", 0) * 1e3, r.get(f"{way}_tflops", 0),
                                 r.get(f"{way}_vs_in_kernel_relerr"), (r.get(f"{way}_error") or "")[:40]])
                    print(f"{shape} {fmt} {way}: {r.get(f'{way}_tflops', 0):.0f} TFLOP/s  "
                          f"[{time.perf_counter() - t0:.0f}s]", flush=True)
    table = print_table(["shape", "kv_dtype", "way", "ms", "TFLOP/s", "relerr vs in kernel", "error"], rows,
                        title=f"\n== prefill attention per KV format (H={H}, KVH={KVH}, D={D}, page {a.page_size}; "
                              f"predeq: the pages dequantized first) ==")
    write_results(a.name, summary, {"cases": cases, "table": table, "device": dev,
                                    "shape": {"heads": H, "kv_heads": KVH, "head_dim": D},
                                    "wall_s": time.perf_counter() - t0}, out_dir=a.out)


if __name__ == "__main__":
    main()
