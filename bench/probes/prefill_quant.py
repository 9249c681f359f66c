"""Probe: the prefill kernel on each KV format, a mixed step's prefill part (8B heads: 32 query / 8 kv heads, head_dim
128; a 1024/512 step: 248 tokens after 776 cached, 1,024 and 520 fresh). Quantized caches with one warpgroup a
64-row tile dequantizing K and V, or two sharing a 128-row tile (one dequantizes K, the other V:
`num_warpgroups=2`); bfloat16 with its default two ping-pong warpgroups, for the gap. Kernel time from a profiler
trace, error against the reference on the same call.

usage: python -m bench.probes.prefill_quant --formats bfloat16,fp8,int8,int4 --out $OUT
CPU:   python -m bench.probes.prefill_quant --smoke --formats fp8
"""
from __future__ import annotations

import argparse
import functools
import time

import numpy as np


def case(fmt: str, qlens, ctx, ps: int = 16, smoke: bool = False):
    """(kernel args, aux cache, head_dim) over fresh random pages in `fmt`."""
    import jax
    import jax.numpy as jnp
    from bench.kernels.kv_decode import make_cache, page_table
    from nfjax.config import pages_for
    lens = np.add(qlens, ctx)
    pages = int(sum(pages_for(int(n), ps) for n in lens)) + 2
    kvh, g, d = (2, 4, 64) if smoke else (8, 4, 128)
    kc, vc, aux = make_cache(jax.random.key(3), fmt, pages, ps, d, kvh=kvh)
    q = jax.random.normal(jax.random.key(7), (sum(qlens), kvh * g, d), jnp.bfloat16)
    pt = page_table(lens, pages, ps, np.random.default_rng(0))
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    return (q, kc, vc, jnp.int32(0), jnp.asarray(pt), jnp.asarray(lens, jnp.int32), qs, jnp.int32(0)), aux, d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bfloat16,fp8,int8,int4")
    ap.add_argument("--name", default="prefill_quant")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU: interpret mode, small shapes")
    args = ap.parse_args()
    import jax
    from bench.common import device_info, print_table, write_results
    from bench.kernels.kv_decode import relerr
    from bench.step_bench import kernel_us
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
    qlens, ctx = ([24, 40, 12], [40, 0, 0]) if args.smoke else ([248, 1024, 520], [776, 0, 0])
    rows, runs = [], []
    for fmt in args.formats.split(","):
        a, aux, d = case(fmt, qlens, ctx, smoke=args.smoke)
        ref = paged_prefill_attention_ref(*a, d ** -0.5, aux_cache=aux)
        for nw in ((None,) if fmt == "bfloat16" else (1, 2)):
            kw = {"interpret": True} if args.smoke else {}
            f = jax.jit(functools.partial(paged_prefill_attention, scale=d ** -0.5, aux_cache=aux,
                                          num_warpgroups=nw, **kw))
            r = {"format": fmt, "warpgroups": nw or 2}
            try:
                t0 = time.perf_counter()
                out = jax.block_until_ready(f(*a))
                r["first_call_s"] = time.perf_counter() - t0
                r["relerr"] = relerr(out, ref)
                r["kernel_ms"] = kernel_us(f, a, 1) / 1e3
            except Exception as e:  # noqa: BLE001 - report and go on
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            runs.append(r)
            rows.append([fmt, r["warpgroups"], r.get("kernel_ms", 0), r.get("relerr"), r.get("error", "")[:60]])
            print(r, flush=True)
    print_table(["format", "warpgroups", "ms", "relerr", "error"], rows,
                title=f"== prefill kernel per KV format: chunks {qlens} after {ctx} ==")
    summary = {f"prefill_ms_{r['format']}_wg{r['warpgroups']}": round(r["kernel_ms"], 4)
               for r in runs if "kernel_ms" in r}
    write_results(args.name, summary, {"runs": runs, "qlens": qlens, "ctx": ctx, "device": device_info()},
                  out_dir=args.out)


if __name__ == "__main__":
    main()
