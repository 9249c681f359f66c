"""Probe: how a step's launch mode changes host and GPU time of decode steps (8B shape, one GPU).

Modes: layer-group programs of 4 layers (the default) or 32, each with and without the prefill kernel
(decode-only programs). Per mode and decode batch: compile time, host time to enqueue one step on an idle GPU,
one step alone, and the time per step of a chain of back-to-back steps; optionally the kernel time by kernel.

usage: python -m bench.probes.step_launch [--shape llama3-8b] [--batches 1@64,64@64,128@128,256@256] [--ctx 1024]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time

# The scanned-layers modes (all layers as one lax.scan over stacked weights, with and without WHILE in the
# command buffers) ran 24.9 ms a 1-sequence decode step against 14.9 for groups4 (step_launch-modes-20261124.json)
# and left the engine (docs/design.md).
MODES = {"groups4": dict(exe={}), "groups4_dec": dict(exe={}, decode_only=True),
         "groups32": dict(exe=dict(layers_per_program=32)),
         "groups32_dec": dict(exe=dict(layers_per_program=32), decode_only=True)}


def _input(runner, n: int, bucket: int, ctx: int):
    import numpy as np
    from nfjax.engine.step_input import StepInput
    from nfjax.kv.metadata import build_metadata
    cc = runner.cache_cfg
    per = cc.pages_for(ctx + 1)
    specs = [(list(range(1 + i * per, 1 + (i + 1) * per)), ctx, 1) for i in range(n)]
    s = runner.sched.seqs_for(bucket)
    meta = build_metadata(specs, bucket, s, cc.max_pages_per_seq, cc.page_size, num_decode=n)
    z = np.zeros(s, np.int32)
    toks = np.random.default_rng(0).integers(0, runner.cfg.vocab_size, bucket).astype(np.int32)
    return runner._to_device(StepInput(toks, np.full(bucket, -1, np.int32), meta, z.astype(np.float32), z,
                                       z.astype(np.float32) + 1, z.astype(np.uint32), z))


def run_mode(name: str, model, batches, ctx: int, chain: int, profile: str | None = None) -> dict:
    import jax
    from nfjax.config import BatcherConfig, CacheConfig, EngineConfig, ExecutionConfig, pages_for
    from nfjax.engine.runner import Runner
    from nfjax.parallel import make_mesh
    m = MODES[name]
    buckets = tuple(sorted({b for _, b in batches}))
    most = max(n for n, _ in batches)
    per = pages_for(ctx + 1, 16)
    cache = CacheConfig(page_size=16, num_pages=most * per + 2, max_pages_per_seq=per)
    cfg = EngineConfig(model.cfg, cache, BatcherConfig(buckets, max_seqs=most),
                       execution=ExecutionConfig(**m["exe"]))
    r = Runner(model, cfg, make_mesh(1), take_weights=False)
    r.xla_options.update(m.get("xla", {}))
    if m.get("decode_only"):
        r.opts = dataclasses.replace(r.opts, decode_only=True)
    t = time.perf_counter()
    r.compile_all()
    out = {"compile_s": time.perf_counter() - t, "batches": {}}
    for n, b in batches:
        inp = _input(r, n, b, ctx)
        for _ in range(3):
            jax.block_until_ready(r.run_step(b, "sequential", inp, any_sampled=False))
        host = []
        t0 = time.perf_counter()
        for _ in range(chain):
            h = time.perf_counter()
            s = r.run_step(b, "sequential", inp, any_sampled=False)
            host.append(time.perf_counter() - h)
        jax.block_until_ready(s)
        wall = (time.perf_counter() - t0) / chain
        jax.block_until_ready(s)
        t1 = time.perf_counter()                # one step alone: GPU time plus one launch
        jax.block_until_ready(r.run_step(b, "sequential", inp, any_sampled=False))
        single = time.perf_counter() - t1
        idle = []                               # enqueueing one step on an idle GPU: the host's own cost
        for _ in range(5):
            h = time.perf_counter()
            s = r.run_step(b, "sequential", inp, any_sampled=False)
            idle.append(time.perf_counter() - h)
            jax.block_until_ready(s)
        host.sort()
        idle.sort()
        row = out["batches"][f"{n}@{b}"] = {
            "step_ms_chain": wall * 1e3, "host_ms_median_in_chain": host[len(host) // 2] * 1e3,
            "enqueue_ms_idle": idle[2] * 1e3, "single_step_ms": single * 1e3}
        print(f"{name:9s} {n:4d}@{b:<5d} chain {wall * 1e3:7.2f} ms/step  enqueue (idle GPU) {idle[2] * 1e3:6.2f} ms"
              f"  single {single * 1e3:7.2f} ms", flush=True)
        if profile:
            from bench.step_bench import kernel_table, trace
            kt = kernel_table(trace(lambda: r.run_step(b, "sequential", inp, any_sampled=False), profile,
                                    f"{name}_{n}_{b}"))
            row["kernels"] = kt.get("top", [])[:15]
            row["total_kernel_ms"] = kt.get("total_kernel_ms")
            print(f"    kernel ms/step {kt.get('total_kernel_ms')}", flush=True)
            for k in row["kernels"][:10]:
                print(f"    {k['ms']:7.3f} ms  x{k['count']:<5g} {k['name'][:90]}", flush=True)
    del r
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batches", default="1@64,64@64,128@128,256@256", help="decodes@bucket, comma-separated")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--chain", type=int, default=30)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--profile", default=None, help="trace folder: kernel time per kernel of each batch's step")
    args = ap.parse_args()
    from nfjax.models.random_init import SHAPES, random_model
    cfg = SHAPES[args.shape]
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers)
    batches = [tuple(int(x) for x in b.split("@")) for b in args.batches.split(",")]
    model = random_model(cfg)
    res = {}
    for mode in args.modes.split(","):
        try:
            res[mode] = run_mode(mode, model, batches, args.ctx, args.chain, args.profile)
        except Exception as e:              # a mode XLA refuses is a result too
            res[mode] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
            print(f"{mode}: {res[mode]['error']}", flush=True)
        print(json.dumps({mode: {k: v for k, v in res[mode].items() if k != 'batches'}}), flush=True)
    with open(os.path.join(args.out, "step_launch.json"), "w") as f:
        json.dump({"args": vars(args), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
