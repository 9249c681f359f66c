"""Engine bench building blocks shared by bench/offline.py and bench/tp.py: the GEMM ceiling, the context and KV
pages a workload needs, one offline workload through `Engine.generate` with per-step-kind timing, and fixed
synthetic batches timed on the runner's compiled steps directly (no batcher, so the same batch can be timed
under any engine variant). Engines themselves come from bench/setup.py.
"""
from __future__ import annotations

import time

import numpy as np

from nfjax.config import pages_for
from bench.step_bench import make_step_input, run_step

Work = list[tuple[list[int], int]]           # (prompt token ids, output tokens) per request


def gemm_tflops() -> float:
    """Measured bf16 GEMM rate; a small matrix off-GPU (an 8192^3 GEMM takes minutes on a CPU)."""
    import jax
    from bench.common import measure_gemm_tflops
    return measure_gemm_tflops(8192 if jax.default_backend() == "gpu" else 256)


def longest(works: list[Work]) -> int:
    """Tokens of the longest request (prompt + output): the context the engine must hold."""
    return max(len(p) + o for w in works for p, o in w)


def pages_needed(works: list[Work], page_size: int, max_seqs: int | None = None) -> int:
    """Pages for the `max_seqs` (None: all) longest requests at once (+ scratch page 0): no preemption, no
    admission limit from memory, so every engine variant runs the same schedule."""
    lens = sorted((pages_for(len(p) + o, page_size) for w in works for p, o in w), reverse=True)
    return sum(lens[:max_seqs]) + 1


def step_kind(st) -> str:
    """'decode', 'prefill' or 'decode+prefill', '@bucket'."""
    parts = [k for k, n in (("decode", st.decode_tokens), ("prefill", st.prefill_tokens)) if n]
    return "+".join(parts) + f"@{st.bucket}"


def run_workload(engine, work: Work, label: str = "", optimal_tok_s: float | None = None,
                 temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Every request of `work` through `engine.generate` (exact output lengths; greedy, or sampled at
    `temperature` and `top_p` with a seed a request) after a short warm-up with the same sampling; total
    (prompt + generated) tokens/s and the mean step time per step kind."""
    from nfjax.engine import SamplingParams

    def params(i: int, n: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=top_p, seed=i, max_tokens=n, ignore_eos=True)
    engine.generate([p for p, _ in work[:8]], [params(i, 4) for i in range(len(work[:8]))])
    engine.trace.steps.clear()
    engine.runner.strategy_counts.clear()
    sps = [params(i, o) for i, (_, o) in enumerate(work)]
    t = time.perf_counter()
    outs = engine.generate([p for p, _ in work], sps)
    dt = time.perf_counter() - t
    prompt = sum(len(p) for p, _ in work)
    gen = sum(len(o.token_ids) for o in outs)
    tot = (prompt + gen) / dt
    kinds = [step_kind(st) for st in engine.trace.steps]
    by_kind: dict[str, list] = {}
    for k, st in zip(kinds, engine.trace.steps):
        by_kind.setdefault(k, []).append(st)

    def mean(v, f):
        return sum(f(st) for st in v) / len(v)
    res = {"requests": len(work), "prompt_tokens": prompt, "generated_tokens": gen, "seconds": dt,
           "temperature": temperature, "top_p": top_p,
           "total_tok_s": tot, "trace": engine.trace.summary(), "steps_by_strategy": dict(engine.runner.strategy_counts),
           "step_ms_by_kind": {k: {"steps": len(v), "mean_ms": mean(v, lambda s: s.seconds * 1e3),
                                   "host_ms": mean(v, lambda s: s.host_ms), "wait_ms": mean(v, lambda s: s.wait_ms),
                                   "put_ms": mean(v, lambda s: s.put_ms),
                                   "dispatch_ms": mean(v, lambda s: s.dispatch_ms)}
                               for k, v in by_kind.items()},
           # each step in order: its kind, decode and prefill tokens, and cycle (host ms + ms blocked on the read:
           # the loop's period where the GPU is the bound), so a gap between two runs can be placed in the run and
           # a run's floor (bench/run_floor.py) counts the tokens each step computed
           "per_step": {"kind": kinds,
                        "decode_tokens": [st.decode_tokens for st in engine.trace.steps],
                        "prefill_tokens": [st.prefill_tokens for st in engine.trace.steps],
                        "cycle_ms": [round(st.host_ms + st.wait_ms, 2) for st in engine.trace.steps]}}
    opt = ""
    if optimal_tok_s:
        res["pct_optimal"] = 100 * tot / optimal_tok_s
        opt = f" = {res['pct_optimal']:.1f}% of optimal"
    print(f"[{label}] {len(work)} requests: {tot:,.0f} tok/s{opt}; {len(engine.trace.steps)} steps; "
          f"padding {res['trace']['padding_tokens']} tokens; {res['trace']['preemptions']} preemptions", flush=True)
    for k, v in sorted(res["step_ms_by_kind"].items()):
        print(f"    {k:>24}: {v['steps']:5d} steps, mean {v['mean_ms']:.1f} ms (host {v['host_ms']:.1f} ms: inputs "
              f"{v['put_ms']:.1f}, dispatch {v['dispatch_ms']:.1f}; blocked on read {v['wait_ms']:.1f} ms)",
              flush=True)
    return res


def step_fn(runner, bucket: int, inp, label: str = "sequential"):
    """A no-argument call of one step of `label` for `bucket` on `inp` (the KV cache threaded through)."""
    return lambda: run_step(runner, bucket, label, inp)


def time_batches(runner, batches: dict, iters: int = 5, reps: int = 5) -> dict:
    """Median step time (ms) of each synthetic batch: name -> {bucket, tokens, decode, step_ms}."""
    from bench.common import time_fn
    out = {}
    for name, (bucket, seqs, nd) in batches.items():
        tm = time_fn(step_fn(runner, bucket, make_step_input(runner, seqs, bucket, nd, np.random.default_rng(0))),
                     iters=iters, reps=reps)
        out[name] = {"bucket": bucket, "tokens": sum(n for _, _, n in seqs), "decode": nd,
                     "step_ms": tm["median_s"] * 1e3}
    return out
