"""Host time of batch formation: the scheduler alone (no model) driven through a whole offline run at 8B scale,
with the KV capacity of an H100 (26,674 pages of 16 positions), so that admission is memory-bound for most of
the run as it is on the device. Each step's sampled tokens land at once (the engine learns them one step late;
that changes no scheduling decision here). Pure Python: the numbers are this machine's CPU.

Batcher settings are the engine flags (bench/setup.py), resolved as on a GPU; --num-pages defaults to the
H100's pool.

usage: python -m bench.probes.host_overhead [--workloads 1024x512] [--num-requests 512] [--max-seqs 512]
"""
from __future__ import annotations

import argparse
import statistics
import time

from nfjax.engine.builder import add_engine_args

H100_PAGES = 26_674           # KV pages of 16 positions an H100 holds beside the 8B shape's weights


def drive(workload: str, n: int, overrides: dict) -> dict:
    """Schedule every request of the workload to completion with the batcher the engine settings `overrides`
    ({section: {field: value}}) give the 8B shape on a GPU; per-step next_batch() times and batch shapes."""
    from bench.workloads import parse
    from nfjax.engine.batcher import Batcher
    from nfjax.engine.builder import engine_config, resolve
    from nfjax.engine.request import Request
    from nfjax.engine.sampling_params import SamplingParams
    from nfjax.models.random_init import SHAPES

    work = parse(workload, n, 128_256, seed=1)
    sched = Batcher(resolve(engine_config(SHAPES["llama3-8b"], overrides), None, on_gpu=True))
    for i, (p, o) in enumerate(work):
        sched.add(Request(f"r{i}", p, SamplingParams.greedy(max_tokens=o, ignore_eos=True), seed=i))
    times, decodes, tokens = [], [], []
    while sched.has_work():
        t = time.perf_counter()
        batch = sched.next_batch({})
        times.append(time.perf_counter() - t)
        if batch is None:
            raise RuntimeError("the scheduler stalled with work left")
        decodes.append(batch.num_decode)
        tokens.append(batch.num_tokens)
        for s in batch.seqs:
            if s.samples:
                s.req.output_ids.append(7)
                if len(s.req.output_ids) >= s.req.params.max_tokens:
                    sched.finish(s.req, "length")
    ms = [t * 1e3 for t in times]
    return {"steps": len(ms), "schedule_ms_mean": statistics.mean(ms), "schedule_ms_median": statistics.median(ms),
            "schedule_ms_max": max(ms), "schedule_s_total": sum(times),
            "mean_decodes": statistics.mean(decodes), "mean_tokens": statistics.mean(tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(ap)
    ap.add_argument("--workloads", default="1024x512,sharegpt")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--name", default="host_overhead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from bench.common import print_table, write_results
    from bench.setup import bench_overrides
    overrides = bench_overrides(args, defaults={"cache": {"num_pages": H100_PAGES}})
    res, rows, summary = {}, [], {}
    for w in args.workloads.split(","):
        r = res[w] = drive(w, args.num_requests, overrides)
        rows.append([w, r["steps"], r["mean_decodes"], r["schedule_ms_mean"], r["schedule_ms_median"],
                     r["schedule_ms_max"], r["schedule_s_total"]])
        summary[f"schedule_ms_mean_{w.replace('x', '_')}"] = r["schedule_ms_mean"]
    print_table(["workload", "steps", "mean decodes", "schedule ms mean", "median", "max", "total s"], rows)
    write_results(args.name, summary, {"args": vars(args), "results": res}, out_dir=args.out)


if __name__ == "__main__":
    main()
