"""Probe (#21): the cost of int4's Hadamard rotation where the engine runs it, per way of computing it.

int4 stores K and V rotated, so attention takes its queries rotated (after RoPE) and rotates its outputs back
(before o_proj; `pallas_kernels.kv_quant.rotate`). On the H200 a 2,048-token mixed step's rotations took 7 ms of
68 as f32 "highest" dots, 2.4 ms once a 16-bit input went through H's +-1 signs on the tensor cores
(bench/NOTES.md 37.2): still ~30 us a layer for a [2048 x 32, 128] x [128, 128] product that moves 32 MB (~8 us at
copy rate). Each way is timed in both of its places, against the same place without it (kernel time from a
profiler trace, so the difference is the rotation's cost with whatever XLA fused around it):
  * `q`: the q slice of the joined q/k/v output -> RoPE -> rotation (what `rotate_queries` sees);
  * `out`: attention's output -> rotation -> o_proj's GEMM.
Ways: `f32` (the old f32 "highest" dot), `signs` (shipped: +-1 signs in bf16, f32 sums, scaled after),
`signs_bf16` (the same dot's result in bf16, scaled in bf16), `unnorm` (no scale: 1/sqrt(D) folded into the
softmax scale or W_o), `fwht` (the fast Walsh-Hadamard transform: log2(D) butterfly stages of adds in f32),
`barrier` (`signs` behind an optimization barrier, so XLA cannot fuse RoPE into the GEMM's prologue).

usage: python -m bench.probes.rotation [--tokens 384,2048] [--ways f32,signs,signs_bf16,unnorm,fwht,barrier]
CPU:   python -m bench.probes.rotation --smoke   (a small shape: the errors, wall-clock numbers only)
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.common import device_info, parse_choices, print_table, write_results
from bench.step_bench import kernel_us
from nfjax.models.rope import apply_rope
from pallas_kernels.kv_quant import hadamard, rotate

WAYS = ("f32", "signs", "signs_bf16", "unnorm", "fwht", "barrier")


def _signs(x, out_dtype):
    d = x.shape[-1]
    return jnp.dot(x, jnp.asarray(np.sign(hadamard(d)), x.dtype), preferred_element_type=out_dtype)


def _fwht(x):
    """x @ H by butterflies: stage s pairs entries s apart (Sylvester order, the same H as `hadamard`)."""
    d = x.shape[-1]
    y, s = x.astype(jnp.float32), d // 2
    while s >= 1:
        y = y.reshape(*x.shape[:-1], d // (2 * s), 2, s)
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2)
        s //= 2
    return (y.reshape(x.shape) * np.float32(1 / np.sqrt(d))).astype(x.dtype)


def rotate_by(way: str, x):
    """x [..., D] (D a power of 2) rotated by the normalized H, computed `way` (`unnorm`: times sqrt(D))."""
    d = x.shape[-1]
    if way == "f32":
        return rotate(x.astype(jnp.float32), x.dtype)          # an f32 input takes rotate's f32 "highest" dot
    if way == "signs":
        return rotate(x)
    if way == "signs_bf16":
        return _signs(x, x.dtype) * jnp.asarray(1 / np.sqrt(d), x.dtype)
    if way == "unnorm":
        return _signs(x, jnp.float32).astype(x.dtype)
    if way == "fwht":
        return _fwht(x)
    if way == "barrier":
        return rotate(lax.optimization_barrier(x))
    raise ValueError(f"unknown way {way!r}; choose from {WAYS}")


def q_place(way, qkv, positions, inv_freq, heads, head_dim):
    q = qkv[:, :heads * head_dim].reshape(qkv.shape[0], heads, head_dim)
    q = apply_rope(q, positions, inv_freq)
    return q if way is None else rotate_by(way, q)


def out_place(way, attn, w_o):
    a = attn if way is None else rotate_by(way, attn)
    return jnp.dot(a.reshape(a.shape[0], -1), w_o, preferred_element_type=jnp.float32).astype(attn.dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="384,2048")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--copies", type=int, default=4, help="argument sets rotated past L2")
    ap.add_argument("--name", default="rotation")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    heads, kv_heads, hd = (4, 1, 64) if args.smoke else (32, 8, 128)
    hidden = 256 if args.smoke else 4096
    tokens = [64] if args.smoke else [int(t) for t in args.tokens.split(",")]
    ways = parse_choices(args.ways, WAYS, "--ways")
    copies = 1 if args.smoke else args.copies
    inv_freq = jnp.asarray(1.0 / (500000.0 ** (np.arange(0, hd, 2) / hd)), jnp.float32)
    h = np.asarray(hadamard(hd), np.float64)
    rows, summary = [], {}
    for t in tokens:
        keys = jax.random.split(jax.random.key(t), 3 * copies)
        qkvs = [jax.random.normal(keys[i], (t, (heads + 2 * kv_heads) * hd), jnp.bfloat16) for i in range(copies)]
        attns = [jax.random.normal(keys[copies + i], (t, heads, hd), jnp.bfloat16) for i in range(copies)]
        w_os = [jax.random.normal(keys[2 * copies + i], (heads * hd, hidden), jnp.bfloat16) * 0.02
                for i in range(copies)]
        positions = jnp.arange(t, dtype=jnp.int32) + 1000

        def timed(fn, arg_sets):
            f = jax.jit(fn)
            return kernel_us(lambda: [f(*a) for a in arg_sets], (), len(arg_sets)), f
        q_args = [(qkv, positions, inv_freq) for qkv in qkvs]
        o_args = [(a, w) for a, w in zip(attns, w_os)]
        q_base, _ = timed(functools.partial(q_place, None, heads=heads, head_dim=hd), q_args)
        o_base, _ = timed(functools.partial(out_place, None), o_args)
        roped = np.asarray(q_place(None, qkvs[0], positions, inv_freq, heads, hd), np.float64)
        for w in ways:
            q_us, fq = timed(functools.partial(q_place, w, heads=heads, head_dim=hd), q_args)
            o_us, _ = timed(functools.partial(out_place, w), o_args)
            got = np.asarray(fq(*q_args[0]), np.float64) / (np.sqrt(hd) if w == "unnorm" else 1.0)
            want = roped @ h
            err = float(np.abs(got - want).max() / np.abs(want).max())
            row = {"tokens": t, "way": w, "q_us": q_us, "q_base_us": q_base, "out_us": o_us, "out_base_us": o_base,
                   "q_relerr": err}
            rows.append(row)
            summary[f"q_us_t{t}_{w}"] = round(q_us - q_base, 2)
            summary[f"out_us_t{t}_{w}"] = round(o_us - o_base, 2)
            print(row, flush=True)
    table = print_table(["tokens", "way", "q: rope+rot us (rope alone)", "out: rot+o_proj us (o_proj alone)",
                         "rotation us (q + out)", "q rel err"],
                        [[r["tokens"], r["way"], f"{r['q_us']:.1f} ({r['q_base_us']:.1f})",
                          f"{r['out_us']:.1f} ({r['out_base_us']:.1f})",
                          f"{r['q_us'] - r['q_base_us'] + r['out_us'] - r['out_base_us']:.1f}",
                          f"{r['q_relerr']:.1e}"] for r in rows],
                        title=f"\n== the Hadamard rotation, {heads} heads x {hd} ==")
    write_results(args.name, summary, {"rows": rows, "table": table, "device": device_info()}, out_dir=args.out)


if __name__ == "__main__":
    main()
