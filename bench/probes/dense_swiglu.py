"""Probe (#27): the dense MLP's gate/up GEMM and SwiGLU as the engine runs them (XLA's dot over the joined
[4096, 28672] weight, then `swiglu` over its two halves: an [M, 28672] array written and read back) against our
persistent Pallas GEMM with SwiGLU in its epilogue (the weight's gate and up columns interleaved in blocks of half
a tile; only the [M, 14336] result is written). Kernel time from profiler traces, weights rotated past L2.

Why: a 1024/512 mixed step (2,048 tokens) spends ~6 ms outside its GEMMs and attention (bench/NOTES.md 31.1); the
activation pass alone moves ~175 MB a layer there. The grouped (MoE) GEMM's epilogue gained 1.04-1.08x (27.1).

usage: python -m bench.probes.dense_swiglu [--tokens 16,64,128,256,384,512,1024,2048] [--configs 128x256_s4_ws]
CPU:   python -m bench.probes.dense_swiglu --smoke   (interpret mode, a small shape: the numbers only)
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_info, print_table, write_results
from bench.step_bench import kernel_us
from nfjax.models.llama import swiglu
from pallas_kernels.grouped_gemm_ref import interleave
from pallas_kernels.persistent_gemm import TILE_CONFIGS, persistent_gemm


def unfused(x, w):
    """The engine's path: one dot over [gate | up], then swiglu over the halves."""
    y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    h = w.shape[1] // 2
    return swiglu(y[:, :h], y[:, h:])


def fused(x, w_il, config, interpret=False):
    return persistent_gemm(x, w_il, config=config, act="swiglu", interpret=interpret)


def weight_sets(k: int, n: int, count: int):
    """(joined, interleaved by config block) weight sets; `count` copies rotate past L2."""
    sets = []
    for i in range(count):
        g, u = (jax.random.normal(jax.random.key(10 * i + j), (k, n // 2), jnp.bfloat16) * 0.02 for j in range(2))
        sets.append((jnp.concatenate([g, u], axis=1), g, u))
    return sets


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16,64,128,256,384,512,1024,2048")
    ap.add_argument("--configs", default="128x256_s4_ws")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--name", default="dense_swiglu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    k, n = (128, 512) if args.smoke else (4096, 28672)
    tokens = [136] if args.smoke else [int(t) for t in args.tokens.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    sets = weight_sets(k, n, 1 if args.smoke else args.copies)
    ils = {c: [interleave(g, u, TILE_CONFIGS[c].block_n // 2) for _, g, u in sets] for c in configs}
    rows, summary = [], {}
    for m in tokens:
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        f_ref = jax.jit(unfused)
        want = np.asarray(f_ref(x, sets[0][0]), np.float32)
        per = len(sets)

        def rot(fn, ws):
            return lambda: [fn(x, w) for w in ws]
        t_xla = kernel_us(rot(f_ref, [s[0] for s in sets]), (), per)
        row = {"tokens": m, "xla_us": t_xla}
        for c in configs:
            f = jax.jit(functools.partial(fused, config=c, interpret=args.smoke))
            got = np.asarray(f(x, ils[c][0]), np.float32)
            err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9))
            t = kernel_us(rot(f, ils[c]), (), per)
            row[c] = (t, err)
            summary[f"us_m{m}_{c}"] = round(t, 2)
        summary[f"us_m{m}_xla"] = round(t_xla, 2)
        rows.append(row)
        print(row, flush=True)
    table = print_table(["tokens", "XLA dot + swiglu us"] + [f"{c} us (x XLA, err)" for c in configs],
                        [[r["tokens"], r["xla_us"]] + [f"{r[c][0]:.1f} ({r['xla_us'] / r[c][0]:.2f}x, {r[c][1]:.1e})"
                                                       for c in configs] for r in rows],
                        title=f"\n== gate/up [{k}, {n}] + SwiGLU ==")
    write_results(args.name, summary, {"rows": rows, "table": table, "device": device_info()}, out_dir=args.out)


if __name__ == "__main__":
    main()
