"""Offline throughput: the engine on a random-weight model shape, fixed 1024/512 and ShareGPT-shaped
workloads, total tokens/s and % of compute-optimal (measured bf16 GEMM rate / (2 x params)); the HF
transformers continuous-batching peer side by side in the same call.

usage: python bench/offline.py --shape llama3-8b --workloads 1024x512,sharegpt --num-requests 512 \
           --peer-requests 32
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")


def run_peer(args, workload: str, n: int) -> dict:
    """The peer runs first, in its own process, so torch and JAX never hold the GPU at once."""
    cmd = [sys.executable, "bench/hf_peer.py", "--shape", args.shape, "--workload", workload,
           "--num-requests", str(n), "--time-limit", str(max(30, args.peer_timeout - 20))]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        return json.loads(line[-1]) if line else {"error": p.stderr[-1500:]}
    except subprocess.TimeoutExpired:
        return {"error": f"peer timed out after {args.peer_timeout}s"}


def engine_run(args, workloads: list[str]) -> dict:
    """Our engine on every workload (runs in a child process so the GPU is free again for the peer)."""
    from bench.common import device_name
    from bench.engine_bench import cache_for, gemm_tflops, kv_pages, run_workload
    from bench.workloads import parse
    from nfjax.config import EngineConfig, ScheduleConfig, SchedulerConfig, StrategyConfig
    from nfjax.engine import Engine
    from nfjax.models.random_init import SHAPES, random_model
    from nfjax.tokenizer.silent import SilentTokenizer

    cfg = SHAPES[args.shape]
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers)
    gemm = gemm_tflops()
    params = cfg.num_params()
    optimal = gemm * 1e12 / (2 * params)
    model = random_model(cfg)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    works = {w: parse(w, args.num_requests, cfg.vocab_size, seed=1) for w in workloads}
    num_pages = args.num_pages or kv_pages(cfg, args.page_size, args.kv_fraction)
    cache = cache_for(list(works.values()), args.page_size, num_pages)
    sched = SchedulerConfig(token_buckets=buckets, max_seqs=args.max_seqs)
    print(f"gemm {gemm:.0f} TFLOP/s; optimal {optimal:,.0f} tok/s; {num_pages} KV pages; compiling...", flush=True)
    t = time.perf_counter()
    strategies = tuple(StrategyConfig.from_spec(sp, align=64, min_decode=args.strategy_min_decode)
                       for sp in filter(None, args.strategies.split(",")))
    schedule = ScheduleConfig(strategies, streams=args.streams, command_buffers=not args.no_command_buffers)
    engine = Engine(model, SilentTokenizer(cfg.vocab_size), EngineConfig(cfg, cache, sched, schedule=schedule))
    compile_s = time.perf_counter() - t
    out = {"device": device_name(), "gemm_tflops": gemm, "params": params, "optimal_tok_s": optimal,
           "compile_s": compile_s, "buckets": buckets, "num_pages": num_pages, "config": cfg.to_json(),
           "results": {}}
    for w, work in works.items():
        out["results"][w] = run_workload(engine, work, w, optimal)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--workloads", default="1024x512,sharegpt")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--peer-requests", type=int, default=32, help="0 = skip the HF peer")
    ap.add_argument("--peer-timeout", type=int, default=240)
    ap.add_argument("--engine-timeout", type=int, default=600)
    ap.add_argument("--buckets", default="128,256,512,1024,2048")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-fraction", type=float, default=0.9, help="of device memory left after weights")
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages (default: what fits, GPU only)")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (quick runs)")
    ap.add_argument("--no-command-buffers", action="store_true", help="XLA CUDA-graph command buffers off")
    ap.add_argument("--strategies", default="", help="step variants tried before Sequential, in order, e.g. "
                    "nanoflow:llama3-8b_h100_tp1_fullsm,dual_batch:1-1 (default: Sequential only)")
    ap.add_argument("--streams", action="store_true", help="run the strategies' GPU stream regions")
    ap.add_argument("--strategy-min-decode", type=int, default=0,
                    help="use the --strategies only for batches with at least this many decode tokens")
    ap.add_argument("--name", default="offline")
    ap.add_argument("--engine-json", default=None, help=argparse.SUPPRESS)   # child mode
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    if args.engine_json:
        with open(args.engine_json, "w") as f:
            json.dump(engine_run(args, workloads), f)
        return
    # Parent: the engine first (child process), then the peer, each with the GPU to itself.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "engine.json")
        try:
            subprocess.run([sys.executable, *sys.argv, "--engine-json", path], timeout=args.engine_timeout,
                           check=True)
            ours = json.load(open(path))
        except (subprocess.SubprocessError, OSError) as e:
            print(f"engine run failed: {e}", flush=True)
            return
    peers = {}
    for w in workloads if args.peer_requests else ():
        peers[w] = run_peer(args, w, args.peer_requests)
        print(f"[peer {w}] {json.dumps(peers[w])[:400]}", flush=True)
    from bench.common import print_table, write_results
    optimal = ours["optimal_tok_s"]
    rows, summary = [], {"compile_s_all_buckets": ours["compile_s"], "gemm_tflops": ours["gemm_tflops"],
                         "optimal_tok_s": optimal}
    for w, res in ours["results"].items():
        res["peer"] = peers.get(w)
        tot = res["total_tok_s"]
        peer_tok = (peers.get(w) or {}).get("total_tok_s")
        rows.append([w, res["requests"], f"{tot:,.0f}", f"{res['pct_optimal']:.1f}%",
                     f"{peer_tok:,.0f}" if peer_tok else "n/a",
                     f"{100 * peer_tok / optimal:.1f}%" if peer_tok else "n/a",
                     f"{tot / peer_tok:.1f}x" if peer_tok else "n/a"])
        key = {"1024x512": "1024_512", "sharegpt": "sharegpt"}.get(w)
        if key:
            summary[f"total_tok_s_{key}"] = tot
            summary[f"pct_optimal_{key}"] = res["pct_optimal"]
            if peer_tok:
                summary[f"hf_total_tok_s_{key}"] = peer_tok
                summary[f"vs_hf_transformers_ratio_{key}"] = tot / peer_tok
    print_table(["workload", "requests", "nfjax tok/s", "nfjax %opt", "HF tok/s", "HF %opt", "nfjax/HF"], rows)
    print(f"device {ours['device']}  gemm {ours['gemm_tflops']:.0f} TFLOP/s  params {ours['params'] / 1e9:.2f}B  "
          f"optimal {optimal:,.0f} tok/s  compile {ours['compile_s']:.1f}s ({len(ours['buckets'])} buckets)  "
          f"kv pages {ours['num_pages']}")
    write_results(args.name, summary, {"args": vars(args), **ours})


if __name__ == "__main__":
    main()
