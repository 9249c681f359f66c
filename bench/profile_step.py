"""Where does one engine step spend its time? Times the compiled step programs on synthetic batches (decode-only,
mixed decode + prefill, prefill-only) and breaks a profiled run down by GPU kernel (jax.profiler trace parsed on
the device with `jax.profiler.ProfileData`). Each variant (XLA flags) runs in its own process. Engine flags as in
the product (bench/setup.py); the buckets are the synthetic batches'.

usage: python -m bench.profile_step --shape llama3-8b --variants base,nodm --out $OUT
CPU:   python -m bench.profile_step --shape smoke --ctx 40 --out /tmp/prof
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time

from bench.common import module_command
from bench.setup import add_bench_args

# variant -> extra XLA flags
VARIANTS = {
    "base": "",
    "nodm": "--xla_gpu_dot_merger_threshold_mb=0",
    "nocmdbuf": "--xla_gpu_enable_command_buffer=",
    "notriton": "--xla_gpu_enable_triton_gemm=false",
    "cublaslt": "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true",
    "noautotune": "--xla_gpu_autotune_level=0",
}


def synthetic_batches(ctx: int, page_size: int):
    """name -> (bucket, [(num_pages, start, n_tokens)], num_decode)."""
    from bench.step_bench import decode_batch, mixed_batch
    _, one, nd = decode_batch(1, ctx, page_size)
    return {"decode256": decode_batch(256, ctx, page_size), "decode128": decode_batch(128, ctx, page_size),
            "decode64": decode_batch(64, ctx, page_size), "decode32": decode_batch(32, ctx, page_size),
            "decode1": (16, one, nd),        # in the smallest GPU bucket, as the engine runs it (GPU_BUCKETS)
            "decode4": (16, decode_batch(4, ctx, page_size)[1], 4),      # a long run's tail: few rows live
            "decode16": decode_batch(16, ctx, page_size),
            "mixed2048": mixed_batch(2048, ctx, page_size, num_decode=128),
            "prefill2048": mixed_batch(2048, ctx, page_size, num_decode=0)}


def _force_decode_splits(n: int) -> None:
    """Probe only: every decode-attention call that names no split count takes `n` (A/B of the kernel's choice)."""
    from pallas_kernels import paged_decode_attention as pda
    pda.choose_num_splits = lambda work, ctas, max_splits=16: n


def child(args) -> dict:
    import numpy as np
    if args.decode_splits:
        _force_decode_splits(args.decode_splits)
    from bench.common import device_info, time_fn
    from bench.setup import bench_runner, config_record, setting
    from bench.step_bench import kernel_table, make_step_input, synthetic_context, synthetic_pages, trace

    ps = setting(args, "cache", "page_size")
    batches = synthetic_batches(args.ctx, ps)
    if args.batches:
        batches = {k: batches[k] for k in args.batches.split(",")}
    seqs = [s for _, s, _ in batches.values()]
    runner = bench_runner(args, context=synthetic_context(seqs, ps), compile=False,
                          defaults={"cache": {"num_pages": synthetic_pages(seqs)}},   # all the batches use
                          extra={"batcher": {"token_buckets": tuple(sorted({b for b, _, _ in batches.values()}))}})
    t = time.perf_counter()
    runner.compile_all()
    out = {"variant": args.variant, "decode_splits": args.decode_splits or "auto",
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "compile_s":
           time.perf_counter() - t, "device": device_info(), "ctx": args.ctx, "layers": runner.cfg.num_layers,
           "engine_config": config_record(runner.config), "batches": {}}
    rng = np.random.default_rng(0)
    for name, (bucket, seqs, nd) in batches.items():
        inp = make_step_input(runner, seqs, bucket, nd, rng)
        step = runner._steps[(bucket, "sequential")]
        dec = nd == sum(n for _, _, n in seqs)          # decode-only: the programs without the prefill kernel
        fn = lambda: runner.run_step(bucket, "sequential", inp, any_sampled=False, decode_only=dec)  # noqa: E731
        tm = time_fn(fn, iters=5, reps=5, warmup=2)
        out["batches"][name] = {"bucket": bucket, "tokens": sum(n for _, _, n in seqs), "decode": nd,
                                "step_ms": tm["median_s"] * 1e3,
                                "kv_tokens_read_decode": sum(st + n for _, st, n in seqs[:nd])}
        print(f"[{args.variant}] {name}: {tm['median_s'] * 1e3:.2f} ms", flush=True)
        if args.profile:
            out["batches"][name]["kernels"] = kernel_table(trace(fn, "/tmp/nfjax_prof", f"{args.variant}_{name}"))
        if args.hlo:                # the first listed batch's layer program (decode-only one where it applies)
            prog = runner._decode_steps.get((bucket, "sequential"), step) if dec else step
            with gzip.open(os.path.join(args.out, f"hlo_{args.variant}_{name}.txt.gz"), "wt") as f:
                f.write(prog.as_text())
            args.hlo = False
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap)
    ap.add_argument("--ctx", type=int, default=1280, help="decode context length")
    ap.add_argument("--variants", default="base")
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)      # child mode
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--decode-splits", type=int, default=0,
                    help="probe: force the decode kernel's split count (0: the kernel's own choice)")
    ap.add_argument("--hlo", action="store_true", help="write the first batch's layer program's optimized HLO (gzip)")
    ap.add_argument("--batches", default=None, help=f"comma list of synthetic batches (default all: "
                    f"{','.join(synthetic_batches(1280, 16))})")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--timeout", type=int, default=300)
    args = ap.parse_args()
    if args.variant:
        res = child(args)
        with open(os.path.join(args.out, f"profile_step_{args.variant}.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    os.makedirs(args.out, exist_ok=True)
    for v in args.variants.split(","):
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + VARIANTS[v]).strip()
        cmd = module_command("bench.profile_step", *sys.argv[1:], "--variant", v)
        try:
            subprocess.run(cmd, env=env, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            print(f"[{v}] timed out", flush=True)
    for v in args.variants.split(","):
        p = os.path.join(args.out, f"profile_step_{v}.json")
        if not os.path.exists(p):
            continue
        r = json.load(open(p))
        print(f"== {v} (compile {r['compile_s']:.1f}s)")
        for name, b in r["batches"].items():
            print(f"  {name:12s} {b['step_ms']:8.2f} ms  kernels {b.get('kernels', {}).get('total_kernel_ms', 0):.2f} ms")
            for k in b.get("kernels", {}).get("top", [])[:14]:
                print(f"      {k['ms']:7.3f} ms  x{k['count']:<6.0f} {k['name'][:110]}")


if __name__ == "__main__":
    main()
