"""What a candidate pre-selection would cost before a top-p draw: `jax.lax.top_k` and `jax.lax.approx_max_k` on
[rows, 128,256] float32 logits at a few k, beside a full descending sort of the rows (what the engine's limits head
does), ms a call on the device.

Why: bench.probes.sampler_limits measured the sort path at ~18 us a row (1,024 rows: 18 ms against 0.95 ms for
the plain draw) and radix selection slower still. If top_k at k <= 1,024 is far cheaper than the sort, a limits
head that sorts only the k candidates (exact whenever they hold the top-p mass) is the next candidate.

usage: python -m bench.probes.topk_cost [--rows 512,1024] [--ks 64,256,1024]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import print_table, time_fn, write_results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="512,1024")
    p.add_argument("--ks", default="64,256,1024")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--name", default="topk_cost")
    a = p.parse_args(argv)
    table, summary = [], {}
    for rows in map(int, a.rows.split(",")):
        x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, a.vocab)).astype(np.float32) * 2)
        ways = {"sort": lambda v: -jnp.sort(-v, axis=-1)}
        for k in map(int, a.ks.split(",")):
            ways[f"top_k {k}"] = lambda v, k=k: jax.lax.top_k(v, k)
            ways[f"approx_max_k {k}"] = lambda v, k=k: jax.lax.approx_max_k(v, k)
        for way, fn in ways.items():
            ms = time_fn(jax.jit(fn), x, iters=10, reps=5)["median_s"] * 1e3
            table.append([rows, way, ms])
            summary[f"ms[{rows},{way.replace(' ', '_')}]"] = round(ms, 3)
    print_table(["rows", "way", "ms"], table)
    write_results(a.name, summary, {"vocab": a.vocab})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
