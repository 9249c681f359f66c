"""Replay the real Batcher on a bench workload with a step-time model instead of a GPU (a probe, not a bench).

Every step is formed by `nfjax.engine.batcher.Batcher` exactly as in the engine; its tokens land at once (the
engine learns them a step later, which changes no batch here: the decode input comes from the step in flight).
The time of a step is modelled from H100 profiles of the 8B model (bench/NOTES.md sections 9 and 11): the
non-attention part by token bucket (GEMMs, norms, head; `--gemm-ms`), decode attention at the copy rate over the
KV bytes read plus a fixed cost, and prefill attention per prefill token x context. What it is for: comparing
batch-formation policies (admission, buckets, max_seqs) on the workloads of bench/offline.py in steps, padding,
decode batch sizes and modelled seconds, before spending device time on one.

    python -m bench.probes.batcher_replay --workloads 1024x512,sharegpt --num-requests 512
    python -m bench.probes.batcher_replay --workloads sharegpt --num-requests 2000 --variants "base=;fine=--buckets 16,32,64,128,256,384,512,640,768,896,1024,1280,1536,1792,2048"
    python -m bench.probes.batcher_replay --workloads 1024x512 --num-pages 50034 --kv-bytes 69632 --attn-of-copy 0.75   # fp8
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
from nfjax.engine.request import Request, Status
from nfjax.engine.sampling_params import SamplingParams

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, dtype="bfloat16")
# H100, 8B: a step's time without attention by token bucket (ms; profile_step-20261124.json, interpolated between)
GEMM_MS = {16: 6.3, 32: 7.75, 64: 8.1, 128: 8.7, 256: 10.4, 2048: 49.0}
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
COPY_TB_S = 2.9


def gemm_ms(tokens: int, table: dict[int, float]) -> float:
    xs = sorted(table)
    return float(np.interp(tokens, xs, [table[x] for x in xs]))


def step_ms(batch, table, kv_bytes: float = KV_BYTES_PER_TOKEN, attn_of_copy: float = 1.0) -> tuple[float, float]:
    """(modelled ms, of which decode attention); `kv_bytes` a token as stored, read at `attn_of_copy` of the
    copy rate (a compressed format's kernel)."""
    kv = sum(s.start + 1 for s in batch.seqs[:batch.num_decode])
    attn = 0.47 + kv * kv_bytes / (COPY_TB_S * attn_of_copy * 1e12) * 1e3
    pre = sum(s.num_tokens * (s.start + s.num_tokens / 2) for s in batch.seqs[batch.num_decode:])
    pre_ms = pre * 4 * 4096 * 32 / 400e12 * 1e3          # QK and PV flops at ~400 TFLOP/s
    return gemm_ms(batch.bucket, table) + attn + pre_ms, attn


def replay(work, num_pages: int, batcher: BatcherConfig, table, kv_bytes: float = KV_BYTES_PER_TOKEN,
           attn_of_copy: float = 1.0) -> dict:
    cfg = EngineConfig(model=LLAMA3_8B, cache=CacheConfig(page_size=16, num_pages=num_pages,
                                                          max_pages_per_seq=256, max_model_len=4096),
                       batcher=batcher)
    b = Batcher(cfg)
    for i, (prompt, out) in enumerate(work):
        b.add(Request(str(i), prompt, SamplingParams.greedy(max_tokens=out, ignore_eos=True), seed=0))
    steps, pad, ms, attn_ms = 0, 0, 0.0, 0.0
    kinds: Counter = Counter()
    kind_ms: Counter = Counter()
    decodes = []
    swaps = 0
    t0 = time.perf_counter()
    while b.has_work():
        batch = b.next_batch({})
        if batch is None:
            raise RuntimeError("the batcher formed no step while work is left")
        swaps += len(batch.swap_out)
        steps += 1
        pad += batch.bucket - batch.num_tokens
        t, a = step_ms(batch, table, kv_bytes, attn_of_copy)
        ms += t
        attn_ms += a
        kind = ("decode+prefill" if batch.num_decode < len(batch.seqs) and batch.num_decode else
                "decode" if batch.num_decode else "prefill") + f"@{batch.bucket}"
        kinds[kind] += 1
        kind_ms[kind] += t
        decodes.append(batch.num_decode)
        for s in batch.seqs:
            r = s.req
            if s.samples:
                r.output_ids.append(1)
                if len(r.output_ids) >= r.params.max_tokens:
                    b.finish(r, "length")
    tokens = sum(len(p) + o for p, o in work)
    return {"steps": steps, "padding": pad, "model_s": ms / 1e3, "attn_s": attn_ms / 1e3, "tok_s": tokens / ms * 1e3,
            "mean_decode": float(np.mean(decodes)), "preemptions": swaps, "host_s": time.perf_counter() - t0,
            "kinds": {k: (kinds[k], round(kind_ms[k] / kinds[k], 1)) for k in sorted(kinds, key=kinds.get,
                                                                                   reverse=True)}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="1024x512,sharegpt")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--num-pages", type=int, default=26674, help="the H100's 8B pool at the default fraction")
    p.add_argument("--variants", default="base=", help="NAME=FLAGS;... with --buckets, --max-seqs, "
                                                       "--max-prefill-seqs, --no-predict")
    p.add_argument("--optimal-tok-s", type=float, default=42847.0)
    p.add_argument("--kv-bytes", type=float, default=KV_BYTES_PER_TOKEN, help="KV bytes a token as stored "
                   "(fp8 with its scales: ~0.53x bf16's; set --num-pages to the format's pool too)")
    p.add_argument("--attn-of-copy", type=float, default=1.0, help="decode attention's rate, of the copy rate")
    a = p.parse_args(argv)
    vp = argparse.ArgumentParser(prog="variant")
    vp.add_argument("--buckets", default="16,32,64,128,256,384,512,1024,2048")
    vp.add_argument("--max-seqs", type=int, default=1024)
    vp.add_argument("--max-prefill-seqs", type=int, default=16)
    vp.add_argument("--no-predict", action="store_true")
    for spec in a.workloads.split(","):
        work = parse(spec, a.num_requests, 32000)
        for v in a.variants.split(";"):
            name, _, flags = v.partition("=")
            f = vp.parse_args(shlex.split(flags))
            cfg = BatcherConfig(token_buckets=tuple(int(x) for x in f.buckets.split(",")), max_seqs=f.max_seqs,
                                max_prefill_seqs=f.max_prefill_seqs, predict_memory=not f.no_predict)
            r = replay(work, a.num_pages, cfg, GEMM_MS, a.kv_bytes, a.attn_of_copy)
            print(f"{spec:9s} {name:10s} steps {r['steps']:5d} padding {r['padding']:7d} mean decode "
                  f"{r['mean_decode']:6.1f} preempt {r['preemptions']:4d} model {r['model_s']:6.1f} s (attn "
                  f"{r['attn_s']:5.1f}) {r['tok_s']:8,.0f} tok/s = {100 * r['tok_s'] / a.optimal_tok_s:5.1f}% "
                  f"[host {r['host_s']:.1f} s]")
            print("    " + ", ".join(f"{k} {n}x{m}" for k, (n, m) in list(r["kinds"].items())[:8]))


if __name__ == "__main__":
    main()
