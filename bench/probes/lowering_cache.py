"""Probe (#27, #21 build time): what the kernel lowering cache (pallas_kernels/_lowering_cache.py) saves when
separate programs call the same kernels, and whether each program's lowered text stays the same.

The engine lowers one layer program per token bucket (and per decode-only variant): ~16 programs for the 8B
model, each lowering the same decode and prefill kernels afresh, since JAX caches a kernel's lowering within
one module only. A quantized cache's kernels lower slowly (int4's decode kernel ~1.3-2 s a program on the CPU
host; with the prefill kernel ~1.7 s: ~16 x 1.7 s against int4's 59 s of lowering, bench/NOTES.md 33.1).
pallas_kernels/_lowering_cache.py wraps JAX's `lower_pipelined_jaxpr_to_module` (90% of a kernel's lowering in a
cProfile of this probe's programs) with a cache across programs.

Run: lowers `--programs` separate programs, each calling the swapped decode kernel (and with --prefill the
prefill kernel) for each format, for CUDA, with and without the cache; prints the seconds and whether each
program's lowered text (locations stripped) is the same both ways.

    python -m bench.probes.lowering_cache --formats bfloat16,fp8,int4 --programs 6 [--prefill]
"""
from __future__ import annotations

import argparse
import difflib
import re
import time

import jax
import jax.numpy as jnp


def program_text(fmt: str, j: int, prefill: bool) -> str:
    """One program calling the decode kernel (and the prefill kernel), lowered for CUDA, locations stripped."""
    from pallas_kernels import kv_quant
    from pallas_kernels.paged_decode_swapped import paged_decode_attention_swapped
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention
    sds = jax.ShapeDtypeStruct
    lead = (32, 4096, 16, 8)
    if fmt == "bfloat16":
        cache, aux = sds((*lead, 128), jnp.bfloat16), None
    else:
        cache = sds((*lead, kv_quant.value_width(fmt, 128)), kv_quant.value_dtype(fmt, jnp.bfloat16))
        aux = sds((*lead, kv_quant.aux_width(fmt, 128)), kv_quant.AUX_DTYPE)

    def prog(q, k, v, a, pt, lens, qp, qs):
        out = paged_decode_attention_swapped(q * (j + 1), k, v, jnp.int32(j), pt, lens, scale=0.1, aux_cache=a)
        if prefill:
            out = out.sum() + paged_prefill_attention(qp, k, v, jnp.int32(j), pt[:4], lens[:4], qs,
                                                      jnp.int32(1), scale=0.1, aux_cache=a).sum()
        return out
    args = (sds((256, 32, 128), jnp.bfloat16), cache, cache, aux, sds((256, 80), jnp.int32), sds((256,), jnp.int32),
            sds((2048, 32, 128), jnp.bfloat16), sds((5,), jnp.int32))
    text = jax.jit(prog).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # jax 0.11 embeds each kernel as MLIR bytecode with its hash, and those bytes differ between two lowerings of
    # one program (seen on the H200, bench/NOTES.md 35.2), so the comparison leaves them out there
    text = re.sub(r'(kernel_hash|module) = "(?:[^"\\]|\\.)*"', r'\1 = ""', text)
    return re.sub(r"loc\([^)]*\)", "", text)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bfloat16,fp8,int4")
    ap.add_argument("--programs", type=int, default=6)
    ap.add_argument("--prefill", action="store_true")
    a = ap.parse_args(argv)
    from pallas_kernels import _lowering_cache
    _lowering_cache.disable()
    for fmt in a.formats.split(","):
        plain, t0 = [], time.perf_counter()
        for j in range(a.programs):
            plain.append(program_text(fmt, j, a.prefill))
        t_plain = time.perf_counter() - t0
        again = program_text(fmt, 0, a.prefill)     # is the lowering itself the same twice?
        if not _lowering_cache.enable():
            raise SystemExit("this JAX's Pallas lowering is not the one pallas_kernels/_lowering_cache.py wraps: "
                             f"{_lowering_cache.why_not()}")
        try:
            t0 = time.perf_counter()
            with_cache = [program_text(fmt, j, a.prefill) for j in range(a.programs)]
            t_cache = time.perf_counter() - t0
            hits = _lowering_cache.stats()["hits"]
        finally:
            _lowering_cache.disable()
        same = sum(x == y for x, y in zip(plain, with_cache))
        print(f"{fmt}: {a.programs} programs lowered in {t_plain:.2f} s, with the cache {t_cache:.2f} s "
              f"({hits} hits); lowered text the same in {same} of {a.programs} (without the cache, twice: "
              f"{'the same' if again == plain[0] else 'different'})", flush=True)
        for name, other in (("without the cache, twice", again), ("with the cache", with_cache[0])):
            if other != plain[0]:
                print(f"  program 0, {name}, first differences:\n" + _first_differences(plain[0], other))


def _first_differences(x: str, y: str, lines: int = 12, width: int = 300) -> str:
    diff = [d for d in difflib.unified_diff(x.splitlines(), y.splitlines(), lineterm="", n=0)
            if d[:1] in "+-" and not d.startswith(("+++", "---"))]
    return "\n".join("    " + d[:width] for d in diff[:lines])


if __name__ == "__main__":
    main()
