"""Which part of int4 KV costs SmolLM2 its accuracy (issue #21): variants of the int4 format applied by fake
quantization (quantize, dequantize, store the result in bfloat16), run through bench/kv_accuracy.py's lockstep
teacher-forced loop in the slot of its fp8 engine, against the bfloat16 cache.

A variant names what K and V get: `exact` (bfloat16, as the baseline), `plainN` (int4 in groups of N along head_dim,
the shipped format's arithmetic) or `rotN` (the same after the Hadamard rotation of kv_quant.rotate, rotated back
after dequantizing, so attention needs no change). The shipped int4 is k:rot64,v:rot64: faked over SmolLM2's 4
windows, +6.15% / 87.20% against the real format's +5.45% / 86.89% (bench/NOTES.md section 12): close, not exact
(the fake path rounds the dequantized values to bf16).

usage: python -m bench.probes.kv_int4_variants k:rot64,v:plain64 [k:exact,v:rot64 ...] [--windows 2]
Prints one JSON line a variant. A probe: it patches kv_quant and the blocked attention loop in this process only.
"""
from __future__ import annotations

import argparse
import json


def fake_int4(x, rotated: bool, group: int):
    """x [..., D] -> x through int4 (center and scale per group, as kv_quant.quantize_int4) in f32."""
    import jax.numpy as jnp
    from pallas_kernels import kv_quant as kq
    x = x.astype(jnp.float32)
    if rotated:
        x = kq.rotate(x, jnp.float32)
    *lead, d = x.shape
    xg = x.reshape(*lead, d // group, group)
    lo, hi = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
    c = ((lo + hi) * 0.5).astype(jnp.bfloat16).astype(jnp.float32)
    s = jnp.maximum(kq._bf16_up(jnp.maximum(hi - c, c - lo) / 7.5), 1e-30)
    y = ((jnp.clip(jnp.round((xg - c) / s + 7.5), 0, 15) - 7.5) * s + c).reshape(*lead, d)
    return kq.rotate(y, jnp.float32) if rotated else y


def parse(variant: str) -> dict:
    out = {}
    for part in variant.split(","):
        who, how = part.split(":")
        if how == "exact":
            out[who] = None
        elif how.startswith(("rot", "plain")):
            out[who] = (how.startswith("rot"), int(how.removeprefix("rot").removeprefix("plain")))
        else:
            raise SystemExit(f"variant part {part!r}: want k|v:exact|rotN|plainN")
    if set(out) != {"k", "v"}:
        raise SystemExit(f"variant {variant!r}: name k and v")
    return out


def install(spec: dict) -> None:
    """The fp8 engine's cache becomes a bfloat16 one holding fake-quantized K/V (its aux rows unused)."""
    import jax.numpy as jnp
    import nfjax.kv.blocked_attention as blocked
    from pallas_kernels import kv_quant as kq
    value_dtype, quantize_kv, dequantize_kv = kq.value_dtype, kq.quantize_kv, kq.dequantize_kv

    def value_dtype_(fmt, model_dtype):
        return jnp.dtype(jnp.bfloat16) if fmt == "fp8" else value_dtype(fmt, model_dtype)

    def quantize_kv_(fmt, k, v):
        if fmt != "fp8":
            return quantize_kv(fmt, k, v)
        k, v = (x.astype(jnp.float32) if spec[w] is None else fake_int4(x, *spec[w]) for x, w in ((k, "k"), (v, "v")))
        return k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), jnp.zeros(k.shape[:-1] + (8,), jnp.bfloat16)

    def dequantize_kv_(k, v, aux, dtype=jnp.float32):
        if aux is not None and k.dtype == jnp.bfloat16:
            return k.astype(dtype), v.astype(dtype)
        return dequantize_kv(k, v, aux, dtype)
    kq.value_dtype, kq.quantize_kv, blocked.dequantize_kv = value_dtype_, quantize_kv_, dequantize_kv_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--windows", type=int, default=2, help="the first N windows of the held-out text")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    args = ap.parse_args()
    specs = [parse(v) for v in args.variants]
    from bench import kv_accuracy
    for variant, spec in zip(args.variants, specs):
        install(spec)            # re-patched each variant; every run builds and traces its engines anew
        r = kv_accuracy.run_model(args.model, ["fp8"], 1024, 16, 16, args.windows)
        f = r["formats"]["fp8"]
        print(json.dumps({"variant": variant, "model": args.model, "windows": r["windows"],
                          "ppl_delta_pct": round(f["ppl_delta_pct"], 3), "top1_agree": round(f["top1_agree"], 4),
                          "kl_mean": f["kl_mean"], "seconds": round(r["seconds"], 1)}), flush=True)


if __name__ == "__main__":
    main()
