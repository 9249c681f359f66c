"""Probe (#21): the cost of the decode kernel's query operands for int4 / int8 (`kv_quant.int8_query_parts`) and fp8
(`fp8_query_parts`), built where the engine builds them: RoPE'd queries -> (int4: the rotation) -> grouped per kv
head -> parts. On the H200 a 2,048-token int4 step's `input_concatenate_fusion` under attn_decode took 1.5 ms (47 us
a layer for ~40 MB moved; fp8's 0.47 ms), bench/NOTES.md 38.1. Ways of building int8's parts:
  * `concat`: four masked copies of the two parts concatenated, as int8 (shipped until 2026-11-30);
  * `stacked`: the two parts stacked and multiplied by a [groups, D] column mask, one reshape (no concatenate);
  * `where_i8`: the same with the parts cast to int8 first and a select for the mask;
  * `apart`: [hi; lo] over all of D with no zero blocks, half the bytes (the kernel's `group_accs` layout);
  * `packed`: `concat`'s layout built as uint32 words, four codes a word (shifts and ors), then bitcast to int8:
    a quarter of the stores (shipped, `kv_quant.int8_query_parts`); `fp8_packed`: fp8's two parts the same way.
Each is checked equal to the shipped operand. H200, 1,024 rows (session 36, before `apart`): concat 51.8 us, stacked
93.6, where_i8 92.9, fp8's parts 27.9. Session 37 (`query_parts-packed-20261130.json`): concat 46.6, packed 37.3
(384 rows 21.0 -> 15.7), fp8 28.1, fp8_packed 26.1: int8's parts now go packed; fp8's stay (2 us).

usage: python -m bench.probes.query_parts [--rows 384,1024] [--out DIR]
CPU:   python -m bench.probes.query_parts --smoke
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_info, parse_choices, print_table, write_results
from bench.step_bench import kernel_us
from pallas_kernels import kv_quant
from pallas_kernels.kv_quant import GROUP, groups, rotate

WAYS = ("concat", "stacked", "where_i8", "apart", "packed", "fp8", "fp8_packed")


def _stacked(qr):
    i, gp, d = qr.shape
    ng = groups(d)
    hi, lo, sc = kv_quant.int8_hi_lo(qr)
    on = (jnp.arange(d) // GROUP == jnp.arange(ng)[:, None]).astype(jnp.float32)       # [G, D]
    blocks = jnp.stack([hi, lo], axis=1)[:, :, None] * on[None, None, :, None, :]      # [I, 2, G, GP, D]
    return blocks.reshape(i, 2 * ng * gp, d).astype(jnp.int8), sc


def _where_i8(qr):
    i, gp, d = qr.shape
    ng = groups(d)
    hi, lo, sc = kv_quant.int8_hi_lo(qr)
    parts = jnp.stack([hi, lo], axis=1).astype(jnp.int8)[:, :, None]                 # [I, 2, 1, GP, D]
    on = (jnp.arange(d) // GROUP == jnp.arange(ng)[:, None])[None, None, :, None, :]  # [1, 1, G, 1, D]
    return jnp.where(on, parts, jnp.int8(0)).reshape(i, 2 * ng * gp, d), sc


def _concat(qr):
    i, gp, d = qr.shape
    hi, lo, sc = kv_quant.int8_hi_lo(qr)
    col_group = jnp.arange(d) // GROUP
    blocks = [jnp.where(col_group == g, part, 0.0) for part in (hi, lo) for g in range(groups(d))]
    return jnp.concatenate(blocks, axis=1).astype(jnp.int8), sc


def _fp8_packed(qr):
    x, sc = kv_quant._item_units(qr, kv_quant.FP8_MAX)
    hi = x.astype(kv_quant.FP8)
    lo = (x - jax.lax.optimization_barrier(hi).astype(jnp.float32)).astype(kv_quant.FP8)
    words = jnp.concatenate([kv_quant.int8_words(jax.lax.bitcast_convert_type(p, jnp.uint8)) for p in (hi, lo)], axis=1)
    return jax.lax.bitcast_convert_type(words, kv_quant.FP8).reshape(qr.shape[0], 2 * qr.shape[1], -1), sc


def parts_by(way: str, q, kv_heads: int, rotated: bool):
    """q [R, H, D] (RoPE'd) -> the kernel's query operand built `way`."""
    r, h, d = q.shape
    if rotated:
        q = rotate(q)
    qr = q.reshape(r, kv_heads, h // kv_heads, d)
    gp = -(-(h // kv_heads) // 8) * 8
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, gp - h // kv_heads), (0, 0))).reshape(r * kv_heads, gp, d)
    if way == "concat":
        return _concat(qr)
    if way == "stacked":
        return _stacked(qr)
    if way == "where_i8":
        return _where_i8(qr)
    if way == "apart":
        return kv_quant.int8_query_parts(qr, grouped=False)
    if way == "packed":
        return kv_quant.int8_query_parts(qr)
    if way == "fp8":
        return kv_quant.fp8_query_parts(qr)
    if way == "fp8_packed":
        return _fp8_packed(qr)
    raise ValueError(f"unknown way {way!r}; choose from {WAYS}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="384,1024", help="decode rows (the engine's min(max_seqs, bucket))")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--copies", type=int, default=4, help="argument sets rotated past L2")
    ap.add_argument("--name", default="query_parts")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    heads, kv_heads, hd = (8, 2, 128) if args.smoke else (32, 8, 128)
    rows_list = [16] if args.smoke else [int(r) for r in args.rows.split(",")]
    ways = parse_choices(args.ways, WAYS, "--ways")
    copies = 1 if args.smoke else args.copies
    rows, summary = [], {}
    for r in rows_list:
        keys = jax.random.split(jax.random.key(r), copies)
        qs = [jax.random.normal(k, (r, heads, hd), jnp.bfloat16) for k in keys]
        ref = jax.jit(functools.partial(parts_by, "packed", kv_heads=kv_heads, rotated=True))(qs[0])
        ref8 = jax.jit(functools.partial(parts_by, "fp8", kv_heads=kv_heads, rotated=False))(qs[0])
        for w in ways:
            for rotated in (False, True):
                if w.startswith("fp8") and rotated:
                    continue
                f = jax.jit(functools.partial(parts_by, w, kv_heads=kv_heads, rotated=rotated))
                us = kernel_us(lambda: [f(q) for q in qs], (), copies)
                same = None
                if (w in ("concat", "stacked", "where_i8") and rotated) or w == "fp8_packed":
                    got = f(qs[0])
                    want = ref8 if w == "fp8_packed" else ref
                    same = bool(np.array_equal(np.asarray(got[0]).view(np.uint8), np.asarray(want[0]).view(np.uint8))
                                and np.array_equal(np.asarray(got[1]), np.asarray(want[1])))
                    if not same:
                        what = "fp8" if w == "fp8_packed" else "the shipped parts"
                        raise SystemExit(f"{w} differs from {what} at rows {r}")
                row = {"rows": r, "way": w, "rotated": rotated, "us": us, "equal_to_shipped": same}
                rows.append(row)
                summary[f"us_r{r}_{w}{'_rot' if rotated else ''}"] = round(us, 2)
                print(row, flush=True)
    table = print_table(["rows", "way", "rotation in", "us", "= shipped"],
                        [[x["rows"], x["way"], x["rotated"], f"{x['us']:.1f}", x["equal_to_shipped"]] for x in rows],
                        title=f"\n== decode query operands, {heads} heads / {kv_heads} kv heads x {hd} ==")
    write_results(args.name, summary, {"rows": rows, "table": table, "device": device_info()}, out_dir=args.out)


if __name__ == "__main__":
    main()
