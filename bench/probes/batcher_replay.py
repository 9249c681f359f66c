"""Replay the real Batcher on a bench workload with a step-time model instead of a GPU (a probe, not a bench).

Every step is formed by `nfjax.engine.batcher.Batcher` exactly as in the engine; its tokens land at once (the
engine learns them a step later, which changes no batch here: the decode input comes from the step in flight).
The workloads are bench/offline.py's (seed 1, the context sized to the longest request), so on the measured
runs' pool (26,486 pages) the replay forms their steps: ShareGPT-shaped 2,000 requests 2,355 steps against 2,354
measured, with the same count of every step kind within 2. The time of a step is modelled from H100 profiles of
the 8B model (bench/NOTES.md sections 9 and 11): the non-attention part by token bucket (GEMMs, norms, head),
decode attention at the copy rate over the KV bytes read plus a fixed cost, prefill attention per prefill token
x context, and a fixed cost per prefill chunk (`CHUNK_MS`). The model leaves out host time: a step whose host
work (forming it, launching it, taking its tokens) is longer than its GPU time takes the host's time; and the
decode@512/1024 steps of the 2,000-request run took 6-7 ms more than modelled. `--measured FILE` sets the model
beside a bench/offline.py result per step kind (the measured time between steps: mean - wait).
What it is for: comparing batch-formation policies (admission, buckets, max_seqs) on the workloads of
bench/offline.py in steps, padding, decode batch sizes and modelled seconds, before spending device time on one.
`--model mixtral`: Mixtral-8x7B on an H200 with fp8 KV (bench/probes/replay_mixtral.py: its step model, fits and
replay-only batcher switches); it also runs the engine's warm-up first and lands tokens a step late (`run_steps`),
which forms the measured Mixtral runs' steps exactly. The 8B model keeps the replay as it was (neither).

    python -m bench.probes.batcher_replay --workloads 1024x512,sharegpt --num-requests 512
    python -m bench.probes.batcher_replay --workloads sharegpt --num-requests 2000 --variants "now=;before=--fcfs --no-defer --no-shorten"
    python -m bench.probes.batcher_replay --workloads sharegpt --num-requests 2000 --measured bench/results/offline-sharegpt2000-forecast-20261125.json --variants "before=--fcfs --no-defer --no-shorten"
    python -m bench.probes.batcher_replay --workloads 1024x512 --num-pages 50034 --kv-bytes 69632 --attn-of-copy 0.75   # fp8
    python -m bench.probes.batcher_replay --model mixtral --variants "now=;pf=--prefill-first"
"""
from __future__ import annotations

import argparse
import shlex
import time
from collections import Counter

import numpy as np

from bench.workloads import parse
from nfjax.config import BatcherConfig, CacheConfig, EngineConfig, ModelConfig
from nfjax.engine.batcher import Batcher
from nfjax.engine.builder import GPU_BUCKETS
from nfjax.engine.request import Request
from nfjax.engine.sampling_params import SamplingParams

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, dtype="bfloat16")
# H100, 8B: a step's time without attention by token bucket (ms; profile_step-20261124.json, interpolated between)
GEMM_MS = {16: 6.3, 32: 7.75, 64: 8.1, 128: 8.7, 256: 10.4, 2048: 49.0}
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
COPY_TB_S = 2.9
# A prefill chunk's cost beyond its flops: mixed steps of ShareGPT-shaped runs (5.7 and 8.9 chunks a step) took
# 4.4 and 4.8 ms more than modelled without it, 1024/512's (2.8 chunks of 1,024 tokens) 1.2 ms (least squares)
CHUNK_MS = 0.6


def gemm_ms(tokens: int, table: dict[int, float]) -> float:
    xs = sorted(table)
    return float(np.interp(tokens, xs, [table[x] for x in xs]))


def step_ms(batch, table, kv_bytes: float = KV_BYTES_PER_TOKEN, attn_of_copy: float = 1.0,
            chunk_ms: float = CHUNK_MS) -> tuple[float, float]:
    """(modelled ms, of which decode attention); `kv_bytes` a token as stored, read at `attn_of_copy` of the
    copy rate (a compressed format's kernel); `chunk_ms` a prefill chunk's fixed cost."""
    kv = sum(s.start + 1 for s in batch.seqs[:batch.num_decode])
    attn = 0.47 + kv * kv_bytes / (COPY_TB_S * attn_of_copy * 1e12) * 1e3
    pre = sum(s.num_tokens * (s.start + s.num_tokens / 2) for s in batch.seqs[batch.num_decode:])
    pre_ms = pre * 4 * 4096 * 32 / 400e12 * 1e3          # QK and PV flops at ~400 TFLOP/s
    chunks = len(batch.seqs) - batch.num_decode
    return gemm_ms(batch.bucket, table) + attn + pre_ms + chunk_ms * chunks, attn


def land(batch, b: Batcher) -> None:
    """A step's tokens into its requests; a request at its max_tokens finishes (its pages go back)."""
    for s in batch.seqs:
        r = s.req
        if s.samples and not r.finished:
            r.output_ids.append(1)
            if len(r.output_ids) >= r.params.max_tokens:
                b.finish(r, "length")


def run_steps(b: Batcher, lag: bool):
    """Yield every step the batcher forms until its work is done. `lag`: tokens land a step late, as in the
    engine (`Engine.step` forms step N+1, then reads step N's tokens and finishes requests): the decode input
    comes from the step in flight and a finished request's pages go back one step later; else at once."""
    prev = None
    while b.has_work() or prev is not None:
        slots = {} if prev is None else {s.req.request_id: i for i, s in enumerate(prev.seqs) if s.samples}
        batch = b.next_batch(slots) if b.has_work() else None
        if batch is None and (prev is None or not lag):
            raise RuntimeError("the batcher formed no step while work is left")
        if batch is not None:
            yield batch
        if lag:
            if prev is not None:
                land(prev, b)
            prev = batch
        else:
            land(batch, b)


def replay(work, num_pages: int, batcher: BatcherConfig, table, kv_bytes: float = KV_BYTES_PER_TOKEN,
           attn_of_copy: float = 1.0, chunk_ms: float = CHUNK_MS, batcher_cls=Batcher, *, model=LLAMA3_8B,
           step_fn=None, warmup: int = 0, lag: bool = False, steps_out: list | None = None) -> dict:
    """`step_fn(batch) -> (ms, decode attention ms)` replaces the 8B model (`step_ms`); `warmup`: that many
    first prompts run first with 4 tokens each, as bench/engine_bench.run_workload does (their pages then sit in
    the prefix cache); `lag`: see `run_steps`; `steps_out`: each step's (kind, ms, decodes) appended."""
    context = max(len(p) + o for p, o in work)             # bench/offline.py sizes the context so
    cfg = EngineConfig(model=model, cache=CacheConfig(page_size=16, num_pages=num_pages,
                                                      max_pages_per_seq=-(-context // 16), max_model_len=context),
                       batcher=batcher)
    b = batcher_cls(cfg)
    if warmup:
        for i, (prompt, _) in enumerate(work[:warmup]):
            b.add(Request(f"w{i}", prompt, SamplingParams.greedy(max_tokens=4, ignore_eos=True), seed=0))
        for _ in run_steps(b, lag):
            pass
    for i, (prompt, out) in enumerate(work):
        b.add(Request(str(i), prompt, SamplingParams.greedy(max_tokens=out, ignore_eos=True), seed=0))
    steps, pad, ms, attn_ms = 0, 0, 0.0, 0.0
    kinds: Counter = Counter()
    kind_ms: Counter = Counter()
    kind_dec: Counter = Counter()          # decodes, prefill chunks and prefill tokens by kind (sums)
    kind_chunks: Counter = Counter()
    kind_pre: Counter = Counter()
    decodes = []
    swaps = 0
    t0 = time.perf_counter()
    for batch in run_steps(b, lag):
        swaps += len(batch.swap_out)
        steps += 1
        pad += batch.bucket - batch.num_tokens
        t, a = step_fn(batch) if step_fn else step_ms(batch, table, kv_bytes, attn_of_copy, chunk_ms)
        ms += t
        attn_ms += a
        kind = ("decode+prefill" if batch.num_decode < len(batch.seqs) and batch.num_decode else
                "decode" if batch.num_decode else "prefill") + f"@{batch.bucket}"
        kinds[kind] += 1
        kind_ms[kind] += t
        kind_dec[kind] += batch.num_decode
        kind_chunks[kind] += len(batch.seqs) - batch.num_decode
        kind_pre[kind] += batch.num_tokens - batch.num_decode
        decodes.append(batch.num_decode)
        if steps_out is not None:
            steps_out.append((kind, t, batch.num_decode))
    tokens = sum(len(p) + o for p, o in work)
    return {"steps": steps, "padding": pad, "model_s": ms / 1e3, "attn_s": attn_ms / 1e3, "tok_s": tokens / ms * 1e3,
            "mean_decode": float(np.mean(decodes)), "preemptions": swaps, "host_s": time.perf_counter() - t0,
            "kinds": {k: (kinds[k], round(kind_ms[k] / kinds[k], 1)) for k in sorted(kinds, key=kinds.get,
                                                                                   reverse=True)},
            "kind_detail": {k: {"steps": kinds[k], "ms": kind_ms[k] / kinds[k], "decodes": kind_dec[k] / kinds[k],
                                "chunks": kind_chunks[k] / kinds[k], "prefill": kind_pre[k] / kinds[k]}
                            for k in kinds}}


def policy(longest_first: bool = True, defer_slack: float = Batcher.DEFER_SLACK,
           shorten_pad: float = Batcher.SHORTEN_PAD) -> type[Batcher]:
    """The Batcher with its admission order, decode deferral and chunk shortening set (the product's defaults:
    itself). `defer_slack` 0 and `shorten_pad` 1 turn the last two off."""
    if (longest_first, defer_slack, shorten_pad) == (Batcher.LONGEST_FIRST, Batcher.DEFER_SLACK,
                                                     Batcher.SHORTEN_PAD):
        return Batcher
    return type("ReplayBatcher", (Batcher,), {"LONGEST_FIRST": longest_first, "DEFER_SLACK": defer_slack,
                                              "SHORTEN_PAD": shorten_pad})


def measured_kinds(path: str) -> dict[tuple[str, int], dict]:
    """{(workload, requests): {kind: (steps, ms between steps, host ms)}} from a bench/offline.py result. A
    step's `mean_ms` runs from its launch to its tokens on the host, across the next step's launch; less the
    wait for its tokens, it is the time from one launch to the next."""
    import json
    doc = json.load(open(path))
    out = {}
    for eng in doc["data"]["engines"].values():
        for w, r in eng["results"].items():
            out[(w, r["requests"])] = {k: (v["steps"], v["mean_ms"] - v["wait_ms"], v["host_ms"])
                                       for k, v in r["step_ms_by_kind"].items()}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama3-8b", "mixtral"], default="llama3-8b", help="the step model: the 8B "
                   "on an H100 (bf16 KV), or Mixtral-8x7B on an H200 with fp8 KV (bench/probes/replay_mixtral.py: "
                   "its own pool, buckets, prefill bucket, ceiling, and the engine's warm-up and one-step lag)")
    p.add_argument("--fit", default="runs", help="--model mixtral: its step model's fit, runs | default-runs | no-tiles (replay_mixtral.FITS)")
    p.add_argument("--workloads", default=None, help="default 1024x512,sharegpt (mixtral: 1024x512)")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--seed", type=int, default=1, help="workload seed (bench/offline.py's is 1)")
    p.add_argument("--num-pages", type=int, default=None, help="default: the measured runs' pool (the H100's 8B "
                   "26,486; Mixtral fp8 on the H200 36,017)")
    p.add_argument("--variants", default="base=", help="NAME=FLAGS;... with --buckets, --max-seqs, "
                   "--max-prefill-seqs, --prefill-bucket N, --no-predict, --fcfs (admission in arrival order), "
                   "--no-defer (every decode in every step), --defer-slack X, --no-shorten (whole prefill chunks in "
                   "mixed steps); --model mixtral adds replay_mixtral.add_variant_args' (batcher changes not in "
                   "the engine)")
    p.add_argument("--optimal-tok-s", type=float, default=None, help="default 42,847 (8B, H100) or Mixtral's")
    p.add_argument("--kv-bytes", type=float, default=KV_BYTES_PER_TOKEN, help="KV bytes a token as stored "
                   "(fp8 with its scales: ~0.53x bf16's; set --num-pages to the format's pool too)")
    p.add_argument("--attn-of-copy", type=float, default=1.0, help="decode attention's rate, of the copy rate")
    p.add_argument("--chunk-ms", type=float, default=CHUNK_MS, help="a prefill chunk's fixed cost (ms)")
    p.add_argument("--measured", metavar="FILE", help="a bench/offline.py result: its step kinds beside the model's")
    a = p.parse_args(argv)
    mix = a.model == "mixtral"
    if mix:
        from bench.probes import replay_mixtral as rm
    vp = argparse.ArgumentParser(prog="variant")
    vp.add_argument("--buckets", default=",".join(map(str, rm.BUCKETS if mix else GPU_BUCKETS)))
    vp.add_argument("--max-seqs", type=int, default=1024)
    vp.add_argument("--max-prefill-seqs", type=int, default=16)
    vp.add_argument("--prefill-bucket", type=int, default=rm.PREFILL_BUCKET if mix else None)
    vp.add_argument("--no-predict", action="store_true")
    vp.add_argument("--fcfs", action="store_true")
    vp.add_argument("--no-defer", action="store_true")
    vp.add_argument("--defer-slack", type=float, default=Batcher.DEFER_SLACK)
    vp.add_argument("--no-shorten", action="store_true")
    if mix:
        rm.add_variant_args(vp)
    model = rm.MIXTRAL if mix else LLAMA3_8B
    pages = a.num_pages or (rm.NUM_PAGES if mix else 26486)
    optimal = a.optimal_tok_s or (rm.OPTIMAL_TOK_S if mix else 42847.0)
    measured = measured_kinds(a.measured) if a.measured else {}
    for spec in (a.workloads or ("1024x512" if mix else "1024x512,sharegpt")).split(","):
        work = parse(spec, a.num_requests, model.vocab_size, seed=a.seed)
        for v in a.variants.split(";"):
            name, _, flags = v.partition("=")
            f = vp.parse_args(shlex.split(flags))
            cfg = BatcherConfig(token_buckets=tuple(int(x) for x in f.buckets.split(",")), max_seqs=f.max_seqs,
                                max_prefill_seqs=f.max_prefill_seqs, predict_memory=not f.no_predict,
                                prefill_bucket=f.prefill_bucket)
            cls = policy(not f.fcfs, 0.0 if f.no_defer else f.defer_slack, 1.0 if f.no_shorten else Batcher.SHORTEN_PAD)
            order: list = []
            if mix:
                cls, step_fn = rm.variant(cls, f, a.fit)
                r = replay(work, pages, cfg, None, batcher_cls=cls, model=model, step_fn=step_fn, warmup=8, lag=True,
                           steps_out=order)
            else:
                r = replay(work, pages, cfg, GEMM_MS, a.kv_bytes, a.attn_of_copy, a.chunk_ms, cls)
            print(f"{spec:9s} {name:10s} steps {r['steps']:5d} padding {r['padding']:7d} mean decode "
                  f"{r['mean_decode']:6.1f} preempt {r['preemptions']:4d} model {r['model_s']:6.1f} s (attn "
                  f"{r['attn_s']:5.1f}) {r['tok_s']:8,.0f} tok/s = {100 * r['tok_s'] / optimal:5.1f}% "
                  f"[host {r['host_s']:.1f} s]")
            print("    " + ", ".join(f"{k} {n}x{m}" for k, (n, m) in list(r["kinds"].items())[:8]))
            m = measured.get((spec, a.num_requests))
            if m:
                own = rm.measured_own_file(a.measured, spec, [k for k, _, _ in order]) if mix else {}
                print(f"    {'kind':24s} {'steps':>11s} {'ms modelled':>12s} {'measured':>9s} {'host':>6s}"
                      + (f" {'own GPU':>8s}" if mix else ""))
                for k in sorted(set(m) | set(r["kind_detail"]), key=lambda k: -m.get(k, (0, 0, 0))[0]):
                    d = r["kind_detail"].get(k, {"steps": 0, "ms": float("nan")})
                    ms, mi, mh = m.get(k, (0, float("nan"), float("nan")))
                    print(f"    {k:24s} {d['steps']:5d}/{ms:5d} {d['ms']:12.1f} {mi:9.1f} {mh:6.1f}"
                          + (f" {own.get(k, float('nan')):8.1f}" if mix else ""))


if __name__ == "__main__":
    main()
