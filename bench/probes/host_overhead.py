"""Host time of batch formation: the scheduler alone (no model) driven through a whole offline run at 8B scale,
with the KV capacity of an H100 (26,674 pages of 16 positions), so that admission is memory-bound for most of
the run as it is on the device. Each step's sampled tokens land at once (the engine learns them one step late;
that changes no scheduling decision here). Pure Python: the numbers are this machine's CPU.

usage: python bench/host_overhead.py [--workload 1024x512] [--num-requests 512] [--max-seqs 512]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def drive(workload: str, n: int, max_seqs: int, num_pages: int, page_size: int, buckets: tuple[int, ...]) -> dict:
    """Schedule every request of the workload to completion; per-step schedule() times and batch shapes."""
    from bench.workloads import parse
    from nfjax.config import CacheConfig, BatcherConfig
    from nfjax.engine.request import Request
    from nfjax.engine.sampling_params import SamplingParams
    from nfjax.engine.batcher import Batcher

    work = parse(workload, n, 128_256, seed=1)
    longest = max(len(p) + o for p, o in work)
    sched = Batcher(BatcherConfig(token_buckets=buckets, max_seqs=max_seqs),
                      CacheConfig(page_size, num_pages, -(-longest // page_size)), max_model_len=1 << 20)
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
    ap.add_argument("--workloads", default="1024x512,sharegpt")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--max-seqs", type=int, default=512)
    ap.add_argument("--num-pages", type=int, default=26_674, help="KV pages (default: an H100's for the 8B shape)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--buckets", default="128,256,512,1024,2048")
    ap.add_argument("--name", default="host_overhead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from bench.common import print_table, write_results
    buckets = tuple(int(b) for b in args.buckets.split(","))
    res, rows, summary = {}, [], {}
    for w in args.workloads.split(","):
        r = res[w] = drive(w, args.num_requests, args.max_seqs, args.num_pages, args.page_size, buckets)
        rows.append([w, r["steps"], r["mean_decodes"], r["schedule_ms_mean"], r["schedule_ms_median"],
                     r["schedule_ms_max"], r["schedule_s_total"]])
        summary[f"schedule_ms_mean_{w.replace('x', '_')}"] = r["schedule_ms_mean"]
    print_table(["workload", "steps", "mean decodes", "schedule ms mean", "median", "max", "total s"], rows)
    write_results(args.name, summary, {"args": vars(args), "results": res}, out_dir=args.out)


if __name__ == "__main__":
    main()
