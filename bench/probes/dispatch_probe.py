"""Does enqueueing a jitted program wait for the GPU? (GPU only; bench/NOTES.md section 3; docs/design.md.)

A chain of N programs, each ~1 ms of GEMM work on the output of the one before, is enqueued from Python. The
host time to enqueue the chain is compared with the time until its result is ready. If enqueueing does not
wait, the first is a small fraction of the second. Variants: no donation; donating the chained activation
(not yet computed when its consumer is enqueued); donating a large state buffer that each program updates in
place (the KV cache's pattern); and the same chain with our Mosaic GPU GEMM (a custom call) in place of XLA's.

    python -m bench.probes.dispatch_probe [--engine-layers 8] [--out DIR]
"""
from __future__ import annotations

import argparse
import statistics
import time


def chain_times(fn, state, x, w, n: int, reps: int = 5) -> dict:
    import jax
    enq, total = [], []
    for _ in range(reps + 1):
        jax.block_until_ready((state, x))
        t0 = time.perf_counter()
        for _ in range(n):
            state, x = fn(state, x, w)
        t1 = time.perf_counter()
        jax.block_until_ready((state, x))
        t2 = time.perf_counter()
        enq.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    return {"enqueue_ms": statistics.median(enq[1:]), "total_ms": statistics.median(total[1:])}, state, x


def engine_calls(layers: int, bucket: int, decode: int, ctx: int, reps: int = 5, fresh: bool = False,
                 command_buffers: bool = True) -> dict:
    """Enqueue time of each program of one engine step (embed, layer groups, head) on an idle GPU. `fresh`:
    every step gets its inputs in new device buffers (as the engine's steps do), not the same ones; with XLA's
    command buffers on, a program whose buffers moved must update its CUDA graphs before launching them."""
    import jax
    import numpy as np
    from bench.setup import bench_runner
    from bench.step_bench import make_step_input, mixed_batch, synthetic_context, synthetic_pages

    _, seqs, nd = mixed_batch(bucket, ctx, 16, num_decode=decode)
    r = bench_runner({"shape": "llama3-8b", "layers": layers, "command_buffers": command_buffers},
                     context=synthetic_context([seqs], 16),
                     extra={"cache": {"num_pages": synthetic_pages([seqs])}, "batcher": {"token_buckets": (bucket,)}})
    inp = make_step_input(r, seqs, bucket, nd, np.random.default_rng(0))
    calls: dict[str, list[float]] = {}
    for rep in range(reps + 1):
        jax.block_until_ready(r.run_step(bucket, "sequential", inp, any_sampled=False))
        if fresh:
            inp = jax.block_until_ready(jax.tree.map(lambda a: a + 0, inp))     # same values, new buffers
        t = [time.perf_counter()]
        x = r._embed[bucket](r._rest_leaves, r._prev, inp)
        t.append(time.perf_counter())
        programs = r.layer_programs(bucket, "sequential")
        for i0, n, prog in programs:
            x, r.kv = prog(r.group_args(i0, n), r.kv, x, inp.meta, r._layer_ids[i0])
            t.append(time.perf_counter())
        r._prev = r._head[(bucket, False)](r._rest_leaves, x, inp)
        t.append(time.perf_counter())
        jax.block_until_ready(r._prev)
        t.append(time.perf_counter())
        names = ["embed"] + [f"layers{i0}" for i0, _, _ in programs] + ["head", "until ready"]
        if rep:
            for nm, a, b in zip(names, t, t[1:]):
                calls.setdefault(nm, []).append((b - a) * 1e3)
    return {k: statistics.median(v) for k, v in calls.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="programs in the chain")
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--state-mb", type=int, default=4096, help="size of the in-place state buffer")
    ap.add_argument("--engine-layers", type=int, default=0, help="also time each program of an engine step "
                    "(Llama-3-8B shape with this many layers; 0 = skip)")
    ap.add_argument("--engine-bucket", type=int, default=1024)
    ap.add_argument("--engine-decode", type=int, default=64, help="decode sequences in the engine step's batch")
    ap.add_argument("--skip-chains", action="store_true", help="only the engine programs")
    ap.add_argument("--name", default="dispatch_probe")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from bench.common import print_table, write_results

    d = args.dim
    w = jax.random.normal(jax.random.key(0), (d, d), jnp.bfloat16) * (d ** -0.5)
    x0 = jax.random.normal(jax.random.key(1), (d, d), jnp.bfloat16)
    rows = args.state_mb * (1 << 20) // (d * 2)
    st0 = jnp.zeros((rows, d), jnp.bfloat16)

    def step(state, x, w):
        y = jnp.tanh(x @ w)
        return state.at[:8].set(y[:8]), y                    # an in-place update of a big buffer

    def mosaic_step(state, x, w):                            # the same with our Mosaic GPU GEMM
        from pallas_kernels.persistent_gemm import persistent_gemm
        y = jnp.tanh(persistent_gemm(x, w))
        return state.at[:8].set(y[:8]), y

    variants = {
        "no donation": jax.jit(step),
        "donate activation": jax.jit(step, donate_argnums=(1,)),
        "donate state": jax.jit(step, donate_argnums=(0,)),
        "donate both": jax.jit(step, donate_argnums=(0, 1)),
        "mosaic gemm, donate both": jax.jit(mosaic_step, donate_argnums=(0, 1)),
        "mosaic gemm, no donation": jax.jit(mosaic_step),
    }
    if jax.default_backend() != "gpu":
        variants = {k: v for k, v in variants.items() if not k.startswith("mosaic")}
    if args.skip_chains:
        variants = {}
    data, table = {}, []
    for name, fn in variants.items():
        st, x = jnp.copy(st0), jnp.copy(x0)
        st, x = fn(st, x, w)                                 # compile + warm up
        r, st, x = chain_times(fn, st, x, w, args.n)
        r["enqueue_share"] = r["enqueue_ms"] / r["total_ms"]
        data[name] = r
        table.append([name, r["enqueue_ms"], r["total_ms"], r["enqueue_share"]])
        print(name, r, flush=True)
        del st, x
    if table:
        print_table(["variant", f"enqueue {args.n} ms", "until ready ms", "enqueue / total"], table)
    summary = {f"enqueue_share[{k}]": v["enqueue_share"] for k, v in data.items()}
    out = {"args": vars(args), "variants": data}
    if args.engine_layers:
        out["engine_calls_ms"] = {}
        for cb in (True, False):
            for fresh in (False, True):
                key = f"command buffers {'on' if cb else 'off'}, {'fresh' if fresh else 'same'} inputs"
                out["engine_calls_ms"][key] = calls = engine_calls(args.engine_layers, args.engine_bucket,
                                                                   args.engine_decode, 1280, fresh=fresh,
                                                                   command_buffers=cb)
                summary[f"engine_enqueue_ms[{key}]"] = sum(v for k, v in calls.items() if k != "until ready")
                print_table(["engine program", "ms"], list(calls.items()), title=key)
    write_results(args.name, summary, out, out_dir=args.out)


if __name__ == "__main__":
    main()
