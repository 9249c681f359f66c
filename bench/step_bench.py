"""Shared by the step-level benches: synthetic step inputs for a `Runner`, and GPU traces read back on the device
(`jax.profiler.ProfileData`): kernel time per kernel name, and per-stream event timelines.

A synthetic sequence is `(num_pages, start, num_tokens)`: `num_tokens` query tokens at positions
[start, start + num_tokens) over its own fresh pages. Decodes come first (one token each).
"""
from __future__ import annotations

from nfjax.config import pages_for
from nfjax.device_trace import gpu_lines, trace  # noqa: F401 - the benches' names for them

SeqSpec = tuple[int, int, int]               # (num_pages, first position, query tokens) of one sequence


def make_step_input(runner, seqs, bucket: int, num_decode: int, rng):
    """A device `StepInput` for `runner` (greedy sampling, random token ids)."""
    import numpy as np
    from nfjax.engine.step_input import StepInput
    from nfjax.kv.metadata import build_metadata
    cc = runner.cache_cfg
    nxt, specs = 1, []
    for npg, start, n in seqs:
        specs.append((list(range(nxt, nxt + npg)), start, n))
        nxt += npg
    if nxt > cc.num_pages:
        raise ValueError(f"synthetic batch needs {nxt} pages; the cache has {cc.num_pages}")
    rows = runner.sched.seqs_for(bucket)                  # the sequence rows the bucket's step was compiled for
    meta = build_metadata(specs, bucket, rows, cc.max_pages_per_seq, cc.page_size, num_decode=num_decode)
    z = np.zeros(rows, np.int32)
    toks = rng.integers(0, runner.cfg.vocab_size, bucket).astype(np.int32)
    return runner._to_device(StepInput(toks, np.full(bucket, -1, np.int32), meta, z.astype(np.float32), z,
                                       z.astype(np.float32) + 1, z.astype(np.uint32), z))


def decode_batch(n: int, ctx: int, page_size: int) -> tuple[int, list[SeqSpec], int]:
    """(bucket, seqs, num_decode): `n` decode tokens, each at context `ctx`."""
    return n, [(pages_for(ctx + 1, page_size), ctx, 1)] * n, n


def mixed_batch(bucket: int, ctx: int, page_size: int, num_decode: int | None = None,
                chunks: int = 2) -> tuple[int, list[SeqSpec], int]:
    """A full `bucket`: `num_decode` decodes at context `ctx` (default bucket / 16, the engine's usual mix
    late in a 1024/512 run), the rest as `chunks` equal first prefill chunks (none where decodes fill the bucket)."""
    nd = bucket // 16 if num_decode is None else num_decode
    dec = [(pages_for(ctx + 1, page_size), ctx, 1)] * nd
    per = (bucket - nd) // chunks
    return bucket, dec + [(pages_for(per, page_size), 0, per)] * (chunks if per > 0 else 0), nd


def synthetic_context(seq_lists, page_size: int) -> int:
    """Positions of the longest synthetic sequence's pages: the context a runner's page table must hold."""
    return page_size * max(p for seqs in seq_lists for p, _, _ in seqs)


def synthetic_pages(seq_lists) -> int:
    """KV pages the largest synthetic batch touches (+ scratch page 0): all a runner timing them uses."""
    return max(sum(p for p, _, _ in seqs) for seqs in seq_lists) + 1


def run_step(runner, bucket: int, label: str, inp):
    """One step of variant `label` on the runner's own KV (donated and replaced); returns the samples.
    Synthetic inputs are greedy (`make_step_input`)."""
    return runner.run_step(bucket, label, inp, any_sampled=False)


def kernel_table(pd, calls: int = 3, top: int = 40) -> dict:
    """Kernel ms per call by kernel name, per stream line; `top`/`total_kernel_ms` for the busiest stream."""
    if isinstance(pd, str):
        return {"error": pd}
    lines = {}
    for ln, evs in gpu_lines(pd):
        agg: dict[str, list[float]] = {}
        for name, _, dur, _ in evs:
            a = agg.setdefault(name, [0.0, 0])
            a[0] += dur / 1e6 / calls
            a[1] += 1
        rows = sorted(agg.items(), key=lambda kv: -kv[1][0])
        lines[ln] = {"total_ms": sum(v[0] for v in agg.values()),
                     "top": [{"name": k[:160], "ms": v[0], "count": v[1] / calls} for k, v in rows[:top]]}
    streams = {k: v for k, v in lines.items() if "stream" in k.lower()} or lines
    main = max(streams, key=lambda k: streams[k]["total_ms"]) if streams else None
    return {"lines": lines, "main_line": main,
            "total_kernel_ms": sum(v["total_ms"] for v in streams.values()),
            "top": streams[main]["top"] if main else []}


def kernel_us(fn, args, per_call: int) -> float:
    """Device time of one of `per_call` like pieces of work in one call of `fn`: the kernels' own time from a
    profiler trace. A loop of small jitted calls would time the host's dispatch instead (on the H200's host ~0.3 ms
    a call: a 12 us decode kernel read as 0.3 ms, bench/NOTES.md 30.4). On a CPU (no device lines in a trace): the
    wall time, for smoke runs."""
    import tempfile
    import jax
    from bench.common import time_fn
    if jax.default_backend() != "gpu":
        return time_fn(fn, *args, iters=1, reps=1, warmup=1)["median_s"] * 1e6 / per_call
    table = kernel_table(trace(lambda: fn(*args), tempfile.mkdtemp(prefix="kernel-us-"), "t", calls=3), calls=3)
    if "error" in table or not table["total_kernel_ms"]:
        raise RuntimeError(f"no kernel times in the trace: {table.get('error', 'empty')}")
    return table["total_kernel_ms"] * 1e3 / per_call


def stream_timeline(pd, window: tuple[float, float] | None = None) -> dict:
    """Kernel events of every stream line as (label, start_ms, dur_ms) relative to the first event, optionally
    cut to a [lo, hi) ms window. The label is the event's XLA op name scope when the trace carries one."""
    if isinstance(pd, str):
        return {"error": pd}
    lines = [(ln, evs) for ln, evs in gpu_lines(pd) if "stream" in ln.lower()]
    if not lines:
        return {}
    t0 = min(e[1] for _, evs in lines for e in evs)
    out = {}
    for ln, evs in lines:
        rows = []
        for name, start, dur, stats in evs:
            s, d = (start - t0) / 1e6, dur / 1e6
            if window and not (window[0] <= s < window[1]):
                continue
            rows.append((_op_scope(stats) or name, s, d))
        if rows:
            out[ln.split("/")[-1]] = rows
    return out


def _op_scope(stats: dict) -> str:
    """The `op@nano-batches` named scope (see nfjax.schedule.executor) in an event's op-name stat, if any."""
    for v in stats.values():
        for seg in str(v).split("/"):
            if "@" in seg and not seg.startswith("jit("):
                return seg
    return ""


def gemm_beside_attention(gemm_shape: tuple[int, int, int], decode: int, ctx: int, swapped: bool = False):
    """Random bf16 inputs for the R -> P pair: (x, w, q, attn) with x [M, K] @ w [K, N], and attn(q, programs,
    stages=2) the paged decode attention of `decode` sequences at context `ctx` (8B heads, page size 16);
    `swapped`: the positions-as-rows decode kernel."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.paged_decode_attention import paged_decode_attention
    from pallas_kernels.paged_decode_swapped import paged_decode_attention_swapped
    kernel = paged_decode_attention_swapped if swapped else paged_decode_attention
    m, k, n = gemm_shape
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16) * 0.02
    b, ps, kvh, h, d = decode, 16, 8, 32, 128
    pages = pages_for(ctx, ps)
    kc = jax.random.normal(jax.random.key(3), (1, b * pages + 1, ps, kvh, d), jnp.bfloat16)
    vc = jax.random.normal(jax.random.key(4), (1, b * pages + 1, ps, kvh, d), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(5), (b, h, d), jnp.bfloat16)
    pt = (1 + jnp.arange(b * pages, dtype=jnp.int32)).reshape(b, pages)
    lens = jnp.full((b,), ctx, jnp.int32)

    def attn(q, programs: int, stages: int = 2):
        return kernel(q, kc, vc, jnp.int32(0), pt, lens, scale=d ** -0.5, num_ctas=programs, num_stages=stages)
    return x, w, q, attn
