"""Multi-round conversations with the prefix cache and its host and disk tiers (issue #23, NanoFlow 4.2.2).

Synthetic ShareGPT-like chats: each conversation has 4-8 turns (`--turns`), its first user message and each
later one log-normal in length, each answer too; a turn's prompt is the whole history plus the new message
(token ids, so the history is exactly the tokens the engine produced). `--concurrency` conversations are in
flight at once and the next turn of one is submitted when its previous answer finishes, so the turns of many
conversations interleave and the GPU cache alone cannot hold them (`--max-pages` caps the GPU pool).

Three engines run the same conversations: the prefix cache off, GPU cache only, GPU + host + disk tiers; each
reports TTFT p50/p99, total (prompt + generated) tokens/s and its hits per tier. A single-round workload
(unique prompts: nothing to reuse) runs on the GPU-only engine and on the tiered one, which pays for copying
evicted pages out: `offload_overhead_pct`.

Summary keys: multiround_ttft_speedup (p50 TTFT off / tiers), multiround_throughput_speedup (tiers / off),
prefix_hit_rate (tiers), offload_overhead_pct.

usage: python -m bench.multiround --shape llama3-8b --conversations 256 --concurrency 64 --max-pages 4096 \
           --host-cache-gb 32 --disk-cache-dir /tmp/nfjax-kv --disk-cache-gb 64
CPU:   python -m bench.multiround --shape smoke --layers 2 --conversations 8 --concurrency 4 --msg-len 12 \
           --out-len 6 --max-pages 40 --host-cache-gb 0.0001 --disk-cache-gb 0.001

On a GPU the three engines (each compiling its programs, ~200 s each at 8B with 256 conversations) outlast one
10-minute device command: `--configs off,gpu` in one call and `--configs tiers --merge <first JSON>` in the
next (the summary needs all three), and the engine flag `--compile-cache DIR` so the second and third engines load
the first one's compiled programs (JAX's persistent compilation cache).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from bench.common import merged_parts, print_table, write_results
from bench.setup import add_bench_args, bench_engine, config_record, engine_flags

CONFIGS = ("off", "gpu", "tiers")


def lognormal(rng, mean: float, lo: int, hi: int) -> int:
    return int(np.clip(rng.lognormal(np.log(mean), 0.6), lo, hi))


def make_conversations(n: int, turns: tuple[int, int], msg_len: float, out_len: float, vocab: int, seed: int):
    """Per conversation: a list of turns (new user message ids, answer length)."""
    rng = np.random.default_rng(seed)
    convs = []
    for _ in range(n):
        k = int(rng.integers(turns[0], turns[1] + 1))
        convs.append([([int(t) for t in rng.integers(0, vocab, lognormal(rng, msg_len * (2 if i == 0 else 1), 2,
                                                                          int(16 * msg_len)))],
                       lognormal(rng, out_len, 1, int(8 * out_len))) for i in range(k)])
    return convs


def progress_line(name: str, turns: int, elapsed: float, tokens: int, st: dict) -> str:
    """One line of a run in progress: turns, tok/s and hit rate so far, and where the tiers' time went (rows
    moved each way, disk bytes, the engine's seconds blocked in tier loads and in evictions)."""
    line = (f"[{name}] {turns} turns, {elapsed:.0f} s, {tokens / max(elapsed, 1e-9):,.0f} tok/s, hit rate "
            f"{st.get('hit_rate', 0.0):.3f} (gpu {st.get('hit_tokens_gpu', 0):,} host {st.get('hit_tokens_host', 0):,}"
            f" disk {st.get('hit_tokens_disk', 0):,} tokens)")
    if "rows_to_host" in st:
        line += (f"; rows to/from host {st['rows_to_host']:,}/{st['rows_from_host']:,}, dropped "
                 f"{st.get('evictions_dropped', 0):,}, skipped host/disk {st.get('skipped_pages_host', 0):,}/"
                 f"{st.get('skipped_pages_disk', 0):,}, disk MiB w/r {st.get('bytes_to_disk', 0) / 2 ** 20:,.0f}/"
                 f"{st.get('bytes_from_disk', 0) / 2 ** 20:,.0f} (backlog {st.get('disk_write_backlog', 0)}, dropped "
                 f"{st.get('disk_writes_dropped', 0)}), "
                 f"blocked in loads {st.get('tier_load_s', 0.0):.2f} s, evictions {st.get('evict_s', 0.0):.2f} s "
                 f"(launches {st.get('evict_launch_s', 0.0):.2f} s), "
                 f"step waits {st.get('tier_step_waits', 0)}")
    return line


def run_conversations(engine, convs, concurrency: int, context: int, name: str = "", progress_s: float = 20.0,
                      log=print) -> dict:
    """Closed loop: `concurrency` conversations at once, each submitting its next turn when the last finishes.
    Every `progress_s` seconds (0: never) a `progress_line` goes to `log`, so a run killed by a timeout still
    shows how far it got and where its time went."""
    from nfjax.engine import SamplingParams
    hist = {i: [] for i in range(len(convs))}
    turn = {i: 0 for i in range(len(convs))}
    todo = list(range(len(convs)))[::-1]
    live: dict[str, tuple[int, int]] = {}                  # request id -> (conversation, prompt length)
    ttft, prompt_tok, gen_tok, turns_done, done_tok = [], 0, 0, 0, 0

    def submit(c):
        nonlocal prompt_tok
        msg, out = convs[c][turn[c]]
        prompt = hist[c] + msg
        if len(prompt) + out >= context:
            return False                                   # the conversation outgrew the context: it ends
        hist[c] = prompt
        live[engine.add_request(prompt, SamplingParams.greedy(max_tokens=out, ignore_eos=True))] = (c, len(prompt))
        prompt_tok += len(prompt)
        return True

    def start_next():
        while todo and len(live) < concurrency:
            submit(todo.pop())
    t0 = time.perf_counter()
    next_report = t0 + progress_s
    start_next()
    while engine.has_unfinished():
        for o in engine.step():
            if not o.finished:
                continue
            c, plen = live.pop(o.request_id)
            ttft.append(o.metrics["ttft_s"])
            gen_tok += len(o.token_ids)
            done_tok += plen + len(o.token_ids)
            turns_done += 1
            hist[c] = hist[c] + o.token_ids
            turn[c] += 1
            if turn[c] < len(convs[c]) and submit(c):
                continue
            start_next()
        if progress_s and time.perf_counter() >= next_report:
            now = time.perf_counter()
            log(progress_line(name, turns_done, now - t0, done_tok, engine.prefix_stats()), flush=True)
            next_report = now + progress_s
    dt = time.perf_counter() - t0
    return {"turns": turns_done, "seconds": dt, "prompt_tokens": prompt_tok, "generated_tokens": gen_tok,
            "total_tok_s": (prompt_tok + gen_tok) / dt, "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": float(np.percentile(ttft, 99)), "ttft_mean_s": statistics.fmean(ttft)}


def run_single_round(engine, n: int, msg_len: float, out_len: float, vocab: int, seed: int) -> dict:
    from nfjax.engine import SamplingParams
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, vocab, lognormal(rng, 4 * msg_len, 2, int(32 * msg_len)))]
               for _ in range(n)]
    outs_len = [lognormal(rng, out_len, 1, int(8 * out_len)) for _ in range(n)]
    t = time.perf_counter()
    outs = engine.generate(prompts, [SamplingParams.greedy(max_tokens=m, ignore_eos=True) for m in outs_len])
    dt = time.perf_counter() - t
    tok = sum(map(len, prompts)) + sum(len(o.token_ids) for o in outs)
    return {"requests": n, "seconds": dt, "total_tok_s": tok / dt,
            "ttft_p50_s": statistics.median(o.metrics["ttft_s"] for o in outs)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--conversations", type=int, default=256)
    g.add_argument("--concurrency", type=int, default=64, help="conversations in flight at once")
    g.add_argument("--turns", default="4,8", help="turns per conversation, MIN,MAX")
    g.add_argument("--msg-len", type=float, default=80, help="mean user message tokens (the first: twice)")
    g.add_argument("--out-len", type=float, default=200, help="mean answer tokens")
    g.add_argument("--single-requests", type=int, default=None, help="single-round requests (default: conversations)")
    g.add_argument("--single-repeats", type=int, default=1,
                   help="single-round runs per engine, each of fresh prompts (the median counts)")
    g.add_argument("--max-pages", type=int, default=None, help="cap on the GPU KV pages (so the GPU cache overflows)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out-dir", default=None)
    g.add_argument("--name", default="multiround")
    g.add_argument("--configs", default=",".join(CONFIGS), help=f"engines to run, a subset of {','.join(CONFIGS)}")
    g.add_argument("--merge", default=None, help="result JSONs of earlier runs whose engines this one skipped")
    g.add_argument("--progress-s", type=float, default=20.0, help="seconds between progress lines (0: none)")
    g.add_argument("--tier-host-gbps", type=float, default=None,
                   help="host tier -> device GB/s for the tier rule (default: measured on a GPU, else a default)")
    g.add_argument("--tier-disk-gbps", type=float, default=None, help="disk tier read GB/s for the tier rule")
    g.add_argument("--tier-gemm-tflops", type=float, default=None,
                   help="recompute rate for the tier rule (TFLOP/s of the whole mesh)")
    args = p.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not names or set(names) - set(CONFIGS):
        p.error(f"--configs {args.configs}: choose from {','.join(CONFIGS)}")
    lo, hi = (int(x) for x in args.turns.split(","))
    host_gb = args.host_cache_gb or 4.0
    disk_dir = args.disk_cache_dir or tempfile.mkdtemp(prefix="nfjax-kv-")
    disk_gb = args.disk_cache_gb or 2 * host_gb
    base = dict(vars(args), host_cache_gb=None, disk_cache_dir=None, disk_cache_gb=None, prefix_cache=None)
    configs = {"off": dict(base, prefix_cache=False), "gpu": base,
               "tiers": dict(base, host_cache_gb=host_gb, disk_cache_dir=disk_dir, disk_cache_gb=disk_gb)}
    results, stats, records = _merge(args.merge) if args.merge else ({}, {}, {})
    for name in names:
        a = configs[name]
        t0 = time.perf_counter()
        engine = bench_engine(a, max_pages=args.max_pages)
        print(f"[{name}] engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
        try:
            if name == "tiers":
                engine.set_tier_rates(
                    gemm_flops=args.tier_gemm_tflops and args.tier_gemm_tflops * 1e12,
                    host_bytes_s=args.tier_host_gbps and args.tier_host_gbps * 1e9,
                    disk_bytes_s=args.tier_disk_gbps and args.tier_disk_gbps * 1e9)
                print(f"[{name}] {engine.tier_line()}", flush=True)
            cfg = engine.config
            context = cfg.cache.max_model_len
            vocab = min(cfg.model.vocab_size, 32000)
            convs = make_conversations(args.conversations, (lo, hi), args.msg_len, args.out_len, vocab, args.seed)
            engine.generate([[1, 2, 3]] * 2, None)                  # warm-up (programs are compiled at start)
            results[name] = {"multiround": run_conversations(engine, convs, args.concurrency, context, name,
                                                             args.progress_s)}
            stats[name] = engine.prefix_stats()
            if name != "off":
                # fresh prompts each repeat (a repeat of the same prompts would hit the cache); the median run
                runs = [run_single_round(engine, args.single_requests or args.conversations, args.msg_len,
                                         args.out_len, vocab, args.seed + 1 + 1000 * i)
                        for i in range(args.single_repeats)]
                results[name]["single"] = dict(sorted(runs, key=lambda r: r["total_tok_s"])[len(runs) // 2],
                                               runs_tok_s=[r["total_tok_s"] for r in runs])
            records[name] = config_record(cfg)
            m = results[name]["multiround"]
            print(f"[{name}] {m['turns']} turns in {m['seconds']:.1f} s: {m['total_tok_s']:,.0f} tok/s, TTFT p50 "
                  f"{m['ttft_p50_s'] * 1e3:.1f} ms p99 {m['ttft_p99_s'] * 1e3:.1f} ms, hit rate "
                  f"{stats[name]['hit_rate']:.3f}; single-round "
                  f"{results[name].get('single', {}).get('total_tok_s', float('nan')):,.0f} tok/s", flush=True)
        finally:
            engine.close()
        del engine
    if set(results) != set(CONFIGS):
        path = write_results(args.name, {}, {"flags": engine_flags(args), "results": results, "prefix_stats": stats,
                                             "configs": records}, out_dir=args.out_dir)
        print(f"part with {', '.join(results)}: no summary until all of {', '.join(CONFIGS)} ran ({path})")
        return {}
    rows = []
    for name in CONFIGS:
        r = results[name]
        m, s = r["multiround"], stats[name]
        rows.append([name, m["ttft_p50_s"] * 1e3, m["ttft_p99_s"] * 1e3, m["total_tok_s"], s["hit_rate"],
                     s["hit_tokens_gpu"], s["hit_tokens_host"], s["hit_tokens_disk"],
                     (s["bytes_to_host"] + s["bytes_from_host"]) / 2 ** 20, r.get("single", {}).get("total_tok_s")])
    print_table(["cache", "TTFT p50 ms", "p99 ms", "tok/s", "hit rate", "gpu hits", "host hits", "disk hits",
                 "host MiB moved", "single-round tok/s"], rows, title="multi-round conversations")
    off, tiers = results["off"]["multiround"], results["tiers"]["multiround"]
    summary = {"multiround_ttft_speedup": off["ttft_p50_s"] / tiers["ttft_p50_s"],
               "multiround_ttft_p99_speedup": off["ttft_p99_s"] / tiers["ttft_p99_s"],
               "multiround_throughput_speedup": tiers["total_tok_s"] / off["total_tok_s"],
               "multiround_gpu_only_ttft_speedup": off["ttft_p50_s"] / results["gpu"]["multiround"]["ttft_p50_s"],
               "prefix_hit_rate": stats["tiers"]["hit_rate"],
               "prefix_hit_rate_gpu_only": stats["gpu"]["hit_rate"],
               "offload_overhead_pct": 100 * (results["gpu"]["single"]["total_tok_s"]
                                              / results["tiers"]["single"]["total_tok_s"] - 1)}
    for tier in ("gpu", "host", "disk"):
        pt = stats["tiers"]["prompt_tokens"]
        summary[f"prefix_hit_rate_{tier}"] = stats["tiers"][f"hit_tokens_{tier}"] / pt if pt else 0.0
    print(" ".join(f"{k}={v:.3g}" for k, v in summary.items()), flush=True)
    write_results(args.name, summary, {"flags": engine_flags(args), "results": results, "prefix_stats": stats,
                                          "configs": records}, out_dir=args.out_dir)
    return summary


def _merge(paths: str) -> tuple[dict, dict, dict]:
    results, stats, records = {}, {}, {}
    for path, data in merged_parts(paths, "bench.multiround"):
        try:
            for name, r in data["results"].items():
                results[name], stats[name], records[name] = r, data["prefix_stats"][name], data["configs"][name]
        except (KeyError, TypeError, AttributeError) as e:
            raise SystemExit(f"--merge {path}: not a bench.multiround result ({e!r})") from None
    return results, stats, records


if __name__ == "__main__":
    from nfjax.errors import UserError
    try:
        main()
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
