"""Light-load latency: TPOT and TTFT at a few batch sizes (default 1 and 64) and the spread of inter-token
latency of one streamed request, on a random-weight model shape; `--peer vllm` measures vLLM the same way in a
process of its own (bench/peers/vllm.py latency mode), before JAX touches the GPU.

Each batch gets fresh random prompts (--prompt-len tokens, --output-len tokens out, greedy, ignore_eos) after a
warm-up. Per request: TTFT from RequestOutput.metrics (arrival to first token on the host) and TPOT = (e2e -
TTFT) / (tokens - 1); the batch's figures are the means over its requests. Inter-token latency (ITL): the gaps
between the tokens `Engine.stream` yields for one request alone, `--streams` requests one after another, their
gaps pooled for p50 and p99 (each stream's kept, with the step records of its largest gaps). The engine is built as
bench/offline.py builds it (bench/setup.py: the product's engine flags and defaults).

Ratios: nfjax_vs_vllm_tpot_bs<B> = vLLM TPOT / nfjax TPOT, so > 1 means nfjax is faster (as nfjax_vs_vllm_*
of bench/offline.py: > 1 means nfjax ahead).

usage: python -m bench.latency --shape llama3-8b --batch-sizes 1,64 [--peer vllm]
CPU:   python -m bench.latency --shape smoke --batch-sizes 1,4 --prompt-len 16 --output-len 8
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import tempfile
import time

from bench.common import GcLog, median_run, module_command
from bench.setup import add_bench_args


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation."""
    import numpy as np
    return float(np.percentile(xs, 100 * q))


def batch_latency(engine, work) -> dict:
    """One `generate` of the batch: mean (and p50) TTFT and TPOT over its requests, in ms."""
    from nfjax.engine import SamplingParams
    t = time.perf_counter()
    outs = engine.generate([p for p, _ in work], [SamplingParams.greedy(max_tokens=n, ignore_eos=True)
                                                  for _, n in work])
    dt = time.perf_counter() - t
    ttft = [o.metrics["ttft_s"] * 1e3 for o in outs]
    tpot = [(o.metrics["e2e_s"] - o.metrics["ttft_s"]) / (len(o.token_ids) - 1) * 1e3 for o in outs]
    return {"batch": len(work), "prompt_len": len(work[0][0]), "output_tokens": sum(len(o.token_ids) for o in outs),
            "seconds": dt, "ttft_ms": statistics.mean(ttft), "ttft_ms_p50": statistics.median(ttft),
            "tpot_ms": statistics.mean(tpot), "tpot_ms_p50": statistics.median(tpot),
            "e2e_ms": statistics.mean(o.metrics["e2e_s"] * 1e3 for o in outs)}


def stream_latency(engine, ids: list[int], n: int) -> dict:
    """One request alone through `Engine.stream`: the host time of each token as it is yielded, and the step
    records (host ms, dispatch, blocked on read, step ms) of the three largest gaps."""
    from nfjax.engine import SamplingParams
    steps = engine.trace.steps
    log = GcLog()
    gc.callbacks.append(log)
    t0 = time.perf_counter()
    times, cpu, tokens, recs = [], [], 0, []
    try:
        for out in engine.stream(ids, SamplingParams.greedy(max_tokens=n, ignore_eos=True)):
            if not out.new_token_ids:
                continue
            times.append(time.perf_counter())
            cpu.append(time.thread_time())
            tokens += len(out.new_token_ids)
            recs.append(steps[-1] if steps else None)
    finally:
        gc.callbacks.remove(log)
    gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    worst = sorted(range(len(gaps)), key=lambda i: -gaps[i])[:3]
    return {"tokens": tokens, "yields": len(times), "ttft_ms": (times[0] - t0) * 1e3,
            "itl_ms_mean": statistics.mean(gaps), "itl_ms_p50": pct(gaps, 0.5), "itl_ms_p99": pct(gaps, 0.99),
            "itl_ms_max": max(gaps), "itl_ms": gaps,
            "gc_in_stream": log.within(times[0], times[-1]),
            # A gap holds the next step's launch (its record comes with the next token: `next_launch`) and this
            # token's step's read and processing (`step`). thread_cpu_ms: this thread's CPU time in the gap (near
            # ms: it was busy; far below: it waited, on the GPU, a lock or the OS); gc: collections in the gap.
            "worst_gaps": [{"token": i + 2, "ms": gaps[i], "thread_cpu_ms": (cpu[i + 1] - cpu[i]) * 1e3,
                            "gc": log.within(times[i], times[i + 1]), "step": _phases(recs[i + 1]),
                            "next_launch": _phases(recs[i + 2] if i + 2 < len(recs) else None)} for i in worst]}


def _phases(rec) -> dict | None:
    """A step record's host phases (ms)."""
    if rec is None:
        return None
    return {"host_ms": rec.host_ms, "host_cpu_ms": rec.host_cpu_ms, "put_ms": rec.put_ms,
            "dispatch_ms": rec.dispatch_ms, "wait_ms": rec.wait_ms, "wait_cpu_ms": rec.wait_cpu_ms,
            "process_ms": rec.process_ms, "step_ms": rec.seconds * 1e3, "slowest_program": rec.slowest_program,
            "slowest_program_ms": rec.slowest_program_ms}


def pooled_streams(runs: list[dict]) -> dict:
    """Several streams' gaps pooled (as vLLM's serving bench pools inter-token latencies over requests), each
    stream kept."""
    gaps = [g for r in runs for g in r["itl_ms"]]
    return {"streams": runs, "tokens": runs[0]["tokens"], "yields": runs[0]["yields"],
            "ttft_ms": statistics.median(r["ttft_ms"] for r in runs), "itl_ms_mean": statistics.mean(gaps),
            "itl_ms_p50": pct(gaps, 0.5), "itl_ms_p99": pct(gaps, 0.99), "itl_ms_max": max(gaps), "itl_ms": gaps,
            "itl_p99_over_p50_by_stream": [r["itl_ms_p99"] / r["itl_ms_p50"] for r in runs]}


def nfjax_latency(args, cfg) -> dict:
    from bench.common import device_name
    from bench.engine_bench import longest
    from bench.setup import bench_engine
    from bench.workloads import fixed
    v = cfg.vocab_size
    # A new seed for every measurement: fresh prompts, as the peer gets (its prefix cache would serve repeats).
    works = {bs: [fixed(bs, args.prompt_len, args.output_len, v, seed=1000 + bs + 7919 * i)
                  for i in range(args.repeats)] for bs in args.batch_sizes}
    solo = fixed(1, args.prompt_len, args.output_len, v, seed=2000)[0]
    warm = fixed(max(args.batch_sizes), args.prompt_len, 4, v, seed=7)
    t = time.perf_counter()
    engine = bench_engine(args, context=longest([*(w for ws in works.values() for w in ws), warm, [solo]]))
    out = {"device": device_name(), "compile_s": time.perf_counter() - t, "num_pages": engine.config.cache.num_pages,
           "memory_after_weights": engine.runner.memory_after_weights, "config": cfg.to_json(), "results": {}}
    batch_latency(engine, warm)
    for bs, repeats in works.items():
        r = out["results"][str(bs)] = median_run([batch_latency(engine, work) for work in repeats])
        print(f"[nfjax bs={bs}] TPOT {r['tpot_ms']:.2f} ms, TTFT {r['ttft_ms']:.1f} ms (median of {len(repeats)}: "
              f"TPOT {', '.join(f'{x:.2f}' for x in r['tpot_ms_repeats'])})", flush=True)
    runs = []
    for i in range(args.streams):
        ids = solo[0] if i == 0 else fixed(1, args.prompt_len, args.output_len, v, seed=2000 + i)[0][0]
        runs.append(stream_latency(engine, ids, solo[1]))
        r = runs[-1]
        w = r["worst_gaps"][0]
        s, nl = w["step"] or {}, w["next_launch"] or {}
        print(f"[nfjax stream {i}] ITL p50 {r['itl_ms_p50']:.2f} ms, p99 {r['itl_ms_p99']:.2f} ms, max "
              f"{r['itl_ms_max']:.2f} ms (token {w['token']}: thread CPU {w['thread_cpu_ms']:.1f} ms; next launch "
              f"{nl.get('host_ms', 0):.1f} ms (CPU {nl.get('host_cpu_ms', 0):.1f}, dispatch "
              f"{nl.get('dispatch_ms', 0):.1f}, slowest {nl.get('slowest_program')} "
              f"{nl.get('slowest_program_ms', 0):.1f}); read {s.get('wait_ms', 0):.1f} (CPU {s.get('wait_cpu_ms', 0):.1f}); "
              f"process {s.get('process_ms', 0):.1f}; gc {[(c['gen'], round(c['ms'], 1)) for c in w['gc']]})",
              flush=True)
    out["stream"] = s = pooled_streams(runs)
    print(f"[nfjax stream, {args.streams} pooled] ITL p50 {s['itl_ms_p50']:.2f} ms, p99 {s['itl_ms_p99']:.2f} ms",
          flush=True)
    return out


def run_vllm(args, cfg, tmp: str) -> dict:
    from bench.peers import VLLM_MODULE, run_json_child
    model = os.path.join(tmp, "model.json")
    with open(model, "w") as f:
        json.dump(cfg.to_json(), f)
    cmd = [*module_command(VLLM_MODULE), "--mode", "latency", "--model-config", model, "--shape", args.shape,
           "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--prompt-len", str(args.prompt_len),
           "--output-len", str(args.output_len), "--repeats", str(args.repeats), *shlex.split(args.vllm_args)]
    print("== vLLM:", " ".join(cmd), flush=True)
    return run_json_child(cmd, args.peer_timeout, label="vllm")


def summarize(ours: dict, vllm: dict | None) -> tuple[dict, list[list]]:
    """Flat summary and table rows from the nfjax result and bench/peers/vllm.py's latency JSON (or None)."""
    summary, rows = {"compile_s": ours["compile_s"]}, []
    peer = (vllm or {}).get("results") or {}
    for bs, r in ours["results"].items():
        summary[f"tpot_ms_bs{bs}"] = r["tpot_ms"]
        summary[f"ttft_ms_bs{bs}"] = r["ttft_ms"]
        p = peer.get(bs) or {}
        if p.get("tpot_ms"):
            summary[f"vllm_tpot_ms_bs{bs}"] = p["tpot_ms"]
            summary[f"nfjax_vs_vllm_tpot_bs{bs}"] = p["tpot_ms"] / r["tpot_ms"]
        if p.get("ttft_ms"):
            summary[f"vllm_ttft_ms_bs{bs}"] = p["ttft_ms"]
        rows.append([bs, r["tpot_ms"], r["ttft_ms"], p.get("tpot_ms"), p.get("ttft_ms"),
                     f"{p['tpot_ms'] / r['tpot_ms']:.2f}x" if p.get("tpot_ms") else "n/a"])
    s = ours["stream"]
    summary.update(itl_p50_ms_bs1=s["itl_ms_p50"], itl_p99_ms_bs1=s["itl_ms_p99"],
                   itl_p99_over_p50_bs1=s["itl_ms_p99"] / s["itl_ms_p50"], ttft_ms_stream_bs1=s["ttft_ms"])
    if "itl_p99_over_p50_by_stream" in s:
        summary["itl_p99_over_p50_bs1_worst_stream"] = max(s["itl_p99_over_p50_by_stream"])
        summary["itl_streams"] = len(s["itl_p99_over_p50_by_stream"])
    if vllm and vllm.get("error"):
        summary["vllm_error"] = vllm["error"][:300]
    return summary, rows


def plot(path: str, ours: dict, vllm: dict | None) -> None:
    from bench.common import save_plot
    bss = [int(b) for b in ours["results"]]
    peer = (vllm or {}).get("results") or {}
    panels = []
    for key, title in (("tpot_ms", "TPOT (ms)"), ("ttft_ms", "TTFT (ms)")):
        series = {"nfjax": (bss, [ours["results"][str(b)][key] for b in bss])}
        got = [b for b in bss if (peer.get(str(b)) or {}).get(key)]
        if got:
            series["vLLM"] = (got, [peer[str(b)][key] for b in got])
        panels.append({"title": title, "xlabel": "batch size", "ylabel": "ms", "series": series, "logx": True})
    streams = ours["stream"].get("streams") or [ours["stream"]]
    panels.append({"title": "inter-token latency, batch 1", "xlabel": "token", "ylabel": "ms",
                   "series": {f"stream {i}": (list(range(2, len(r["itl_ms"]) + 2)), r["itl_ms"])
                              for i, r in enumerate(streams)}})
    save_plot(path, panels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap)
    ap.add_argument("--batch-sizes", type=ints, default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each batch size, fresh prompts each (the median's TPOT and TTFT reported; the "
                         "vLLM peer repeats as many)")
    ap.add_argument("--streams", type=int, default=5,
                    help="lone streamed requests timed one after another; their inter-token gaps are pooled")
    ap.add_argument("--peer", choices=["none", "vllm"], default="none")
    ap.add_argument("--peer-timeout", type=int, default=420, help="seconds for the vLLM process, start-up included")
    ap.add_argument("--vllm-args", default="", help="extra flags for bench/peers/vllm.py")
    ap.add_argument("--name", default="latency")
    args = ap.parse_args()
    if args.output_len < 2 or not args.batch_sizes or args.streams < 1:
        raise SystemExit("--output-len must be >= 2 (TPOT needs two tokens), --batch-sizes non-empty and "
                         "--streams >= 1")
    from bench.setup import model_config               # imports JAX without starting a backend
    cfg = model_config(args)
    vllm = None
    if args.peer == "vllm":          # first: JAX has not touched the GPU yet, and the peer's process is gone after
        with tempfile.TemporaryDirectory() as tmp:
            vllm = run_vllm(args, cfg, tmp)
    ours = nfjax_latency(args, cfg)
    from bench.common import print_table, write_results
    summary, rows = summarize(ours, vllm)
    print_table(["batch", "TPOT ms", "TTFT ms", "vLLM TPOT ms", "vLLM TTFT ms", "vLLM/nfjax TPOT"], rows,
                title=f"{args.shape}, {args.prompt_len} prompt / {args.output_len} output tokens")
    print(f"ITL at batch 1: p50 {summary['itl_p50_ms_bs1']:.2f} ms, p99 {summary['itl_p99_ms_bs1']:.2f} ms "
          f"(p99/p50 {summary['itl_p99_over_p50_bs1']:.2f})", flush=True)
    path = write_results(args.name, summary, {"args": vars(args), "nfjax": ours, "vllm": vllm})
    plot(path[:-len(".json")] + ".png", ours, vllm)


if __name__ == "__main__":
    main()
