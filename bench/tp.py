"""Tensor-parallel scaling (issue #6): offline throughput at TP=1 vs TP=2 on a random-weight model shape, and
the share of TP=2 time spent in the row-parallel all-reduces, measured two ways:

  (a) the same engine compiled with `ParallelConfig(skip_collectives=True)` (benchmark only: no psums, so the
      tokens are wrong; output lengths are fixed, so the schedule is the same): share = 1 - t_without / t_with,
      for the whole offline run and for fixed synthetic batches timed on the compiled steps;
  (b) a jax.profiler trace of a few steps of each synthetic batch, parsed on the device: collective kernel
      time / kernel time (busiest stream, plus collective kernels that ran on other streams).

Weights are created straight into their shards (`random_model(sharding_fn=...)`). Each TP degree runs in its
own process, one after the other, so each finds the GPUs' memory free.

Engine flags as in the product (bench/setup.py); the synthetic batches' buckets are compiled beside the
flags' (or the device's default) ones, and the KV pages are capped at what the run can use, so every TP degree
runs the same schedule.

usage (2 GPUs): python -m bench.tp --shape llama3-8b --num-requests 256 --out $OUT
       70B shape, fewer layers: python -m bench.tp --shape llama3-70b --layers 20 --num-requests 128 --out $OUT
       CPU smoke:  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m bench.tp --shape smoke \\
                       --num-requests 8 --workload 64x16 --out /tmp/tp_smoke
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.common import module_command
from bench.setup import add_bench_args, model_config

# Synthetic-batch sizes: the GPU run, and a CPU smoke run of the tiny shape.
DEFAULTS = {"gpu": dict(decode=256, mixed=2048, ctx=1280), "smoke": dict(decode=16, mixed=128, ctx=48)}
# Kernel names of collectives (lower case, '-' and '_' dropped): NCCL's (ncclDevKernel_AllReduce_Sum_bf16_...)
# and XLA's own collective kernels.
COLLECTIVE = ("nccl", "allreduce", "allgather", "reducescatter")
ALL_REDUCE = ("allreduce",)


def child(args) -> dict:
    """One TP degree: init, then per variant (with / without collectives) compile, offline run, step timing;
    the results so far are written to `args.child_json` after each variant."""
    import jax
    from flax import nnx
    from bench.common import device_info
    from bench.engine_bench import gemm_tflops, longest, pages_needed, run_workload, time_batches
    from bench.setup import bench_engine, config_record, setting
    from bench.step_bench import decode_batch, mixed_batch, synthetic_context, synthetic_pages
    from bench.workloads import parse
    from nfjax.compat import on_gpu
    from nfjax.engine.builder import CPU_BUCKETS, GPU_BUCKETS
    from nfjax.models.random_init import random_model
    from nfjax.parallel import make_mesh, sharding_fn, tp_config

    tp, ps = args.child_tp, setting(args, "cache", "page_size")
    cfg = model_config(args)
    tp_config(cfg, tp)
    mesh = make_mesh(tp)
    gemm = gemm_tflops()
    optimal = tp * gemm * 1e12 / (2 * cfg.num_active_params())   # tp GPUs' GEMM rate; MoE: active params
    t = time.perf_counter()
    model = random_model(cfg, sharding_fn=sharding_fn(mesh))
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    init_s = time.perf_counter() - t
    work = parse(args.workload, args.num_requests, cfg.vocab_size, seed=1)
    batches = {f"decode{args.decode}": decode_batch(args.decode, args.ctx, ps),
               f"mixed{args.mixed}": mixed_batch(args.mixed, args.ctx, ps)}
    seqs = [s for _, s, _ in batches.values()]
    need = max(pages_needed([work], ps, args.max_seqs), synthetic_pages(seqs))
    buckets = tuple(sorted({*(args.token_buckets or (GPU_BUCKETS if on_gpu() else CPU_BUCKETS)),
                            args.decode, args.mixed}))
    print(f"[tp={tp}] init {init_s:.1f}s; gemm {gemm:.1f} TFLOP/s/device", flush=True)
    out = {"tp": tp, "device": device_info(), "gemm_tflops": gemm, "optimal_tok_s": optimal, "init_s": init_s,
           "buckets": buckets, "config": cfg.to_json(), "variants": {}}
    variants = [False, True] if tp > 1 and not args.no_skip else [False]
    for skip in variants:
        label = f"tp{tp}" + ("-nocoll" if skip else "")
        t = time.perf_counter()
        engine = bench_engine(args, context=max(longest([work]), synthetic_context(seqs, ps)), max_pages=need,
                              model=model, mesh=mesh, take_weights=skip is variants[-1],  # the last may free it
                              extra={"parallel": {"tp": tp, "skip_collectives": skip},
                                     "batcher": {"token_buckets": buckets}})
        res = {"compile_s": time.perf_counter() - t}
        out["num_pages"] = engine.config.cache.num_pages
        out["engine_config"] = config_record(engine.config)
        print(f"    [{label}] {out['num_pages']} KV pages", flush=True)
        res.update(run_workload(engine, work, label, optimal))
        res["steps"] = time_batches(engine.runner, batches)
        for name, st in res["steps"].items():
            print(f"    [{label}] {name}: {st['step_ms']:.2f} ms/step", flush=True)
        if args.profile and tp > 1 and not skip:
            profile_batches(engine.runner, batches, res["steps"], args.profile_dir, label)
        out["variants"]["skip" if skip else "with"] = res
        with open(args.child_json, "w") as f:      # after each variant: a later timeout keeps this one
            json.dump(out, f)
        del engine
        gc.collect()                     # frees this variant's KV cache before the next one allocates its own
    return out


def profile_batches(runner, batches: dict, steps: dict, root: str, label: str) -> None:
    """Adds a "trace" entry (see `trace_collectives`) to each synthetic batch's result in `steps`."""
    import numpy as np
    from bench.engine_bench import step_fn
    from bench.step_bench import make_step_input
    for name, (bucket, seqs, nd) in batches.items():
        inp = make_step_input(runner, seqs, bucket, nd, np.random.default_rng(0))
        tr = trace_collectives(step_fn(runner, bucket, inp),
                               os.path.join(root, f"{label}-{name}"))
        steps[name]["trace"] = tr
        if "share" in tr:
            print(f"    [{label}] {name}: all-reduce kernels {tr['allreduce_ms']:.2f} ms = "
                  f"{100 * tr['allreduce_share']:.1f}% of {tr['kernel_ms']:.2f} ms kernel time "
                  f"(all collectives {100 * tr['share']:.1f}%)", flush=True)
        else:
            print(f"    [{label}] {name}: trace: {tr.get('error')}", flush=True)


def trace_collectives(fn, trace_dir: str, calls: int = 3) -> dict:
    """Per call: kernel time of the busiest GPU stream, collective kernel time (on any stream), the share of
    collectives in (busiest stream + collectives elsewhere), averaged over the GPUs; from a profiler trace.
    `share` counts every collective (also the few small ones of sampling from vocab-sharded logits),
    `allreduce_share` the all-reduces only."""
    from bench.step_bench import trace
    pd = trace(fn, os.path.dirname(trace_dir), os.path.basename(trace_dir), calls)
    if isinstance(pd, str):          # a profiler failure must not lose the timings
        return {"error": pd}
    return kernel_shares(pd.planes, calls)


def kernel_shares(planes, calls: int) -> dict:
    """The parse of `trace_collectives` over a trace's planes (ProfileData: plane.name, .lines; line.name,
    .events; event.name, .duration_ns)."""
    per_gpu, names = [], {}
    for plane in planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = {}
        streams = [ln for ln in plane.lines if "stream" in ln.name.lower()]
        for line in streams or plane.lines:              # other lines aggregate the same kernels (modules, ops)
            tot = coll = ar = 0.0
            for ev in line.events:
                ms, low = ev.duration_ns / 1e6 / calls, ev.name.lower().replace("-", "").replace("_", "")
                tot += ms
                if any(p in low for p in COLLECTIVE):
                    coll += ms
                    ar += ms if any(p in low for p in ALL_REDUCE) else 0.0
                    names[ev.name[:120]] = names.get(ev.name[:120], 0.0) + ms
            lines[line.name] = (tot, coll, ar)
        if not lines:
            continue
        busiest = max(lines, key=lambda k: lines[k][0])
        coll = sum(v[1] for v in lines.values())
        kernel = lines[busiest][0] + coll - lines[busiest][1]
        ar = sum(v[2] for v in lines.values())
        per_gpu.append({"plane": plane.name, "busiest_line": busiest, "kernel_ms": kernel, "collective_ms": coll,
                        "allreduce_ms": ar, "share": coll / kernel if kernel else 0.0,
                        "allreduce_share": ar / kernel if kernel else 0.0})
    if not per_gpu:
        return {"error": "no GPU planes in the trace (CPU run?)"}
    avg = {k: sum(g[k] for g in per_gpu) / len(per_gpu)
           for k in ("kernel_ms", "collective_ms", "allreduce_ms", "share", "allreduce_share")}
    top = sorted(names.items(), key=lambda kv: -kv[1])[:8]
    return {**avg, "gpus": per_gpu, "collective_kernels": [{"name": k, "ms": v / len(per_gpu)} for k, v in top]}


def summarize(runs: dict[int, dict]) -> tuple[dict, list[list]]:
    """Flat summary and table rows from the per-TP results."""
    summary, rows = {}, []
    base = runs.get(1, {}).get("variants", {}).get("with", {}).get("total_tok_s")
    for tp, r in sorted(runs.items()):
        summary[f"init_s_tp{tp}"] = r["init_s"]
        with_ = r["variants"]["with"]
        for kind, v in r["variants"].items():
            sfx = f"tp{tp}" + ("_no_collectives" if kind == "skip" else "")
            summary[f"total_tok_s_{sfx}"] = v["total_tok_s"]
            summary[f"compile_s_{sfx}"] = v["compile_s"]
            for name, st in v["steps"].items():
                summary[f"step_ms_{sfx}_{name}"] = st["step_ms"]
                if "share" in st.get("trace", {}):
                    summary[f"allreduce_time_share_{sfx}_trace_{name}"] = st["trace"]["allreduce_share"]
                    summary[f"collective_time_share_{sfx}_trace_{name}"] = st["trace"]["share"]
            rows.append([tp, "off" if kind == "skip" else "on", f"{v['total_tok_s']:,.0f}",
                         f"{v['total_tok_s'] / base:.2f}x" if base else "n/a",
                         *[f"{st['step_ms']:.2f}" for st in v["steps"].values()],
                         *[f"{100 * st['trace']['allreduce_share']:.1f}%" if "share" in st.get("trace", {}) else "n/a"
                           for st in v["steps"].values()]])
        if tp > 1 and base:
            summary[f"tp{tp}_speedup"] = with_["total_tok_s"] / base
        skip = r["variants"].get("skip")
        if skip:          # (a): same tokens in both runs, so the time share is 1 - rate_with / rate_without
            summary[f"allreduce_time_share_tp{tp}"] = 1 - with_["total_tok_s"] / skip["total_tok_s"]
            for name, st in with_["steps"].items():
                summary[f"allreduce_time_share_tp{tp}_{name}"] = 1 - skip["steps"][name]["step_ms"] / st["step_ms"]
    return summary, rows


def plot(runs: dict[int, dict], path: str) -> None:
    from bench.common import save_plot
    tps = sorted(runs)
    thr = {"with collectives": (tps, [runs[t]["variants"]["with"]["total_tok_s"] for t in tps])}
    skip_tps = [t for t in tps if "skip" in runs[t]["variants"]]
    if skip_tps:
        thr["without (benchmark only)"] = (skip_tps, [runs[t]["variants"]["skip"]["total_tok_s"] for t in skip_tps])
    steps = {}
    for kind, tag in (("with", ""), ("skip", " no coll.")):
        for name in runs[tps[0]]["variants"]["with"]["steps"]:
            xs = [t for t in tps if kind in runs[t]["variants"]]
            if xs:
                steps[name + tag] = (xs, [runs[t]["variants"][kind]["steps"][name]["step_ms"] for t in xs])
    save_plot(path, [{"title": "offline throughput", "xlabel": "TP", "ylabel": "total tok/s", "series": thr},
                     {"title": "synthetic step time", "xlabel": "TP", "ylabel": "ms / step", "series": steps}])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap)
    ap.add_argument("--tps", default="1,2", help="TP degrees, each in its own process")
    ap.add_argument("--workload", default="1024x512", help="INxOUT or sharegpt")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--decode", type=int, default=None, help="decode tokens of the synthetic decode batch")
    ap.add_argument("--mixed", type=int, default=None, help="bucket of the synthetic mixed batch")
    ap.add_argument("--ctx", type=int, default=None, help="context of the synthetic decodes")
    ap.add_argument("--no-skip", action="store_true", help="no without-collectives variant")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="no profiler trace")
    ap.add_argument("--child-timeout", type=int, default=360)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--child-tp", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    for k, v in DEFAULTS["smoke" if args.shape == "smoke" else "gpu"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.profile_dir = os.path.join(tempfile.gettempdir(), "nfjax_tp_prof")
    if args.child_tp:
        child(args)
        return
    runs: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (int(x) for x in args.tps.split(",")):
            path = os.path.join(tmp, f"tp{tp}.json")
            try:
                subprocess.run(module_command("bench.tp", *sys.argv[1:], "--child-tp", str(tp), "--child-json", path),
                               timeout=args.child_timeout, check=True)
            except subprocess.SubprocessError as e:
                print(f"tp={tp} failed: {e}", flush=True)
            if os.path.exists(path):                 # also what a failed child finished
                runs[tp] = json.load(open(path))
    if not runs:
        sys.exit(1)
    from bench.common import print_table, result_path, write_results
    summary, rows = summarize(runs)
    names = list(next(iter(runs.values()))["variants"]["with"]["steps"])
    print_table(["TP", "collectives", "tok/s", "vs TP1", *[f"{n} ms" for n in names],
                 *[f"{n} trace AR%" for n in names]], rows,
                title=f"{args.shape} ({model_config(args).num_layers} layers), {args.workload} x {args.num_requests}")
    for k in sorted(summary):
        if k.startswith(("allreduce", "tp")):
            print(f"  {k}: {summary[k]:.3f}")
    plot(runs, result_path("tp", args.out).replace(".json", ".png"))
    write_results("tp", summary, {"args": vars(args), "runs": {str(k): v for k, v in runs.items()}},
                  out_dir=args.out)


if __name__ == "__main__":
    main()
