"""Probe (#27): where do the slow tokens of a lone stream come from? `bench.latency`'s batch-1 stream showed
p99 inter-token gaps of 20-27 ms against a 6.3 ms p50 in 3 of 5 runs, in clusters of ~5 consecutive tokens.

One request at a time through `Engine.stream` (as bench.latency), `--repeats` times per mode. For every token
gap it keeps the step record of the step that produced the token (host ms, dispatch, blocked on read) and every
Python garbage collection that ran inside the gap (generation, ms, from `gc.callbacks`). Modes:
- plain: as the engine runs today;
- frozen: after `gc.collect(); gc.freeze()` (what `nfjax serve` does once its engine is built).
The largest gaps of each repeat are printed with their steps and collections; all gaps go to the JSON.

usage: python -m bench.probes.itl_spikes --shape llama3-8b [--repeats 4] [--out DIR]
CPU:   python -m bench.probes.itl_spikes --shape smoke --prompt-len 16 --output-len 32 --repeats 2
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

from bench.common import GcLog
from bench.setup import add_bench_args


def one_stream(engine, ids: list[int], n: int, log: GcLog) -> dict:
    from nfjax.engine import SamplingParams
    trace = engine.trace.steps
    times, steps = [time.perf_counter()], []
    for out in engine.stream(ids, SamplingParams.greedy(max_tokens=n, ignore_eos=True)):
        if out.new_token_ids:
            times.append(time.perf_counter())
            s = trace[-1] if trace else None
            steps.append(None if s is None else {"bucket": s.bucket, "host_ms": s.host_ms, "wait_ms": s.wait_ms,
                                                  "put_ms": s.put_ms, "dispatch_ms": s.dispatch_ms,
                                                  "step_ms": s.seconds * 1e3})
    gaps = []
    for i in range(2, len(times)):                      # gap i: token i-1 -> token i (the first is TTFT)
        gaps.append({"token": i - 1, "ms": (times[i] - times[i - 1]) * 1e3, "step": steps[i - 1],
                     "gc": log.within(times[i - 1], times[i])})
    ms = sorted(g["ms"] for g in gaps)
    return {"ttft_ms": (times[1] - times[0]) * 1e3, "p50": ms[len(ms) // 2], "p99": ms[min(len(ms) - 1,
            int(0.99 * (len(ms) - 1) + 0.5))], "max": ms[-1], "gc_in_stream": log.within(times[0], times[-1]),
            "gaps": gaps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_bench_args(p)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--modes", default="plain,frozen")
    p.add_argument("--batch-before", type=int, default=64,
                   help="a batch of this many requests generated before the streams (bench.latency runs batches 1 "
                        "and 64 first)")
    p.add_argument("--out", default=None, help="folder of the JSON (default: print only)")
    args = p.parse_args(argv)
    from bench.common import device_name
    from bench.setup import bench_engine, model_config
    from bench.workloads import fixed
    cfg = model_config(args)
    t = time.perf_counter()
    engine = bench_engine(args, context=args.prompt_len + args.output_len)
    print(f"[engine built in {time.perf_counter() - t:.1f} s]", flush=True)
    warm = fixed(8, args.prompt_len, 4, cfg.vocab_size, seed=7)
    from nfjax.engine import SamplingParams
    engine.generate([q for q, _ in warm], SamplingParams.greedy(max_tokens=4))
    if args.batch_before:
        work = fixed(args.batch_before, args.prompt_len, args.output_len, cfg.vocab_size, seed=1064)
        engine.generate([q for q, _ in work], SamplingParams.greedy(max_tokens=args.output_len, ignore_eos=True))
    log = GcLog()
    gc.callbacks.append(log)
    res = {"device": device_name(), "args": vars(args), "modes": {}}
    for mode in args.modes.split(","):
        if mode == "frozen":
            gc.collect()
            gc.freeze()
        runs = []
        for r in range(args.repeats):
            ids = fixed(1, args.prompt_len, args.output_len, cfg.vocab_size, seed=3000 + r)[0][0]
            runs.append(one_stream(engine, ids, args.output_len, log))
            x = runs[-1]
            gcs = x["gc_in_stream"]
            print(f"[{mode} {r}] p50 {x['p50']:.2f} p99 {x['p99']:.2f} max {x['max']:.2f} ms; "
                  f"{len(gcs)} collections in the stream ({sum(g['ms'] for g in gcs):.1f} ms, gen2: "
                  f"{sum(1 for g in gcs if g['gen'] == 2)})", flush=True)
            for g in sorted(x["gaps"], key=lambda g: -g["ms"])[:4]:
                s = g["step"] or {}
                print(f"    token {g['token']}: {g['ms']:.1f} ms; step {s.get('step_ms', 0):.1f} ms, host "
                      f"{s.get('host_ms', 0):.1f} (dispatch {s.get('dispatch_ms', 0):.1f}), blocked on read "
                      f"{s.get('wait_ms', 0):.1f}; gc {[(c['gen'], round(c['ms'], 1)) for c in g['gc']]}",
                      flush=True)
        res["modes"][mode] = {"p50_ms": statistics.median(x["p50"] for x in runs),
                              "p99_over_p50": [x["p99"] / x["p50"] for x in runs], "runs": runs}
    gc.callbacks.remove(log)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "itl_spikes.json")
        with open(path, "w") as f:
            json.dump(res, f)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
