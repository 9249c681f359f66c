"""Offline throughput: the engine on a random-weight model shape, fixed 1024/512 and ShareGPT-shaped
workloads, total tokens/s and % of compute-optimal (measured bf16 GEMM rate / (2 x params), the active params
for a mixture of experts: a token reads its top-k experts only); several engine
variants (e.g. Sequential and a NanoFlow plan) and peers side by side in the same call: `--peer hf` (default) the
HF transformers continuous-batching peer, `--peer vllm` vLLM on the exact requests the engine ran
(bench/peers/vllm.py; README "Benchmarks" says how it reaches the GPU machine), `--peer hf,vllm` both, `none`.
Each run also gets its serial floor (bench/run_floor.py): what its own steps allow on this device.

The engine flags are the product's (bench/setup.py), with its defaults; the page table is as wide as the
longest request unless they size it.

usage: python -m bench.offline --shape llama3-8b --workloads 1024x512,sharegpt --num-requests 512 \
           --peer hf,vllm --peer-requests 16 \
           --variants "sequential=;mact=--plan llama3-8b_h100_tp1_beside_mact --page-size 64"
CPU:   python -m bench.offline --shape smoke --workloads 64x16 --num-requests 6 --peer none
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import module_command
from bench.setup import add_bench_args

WORKLOAD_KEYS = {"1024x512": "1024_512", "sharegpt": "sharegpt"}


def parse_variants(spec: str) -> list[tuple[str, list[str]]]:
    """'NAME=FLAGS;NAME=FLAGS' -> [(name, flag list)]; '' -> one variant 'engine' with no extra flags."""
    if not spec.strip():
        return [("engine", [])]
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, eq, flags = part.partition("=")
        name = name.strip()
        if not eq or not name or not name.replace("_", "").replace("-", "").isalnum():
            raise SystemExit(f"--variants: each entry must be NAME=FLAGS with NAME of letters, digits, '-' or "
                             f"'_', got {part!r}")
        if name in (n for n, _ in out):
            raise SystemExit(f"--variants: the name {name!r} is used twice")
        out.append((name, shlex.split(flags)))
    return out


def run_peer(args, workload: str, n: int) -> dict:
    """The peer runs in its own process, so torch and JAX never hold the GPU at once."""
    timeout = args.peer_timeout or 240
    cmd = module_command("bench.peers.hf", "--shape", args.shape, "--workload", workload,
                         "--num-requests", str(n), "--time-limit", str(max(30, timeout - 20)))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        return json.loads(line[-1]) if line else {"error": p.stderr[-1500:]}
    except subprocess.TimeoutExpired:
        return {"error": f"peer timed out after {timeout}s"}


def run_vllm(args, engine: dict, work_dir: str) -> dict:
    """vLLM on the workloads the first finished variant wrote to `work_dir` (its exact ids and lengths), a
    model of the shape that variant ran (its config), in a process of its own after every variant's."""
    from bench.peers import VLLM_MODULE, run_json_child
    model = os.path.join(work_dir, "model.json")
    with open(model, "w") as f:
        json.dump(engine["config"], f)
    cmd = [*module_command(VLLM_MODULE), "--mode", "offline", "--model-config", model, "--shape", args.shape,
           *(a for w in engine["workloads"] for a in ("--workload", f"{w}={os.path.join(work_dir, w + '.json')}")),
           *shlex.split(args.vllm_args)]
    print("== vLLM:", " ".join(cmd), flush=True)
    return run_json_child(cmd, args.peer_timeout or 480, label="vllm")


def engine_run(args, workloads: list[str]) -> dict:
    """Our engine on every workload (a child process per variant, so the GPU is free again afterwards)."""
    import jax

    from bench.common import device_name, measure_copy_bandwidth
    from bench.engine_bench import gemm_tflops, longest, run_workload
    from bench.peers.workload_io import stats as workload_stats
    from bench.run_floor import run_floor
    from bench.setup import bench_engine, config_record, engine_flags, model_config
    from bench.workloads import parse

    cfg = model_config(args)
    gemm = gemm_tflops()
    # the other ceiling of a run's floor (bench/run_floor.py); a small buffer off-GPU, as gemm_tflops does
    copy = measure_copy_bandwidth(2 << 30 if jax.default_backend() == "gpu" else 8 << 20)["bytes_per_s"]
    params = cfg.num_active_params()           # = num_params() for a dense model
    optimal = gemm * 1e12 / (2 * params)
    works = {w: parse(w, args.num_requests, cfg.vocab_size, seed=1) for w in workloads}
    if args.workload_dir:           # the exact requests, for a peer (bench/peers/workload_io.py)
        from bench.peers.workload_io import write_workload
        os.makedirs(args.workload_dir, exist_ok=True)
        for w, work in works.items():
            write_workload(os.path.join(args.workload_dir, f"{w}.json"), work)
    print(f"gemm {gemm:.0f} TFLOP/s; copy {copy / 1e9:,.0f} GB/s; optimal {optimal:,.0f} tok/s; compiling...",
          flush=True)
    t = time.perf_counter()
    engine = bench_engine(args, context=longest(list(works.values())))
    compile_s = time.perf_counter() - t
    ec = engine.config
    print(f"compiled in {compile_s:.1f}s (lowering {engine.runner.lower_seconds:.1f}s, compiling "
          f"{engine.runner.compile_seconds:.1f}s with it, warm-up {engine.warm_up_seconds:.1f}s); "
          f"{ec.cache.num_pages} KV pages, buckets {ec.batcher.token_buckets}, "
          f"{ec.batcher.max_seqs} sequences a step", flush=True)
    temps = engine.runner.largest_temps()
    print("largest program scratch: " + ", ".join(f"{k} {b / 2 ** 30:.2f} GiB" for k, b in temps), flush=True)
    out = {"device": device_name(), "gemm_tflops": gemm, "copy_bytes_per_s": copy, "params": params,
           "total_params": cfg.num_params(), "optimal_tok_s": optimal,
           "compile_s": compile_s, "compile_parts_s": {"lower": engine.runner.lower_seconds,
                                                        "compile": engine.runner.compile_seconds,
                                                        "warm_up": engine.warm_up_seconds},
           "largest_temps": temps, "buckets": ec.batcher.token_buckets,
           "num_pages": ec.cache.num_pages, "memory_after_weights": engine.runner.memory_after_weights,
           "config": cfg.to_json(), "engine_args": engine_flags(args), "engine_config": config_record(ec),
           "results": {}, "workloads": {w: workload_stats(work) for w, work in works.items()}}
    for w, work in works.items():
        res = out["results"][w] = run_workload(engine, work, w, optimal, temperature=args.temperature,
                                               top_p=args.top_p)
        fl = res["floor"] = run_floor(res["per_step"], work, cfg, ec.cache.kv_dtype, gemm, copy)
        if fl:
            print(f"[{w}] floor {fl['floor_s']:.3f} s ({fl['steps']} steps at max(weight read "
                  f"{fl['weight_read_ms']:.2f} ms, GEMM {fl['gemm_us_per_token']:.2f} us/token) + KV reads "
                  f"{fl['attention_s']:.3f} s) allows {100 * fl['floor_tok_s'] / optimal:.1f}% of optimal; "
                  f"any schedule {100 * fl['any_schedule_tok_s'] / optimal:.1f}%; measured "
                  f"{100 * res['total_tok_s'] / fl['floor_tok_s']:.1f}% of the floor", flush=True)
    return out


def kv_dtype(engine_result: dict) -> str:
    """The KV cache format an engine variant ran with."""
    return (engine_result.get("engine_config") or {}).get("cache", {}).get("kv_dtype", "bfloat16")


def summarize(ours: dict[str, dict], peers: dict[str, dict], vllm: dict | None = None) -> tuple[dict, list[list],
                                                                                           float]:
    """Flat summary, table rows and the optimal tok/s used, from each variant's engine result (in the order
    run; the first is the baseline), the HF peer's result per workload and vLLM's (bench/peers/vllm.py's JSON,
    offline mode). % of optimal uses the mean of the GEMM rates the variants measured in this call, so the
    variants are compared on one ceiling. nfjax_vs_vllm_<workload>: the best variant's tok/s over vLLM's.
    floor_pct_optimal_, any_schedule_pct_optimal_ and pct_of_floor_<workload>: the best variant's run floor
    (bench/run_floor.py) against optimal, and its tok/s against that floor, where its result has one."""
    first = next(iter(ours.values()))
    vllm = vllm or {}
    vdoc = vllm.get("partial_result") or vllm     # a run past its time limit: the workloads it finished
    vllm_results = vdoc.get("results") or {}
    gemm = statistics.mean(o["gemm_tflops"] for o in ours.values())
    optimal = gemm * 1e12 / (2 * first["params"])
    summary = {"compile_s_all_buckets": max(o["compile_s"] for o in ours.values()), "gemm_tflops": gemm,
               "optimal_tok_s": optimal}
    rows = []
    for w in first["results"]:
        key = WORKLOAD_KEYS.get(w, w.replace("x", "_"))
        tok = {v: o["results"][w]["total_tok_s"] for v, o in ours.items() if w in o["results"]}
        peer_tok = (peers.get(w) or {}).get("total_tok_s")
        vllm_tok = vllm_results.get(w, {}).get("total_tok_s")
        for v, t in tok.items():
            rows.append([w, v, ours[v]["results"][w]["requests"], f"{t:,.0f}", f"{100 * t / optimal:.1f}%",
                         f"{peer_tok:,.0f}" if peer_tok else "n/a", f"{t / peer_tok:.1f}x" if peer_tok else "n/a",
                         f"{vllm_tok:,.0f}" if vllm_tok else "n/a", f"{t / vllm_tok:.2f}x" if vllm_tok else "n/a"])
            if len(ours) > 1:
                summary[f"total_tok_s_{key}_{v}"] = t
                summary[f"pct_optimal_{key}_{v}"] = 100 * t / optimal
        best = max(tok, key=tok.get)
        summary[f"total_tok_s_{key}"] = tok[best]
        summary[f"pct_optimal_{key}"] = 100 * tok[best] / optimal
        if first.get("config", {}).get("num_experts"):       # e.g. pct_optimal_1024_512_mixtral (#26)
            summary[f"pct_optimal_{key}_{first['config']['model_type']}"] = summary[f"pct_optimal_{key}"]
        summary[f"preemptions_{key}"] = ours[best]["results"][w].get("trace", {}).get("preemptions", 0)
        floor = ours[best]["results"][w].get("floor")     # absent: older result files; None: MoE
        if floor:
            summary[f"floor_pct_optimal_{key}"] = 100 * floor["floor_tok_s"] / optimal
            summary[f"any_schedule_pct_optimal_{key}"] = 100 * floor["any_schedule_tok_s"] / optimal
            summary[f"pct_of_floor_{key}"] = 100 * tok[best] / floor["floor_tok_s"]
        for kv in {kv_dtype(o) for o in ours.values()} - {"bfloat16"}:   # #21's keys, e.g. pct_optimal_1024_512_kv_fp8
            t = max(t for v, t in tok.items() if kv_dtype(ours[v]) == kv)
            summary[f"total_tok_s_{key}_kv_{kv}"] = t
            summary[f"pct_optimal_{key}_kv_{kv}"] = 100 * t / optimal
        if len(ours) > 1:
            summary[f"best_variant_{key}"] = best
            summary[f"best_vs_{next(iter(tok))}_{key}"] = tok[best] / next(iter(tok.values()))
        if vllm_tok:
            summary[f"vllm_total_tok_s_{key}"] = vllm_tok
            summary[f"vllm_output_tok_s_{key}"] = vllm_results[w]["output_tok_s"]
            summary[f"vllm_pct_optimal_{key}"] = 100 * vllm_tok / optimal
            summary[f"nfjax_vs_vllm_{key}"] = tok[best] / vllm_tok
        if peer_tok:
            summary[f"hf_total_tok_s_{key}"] = peer_tok
            summary[f"hf_pct_optimal_{key}"] = 100 * peer_tok / optimal
            summary[f"vs_hf_transformers_ratio_{key}"] = tok[best] / peer_tok
        elif (peers.get(w) or {}).get("partial_total_tok_s"):
            # Cut off by its time limit while its longest requests ran on: its rate so far is above what a
            # finished run would reach, so the ratio is a lower bound.
            part = peers[w]["partial_total_tok_s"]
            summary[f"hf_partial_total_tok_s_{key}"] = part
            summary[f"vs_hf_transformers_ratio_{key}_lower_bound"] = tok[best] / part
    ratios = [k for k in summary if k.startswith("vs_hf_transformers_ratio_") and not k.endswith("_bound")]
    if ratios:          # the headline: the 1024/512 workload where it ran, else the first with a peer
        summary["vs_hf_transformers_ratio"] = summary.get("vs_hf_transformers_ratio_1024_512", summary[ratios[0]])
    ratios = [k for k in summary if k.startswith("nfjax_vs_vllm_")]
    if ratios:
        summary["nfjax_vs_vllm"] = summary.get("nfjax_vs_vllm_1024_512", summary[ratios[0]])
    sent = {w: d["digest"] for w, d in (vdoc.get("workloads") or {}).items()}
    if sent:            # vLLM got the very requests the baseline variant ran (ids and lengths)
        summary["vllm_same_requests"] = sent == {w: first.get("workloads", {}).get(w, {}).get("digest")
                                                 for w in sent}
    if vllm.get("error"):
        summary["vllm_error"] = vllm["error"][:300]
    return summary, rows, optimal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap)
    ap.add_argument("--workloads", default="1024x512,sharegpt")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--peer", default="hf", help="peers after the engine variants: hf, vllm, hf,vllm or none")
    ap.add_argument("--peer-requests", type=int, default=32, help="HF peer's requests; 0 = skip the HF peer")
    ap.add_argument("--peer-timeout", type=int, default=None, help="seconds for each peer process (default: "
                    "240 for each HF run, 480 for the vLLM run, which includes its start-up)")
    ap.add_argument("--vllm-args", default="", help="extra flags for bench/peers/vllm.py, e.g. '--max-num-seqs 256'")
    ap.add_argument("--engine-timeout", type=int, default=600, help="seconds for each variant's process")
    ap.add_argument("--variants", default="", help="engine variants compared in this call: 'NAME=FLAGS;...', "
                    "FLAGS being engine flags (they override the ones given outside); the first "
                    "is the baseline. Default: one variant from the flags given")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the engine's requests sampled at this temperature, a seed each (default 0: greedy); "
                         "the peers run greedy, so only with --peer none")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="the sampled requests' top-p (default 1: off; below 1 needs --temperature > 0)")
    ap.add_argument("--name", default="offline")
    ap.add_argument("--engine-json", default=None, help=argparse.SUPPRESS)   # child mode
    ap.add_argument("--workload-dir", default=None, help=argparse.SUPPRESS)  # child mode: write the requests here
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    peer_kinds = set(filter(None, args.peer.split(","))) - {"none"}
    if peer_kinds - {"hf", "vllm"}:
        raise SystemExit(f"--peer: expected hf, vllm, hf,vllm or none, got {args.peer!r}")
    if args.temperature < 0 or (args.temperature > 0 and peer_kinds):
        raise SystemExit(f"--temperature: >= 0, and > 0 only with --peer none (the peers run greedy), got "
                         f"{args.temperature} with --peer {args.peer}")
    if not 0 < args.top_p <= 1 or (args.top_p < 1 and args.temperature <= 0):
        raise SystemExit(f"--top-p: in (0, 1], and below 1 only with --temperature > 0, got {args.top_p}")
    if args.engine_json:
        with open(args.engine_json, "w") as f:
            json.dump(engine_run(args, workloads), f)
        return
    variants = parse_variants(args.variants)
    # The engine variants first, each in its own child process, then the peers: each has the GPU to itself.
    ours: dict[str, dict] = {}
    vllm = None
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in variants:
            path = os.path.join(tmp, f"{name}.json")
            print(f"== variant {name}: {' '.join(flags) or '(the flags given)'}", flush=True)
            try:
                subprocess.run(module_command("bench.offline", *sys.argv[1:], *flags, "--engine-json", path,
                                              "--workload-dir", os.path.join(tmp, f"work-{name}")),
                               timeout=args.engine_timeout, check=True)
                ours[name] = json.load(open(path))
            except (subprocess.SubprocessError, OSError) as e:
                print(f"variant {name} failed: {e}", flush=True)
        if not ours:
            print("no engine variant finished", flush=True)
            sys.exit(1)
        if "vllm" in peer_kinds:
            first = next(iter(ours))
            vllm = run_vllm(args, ours[first], os.path.join(tmp, f"work-{first}"))
    peers = {}
    for w in workloads if args.peer_requests and "hf" in peer_kinds else ():
        peers[w] = run_peer(args, w, args.peer_requests)
        print(f"[peer {w}] {json.dumps(peers[w])[:400]}", flush=True)
    from bench.common import print_table, write_results
    summary, rows, optimal = summarize(ours, peers, vllm)
    print_table(["workload", "variant", "requests", "tok/s", "% optimal", "HF tok/s", "nfjax/HF", "vLLM tok/s",
                 "nfjax/vLLM"], rows)
    if vllm is not None:
        print(f"vLLM: {vllm.get('vllm')} engine {vllm.get('engine')} init {vllm.get('init_s')} s"
              + (f"  ERROR {vllm['error'][:300]}" if vllm.get("error") else ""), flush=True)
    for name, o in ours.items():
        print(f"{name}: device {o['device']}  gemm {o['gemm_tflops']:.0f} TFLOP/s  compile {o['compile_s']:.1f}s "
              f"({len(o['buckets'])} buckets)  kv pages {o['num_pages']}  {o['engine_args']}")
    print(f"optimal {optimal:,.0f} tok/s (mean GEMM rate of the variants' processes)")
    failed = [n for n, _ in variants if n not in ours]
    write_results(args.name, summary, {"args": vars(args), "variants": dict(variants), "failed_variants": failed,
                                       "engines": ours, "peers": peers, "vllm": vllm})


if __name__ == "__main__":
    main()
