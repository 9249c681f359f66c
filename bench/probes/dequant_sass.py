"""Probe (#21): where the quantized decode kernel's time goes. Times the swapped decode kernel per KV format (and
a variant without the scale arithmetic, `_kv_dequant.SKIP_MATH`) at batch 64 / 256, context 4k, alternating the
variants `--repeat` times (the kernel's own time from a profiler trace, beside a call's), and dumps each variant's
PTX, ptxas report and SASS (Mosaic GPU's MOSAIC_GPU_DUMP_* switches) under <out>/sass/<variant>-b<batch>/ so the
dequantizer's instructions can be counted on a CPU afterwards.

usage: python -m bench.probes.dequant_sass [--variants fp8,fp8:none,int8,int4,bfloat16] [--repeat 2] [--out DIR]
A variant is FORMAT[:SKIP+SKIP][@KW=V+KW=V], KW one of the kernel's block_kv / num_stages / dequant_wgs /
prefetch_pages / k_in_consumer / num_splits / fp8_mma / int8_mma / deq_tiles / row_sums (0 reduce, 1 wgmma) /
num_ctas (default the SM count) / pipeline / group_accs (e.g. int8@block_kv=64+num_stages=4,
int8@k_in_consumer=1+num_stages=4, int4@group_accs=1).
Skips are for timing only (wrong values: a large relerr shows a skip took effect): "none" skips the scale
arithmetic; "nodeq" the dequantizing warpgroups' loads, conversions and stores (their barriers stay); "nomma" the
consumer's wgmmas (its softmax stays). Not a skip: "direct" loads the dequantizers' 8-bit values straight into the
WGMMA layout (`_kv_dequant.CODE_LOAD`), e.g. int4:direct. SASS needs nvdisasm on the PATH, which the H200 image's Mosaic GPU did not
find: PTX and the ptxas report come back.
--no-dump: no PTX / SASS files.
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp

from bench.common import device_info, measure_copy_bandwidth, print_table, write_results
from bench.kernels import kv_decode
from pallas_kernels import _kv_dequant
from pallas_kernels import paged_decode_swapped as swapped
from pallas_kernels._mgpu import Ops

_dequant_block = swapped.dequant_block
DUMPS = ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_SASS", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_PTX")
KERNEL_KW = ("block_kv", "num_stages", "dequant_wgs", "prefetch_pages", "k_in_consumer", "num_splits", "fp8_mma",
             "int8_mma", "deq_tiles", "row_sums", "num_ctas", "pipeline", "group_accs")
ROW_SUMS = ("reduce", "wgmma")          # row_sums=0 / 1
SKIPS = ("none", "nodeq", "nomma")
MODES = ("direct",)             # not skips (right values): the dequantizers' 8-bit loads straight into WGMMA


def slug(variant: str) -> str:
    """A variant as a file-name and summary-key part: 'int8:none@num_stages=4' -> 'int8_none_num_stages4'."""
    for a, z in ((":", "_"), ("@", "_"), ("=", ""), ("+", "_")):
        variant = variant.replace(a, z)
    return variant


def parse_variant(variant: str) -> tuple[str, frozenset, dict]:
    """'int8:none@block_kv=64+num_stages=4' -> ('int8', {'none'}, {'block_kv': 64, 'num_stages': 4})."""
    name, _, kws = variant.partition("@")
    fmt, _, bits = name.partition(":")
    skips = frozenset(x for x in bits.split("+") if x)
    if not skips <= set(SKIPS) | set(MODES):
        raise ValueError(f"variant {variant!r}: FORMAT[:SKIP+SKIP] with SKIP in {SKIPS + MODES}, then @KW=V+KW=V")
    kw = {}
    for item in (x for x in kws.split("+") if x):
        k, _, v = item.partition("=")
        if k not in KERNEL_KW or not v.isdigit():
            raise ValueError(f"variant {variant!r}: {item!r} is not one of {KERNEL_KW} = an integer")
        kw[k] = ROW_SUMS[int(v)] if k == "row_sums" else int(v)
    return fmt, skips, kw


class _NoMatmulOps(Ops):
    """The swapped kernel's consumer without its wgmmas: scores of zeros, the accumulators passed through."""

    def scores(self, mma):
        z = self.wgmma_layout(jnp.zeros(mma.shape, jnp.float32))
        return z if mma.num_accs == 1 else (z,) * mma.num_accs

    def vp(self, acc, p, v_s, p_s):
        return acc

    def vp_sums_then(self, acc, sums, p, v_s, p_s, ones, mma=None):        # vp_and_sums too
        return acc, sums, None if mma is None else self.scores(mma)


def run_variant(variant: str, b: int, ctx: int, nsm: int, dump_dir: str | None, page_size: int = 16,
                live: int | None = None) -> dict:
    fmt, skips, kw = parse_variant(variant)
    nsm = kw.pop("num_ctas", nsm)       # e.g. two CTAs an SM where their SMEM and registers allow
    _kv_dequant.SKIP_MATH = "none" in skips
    _kv_dequant.CODE_LOAD = "direct" if "direct" in skips else "upcast"
    if "nodeq" in skips:                # the dequantizing warpgroups keep their barriers and touch no data
        swapped.dequant_block = lambda *a, **k: None
    if "nomma" in skips:
        swapped.Ops = _NoMatmulOps
    jax.clear_caches()              # the kernel's own jit would hand back the trace of the last variant
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        os.environ.update({"MOSAIC_GPU_DUMP_TO": dump_dir, "MOSAIC_GPU_DUMP_SASS": "1",
                           "MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_PTX": "1"})
    try:
        r = kv_decode.decode_case(fmt, b, ctx, page_size, nsm, iters=20, live=live, **kw)
    finally:
        for k in DUMPS:
            os.environ.pop(k, None)
        _kv_dequant.SKIP_MATH, _kv_dequant.CODE_LOAD = False, "upcast"
        swapped.dequant_block, swapped.Ops = _dequant_block, Ops
    r["variant"] = variant
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="fp8,fp8:none,int8,int8:none,int4,int4:none,bfloat16")
    ap.add_argument("--batches", default="256,64")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="dequant_sass")
    ap.add_argument("--no-dump", action="store_true")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--live-rows", type=int, default=None,
                    help="only this many rows hold the context, the rest none (a mixed step's call over max_seqs rows)")
    args = ap.parse_args()
    out_dir = args.out or "bench/results"
    dev = device_info()
    nsm = dev.get("num_sms") or 132
    cbw = measure_copy_bandwidth(2 << 30, iters=10, reps=5)["bytes_per_s"]
    print(f"device {dev}; copy {cbw / 1e12:.2f} TB/s", flush=True)
    variants = [v for v in args.variants.split(",") if v]
    runs, t0 = [], time.perf_counter()
    for rep in range(args.repeat):
        for b in [int(x) for x in args.batches.split(",")]:
            for v in variants:
                dump = None if rep or args.no_dump else os.path.join(out_dir, "sass", f"{slug(v)}-b{b}")
                r = run_variant(v, b, args.ctx, nsm, dump, args.page_size, args.live_rows)
                r["repeat"] = rep
                runs.append(r)
                print(f"{v} b={b} ctx={args.ctx} rep {rep}: {r.get('s', 0) * 1e3:.3f} ms a call, kernel "
                      f"{r.get('kernel_s', 0) * 1e3:.3f} ms {r.get('kernel_bytes_per_s', 0) / cbw:.2f} of copy "
                      f"relerr {r.get('relerr_first4')} "
                      f"{r.get('error', '')[:300]} [{time.perf_counter() - t0:.0f}s]", flush=True)
    rows = [[r["variant"], r["batch"], r["repeat"], r.get("s", 0) * 1e3, r.get("kernel_s", 0) * 1e3,
             r.get("kernel_bytes_per_s", 0) / cbw, r.get("relerr_first4")] for r in runs]
    table = print_table(["variant", "batch", "repeat", "ms a call", "kernel ms", "of copy", "relerr"], rows,
                        title=f"\n== swapped decode kernel, ctx {args.ctx}, page {args.page_size}, "
                              f"live rows {args.live_rows or 'all'}, copy {cbw / 1e12:.2f} TB/s ==")
    summary = {"copy_tb_s": cbw / 1e12}
    for r in runs:
        if "s" in r:
            k = f"ms_b{r['batch']}_{slug(r['variant'])}_min"
            summary[k] = round(min(summary.get(k, 1e9), r["s"] * 1e3), 4)
        if "kernel_s" in r:     # the kernel's own time (a call's time holds the host's dispatch when that is longer)
            k = f"kernel_ms_b{r['batch']}_{slug(r['variant'])}_min"
            summary[k] = round(min(summary.get(k, 1e9), r["kernel_s"] * 1e3), 4)
    write_results(args.name, summary, {"runs": runs, "table": table, "wall_s": time.perf_counter() - t0},
                  out_dir=args.out)


if __name__ == "__main__":
    main()
