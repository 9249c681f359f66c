"""What the engine's top-k / top-p sampler costs against sort-free radix selection
(nfjax/experimental/radix_select.py), the sampler alone on device: ms a call for each way at a few row counts of
the 8B vocabulary (128,256), temperature 1 and top-p 0.9 (a top-k column too), beside the plain temperature draw
(no limits: the floor), each way's compiled scratch, and whether its tokens equal the sort's.

Why: the limits head cost ~21% of 1024/512 throughput at top-p 0.9 on the H100 (docs/design.md section 2). If a
radix form is clearly faster at 512-1,024 rows, it goes into the engine's limits head and `bench.offline --top-p`
measures it end to end.

usage: python -m bench.probes.sampler_limits [--rows 128,512,1024] [--vocab 128256] [--name sampler_limits]
"""
from __future__ import annotations

import argparse
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import print_table, time_fn, write_results
from nfjax.engine.sampler import sample
from nfjax.experimental.radix_select import FORMS, sample_radix

WAYS = {"plain (no limits)": partial(sample, limits=False), "sort (engine)": sample,
        **{f"radix {f}": partial(sample_radix, form=f) for f in FORMS}}


def inputs(rows: int, vocab: int, top_k: int, top_p: float, seed: int = 0):
    """LM-like rows: a few hundred tokens hold most of the mass (logits ~ N(0, 2) with a boosted head)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 2.0
    head = rng.integers(0, vocab, (rows, 256))
    np.put_along_axis(logits, head, logits.max() + rng.standard_normal(head.shape).astype(np.float32), axis=1)
    return (jnp.asarray(logits), jnp.ones(rows, jnp.float32), jnp.full(rows, top_k, jnp.int32),
            jnp.full(rows, top_p, jnp.float32), jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="128,512,1024")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--cases", default="topp=0:0.9,topk=50:1.0", help="NAME=TOP_K:TOP_P,...")
    p.add_argument("--name", default="sampler_limits")
    a = p.parse_args(argv)
    cases = {n: (int(v.split(":")[0]), float(v.split(":")[1]))
             for n, v in (c.split("=") for c in a.cases.split(","))}
    records, table, summary = [], [], {}
    for rows in (int(r) for r in a.rows.split(",")):
        for case, (k, tp) in cases.items():
            args = inputs(rows, a.vocab, k, tp)
            want = None
            for way, fn in WAYS.items():
                c = jax.jit(fn).lower(*args).compile()
                tokens = np.asarray(c(*args))
                if way == "sort (engine)":
                    want = tokens
                ms = time_fn(c, *args, iters=10, reps=5)["median_s"] * 1e3
                scratch = c.memory_analysis().temp_size_in_bytes / 2**20
                rec = {"rows": rows, "case": case, "top_k": k, "top_p": tp, "way": way, "ms": ms,
                       "scratch_mib": scratch, "same_as_sort": None if want is None else
                       float(np.mean(tokens == want))}
                records.append(rec)
                table.append([rows, case, way, ms, scratch, rec["same_as_sort"] if rec["same_as_sort"] is not None
                              else "-"])
                summary[f"ms[{case},{rows},{way.split(' (')[0].replace(' ', '_')}]"] = round(ms, 3)
    print_table(["rows", "case", "way", "ms", "scratch MiB", "tokens = sort"], table)
    write_results(a.name, summary, {"vocab": a.vocab, "records": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
