"""KV bytes a second that decode attention on the CPU reads: one XLA CPU program over the whole block (the way
before 2026-11-27) against the engine's pieces on a thread a core (nfjax/offload/cpu_attention.py), on OPT-30B's
decode blocks (56 heads of 128, 512 + 32 positions) at a few batch sizes, and the hardware profile's block.

Why: the first #25 grid on the H100 host measured CPU-attention policies 1.5-2.5x slower than the cost model
predicted; the whole-block program ran at 0.75 GB/s on 16 cores as on 2.

usage: python -m bench.probes.cpu_attention_rate [--batches 1,2,8] [--name cpu_attention_rate]
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from bench.common import print_table, write_results
from nfjax.offload import cpu_attention as ca
from nfjax.offload.hardware import _rate


def block(b: int, s: int, kh: int, h: int, d: int, seed: int = 0):
    import ml_dtypes
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((b, s, kh, d), np.float32).astype(ml_dtypes.bfloat16) for _ in range(2))
    q = rng.standard_normal((b, h, d), np.float32).astype(ml_dtypes.bfloat16)
    return q, k, v, np.full((b, 1), s - 1, np.int32)


def whole(q, k, v, pos, scale):
    """The former path: one program over the block on the CPU device."""
    import jax
    args = jax.device_put((q, (k, v), pos), ca.cpu_device())
    return np.asarray(ca._attend(*args, scale, 1.0))


def pieces(q, k, v, pos, scale):
    return ca.cpu_attention(q, (k, v), pos, scale)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,2,8")
    p.add_argument("--name", default="cpu_attention_rate")
    a = p.parse_args(argv)
    shapes = {f"opt-30b b{b}": (b, 544, 56, 56, 128) for b in map(int, a.batches.split(","))}
    shapes["profile block"] = (8, 1024, 16, 32, 128)
    table, summary, records = [], {}, []
    for name, shp in shapes.items():
        q, k, v, pos = block(*shp)
        scale = shp[-1] ** -0.5
        err = float(np.abs(whole(q, k, v, pos, scale).astype(np.float32)
                           - pieces(q, k, v, pos, scale).astype(np.float32)).max())
        rates = {w: _rate(k.nbytes + v.nbytes, lambda f=f: f(q, k, v, pos, scale), max_reps=10) / 1e9
                 for w, f in (("whole", whole), ("pieces", pieces))}
        records.append({"shape": name, "dims": shp, "gb_s": rates, "max_abs_diff": err})
        table.append([name, rates["whole"], rates["pieces"], rates["pieces"] / rates["whole"], err])
        key = name.replace(" ", "_")
        summary[f"gb_s[{key},whole]"] = round(rates["whole"], 3)
        summary[f"gb_s[{key},pieces]"] = round(rates["pieces"], 3)
    print_table(["block", "whole GB/s", "pieces GB/s", "x", "max |diff|"], table,
                title=f"CPU attention, {os.cpu_count()} cores, {ca.THREADS} threads")
    write_results(a.name, summary, {"cores": os.cpu_count(), "threads": ca.THREADS, "records": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
