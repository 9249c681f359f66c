"""NanoFlow ablation on one GPU (NanoFlow Fig. 9 style): step time of one dense mixed batch under Sequential,
NanoBatchOnly, NanoFlow(plan) and DualBatchOverlap; the overlap ratio Sequential / best overlapped strategy; an
R -> P table (NanoFlow Table 3: a persistent GEMM capped to a share R of the SMs on one stream beside decode
attention on another, in one program); and a per-stream timeline of one measured layer (PNG) from a real trace.

One dense batch per token bucket (--token-buckets, here 1024,2048 unless given). The strategies compared: the
split baselines (unless --only-plans), then the flags' (--plan / --strategies; default the shipped plan
DEFAULT_PLAN). Other engine flags as in the product (bench/setup.py).

usage: python -m bench.nanoflow --shape llama3-8b --token-buckets 2048,1024 --out $OUT
       python -m bench.nanoflow --token-buckets 2048 --page-size 64 --plan llama3-8b_h100_tp1_beside_mact --only-plans
CPU smoke: python -m bench.nanoflow --shape smoke --token-buckets 64 --ctx 40 --decode 8 \
               --plan tests/schedule/tiny_plan.json --no-trace
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from bench.setup import add_bench_args

BUCKETS = (1024, 2048)                          # the batches timed when --token-buckets is not given
DEFAULT_PLAN = "llama3-8b_h100_tp1_beside_mact"  # when neither --plan nor --strategies is given


def strategies(args) -> tuple:
    """The split baselines (unless --only-plans), then the flags' strategies, each NanoFlow plan again in stream
    regions with --streams."""
    from bench.setup import bench_overrides
    from nfjax.config import StrategyConfig
    given = bench_overrides(args).get("execution", {}).get("strategies") or (
        StrategyConfig("nanoflow", plan=DEFAULT_PLAN),)
    out = [] if args.only_plans else [StrategyConfig("nanobatch", split=(1, 1), align=args.align),
                                      StrategyConfig("dual_batch", split=(1, 1), align=args.align)]
    if (args.tp or 1) > 1:          # each nano-batch's all-reduce under the other's GEMMs (async collectives)
        out.append(StrategyConfig("comm_overlap", split=(1, 1), align=args.align))
    for s in given:
        out.append(s)
        if args.streams and s.kind == "nanoflow":   # the plan in stream regions (experimental): what they add
            out.append(dataclasses.replace(s, name=f"nanoflow-streams:{os.path.splitext(os.path.basename(s.plan))[0]}"))
    return tuple(out)


def step_ablation(args, cfg, out: dict) -> None:
    import jax
    import numpy as np
    from bench.common import time_fn
    from bench.setup import bench_runner, config_record, setting
    from bench.step_bench import (kernel_table, make_step_input, mixed_batch, run_step, stream_timeline,
                                  synthetic_context, synthetic_pages, trace)

    ps = setting(args, "cache", "page_size")
    buckets = args.token_buckets
    batches = {b: mixed_batch(b, args.ctx, ps, num_decode=args.decode * b // max(buckets))[1] for b in buckets}
    strats = strategies(args)
    runner = bench_runner(args, context=synthetic_context(batches.values(), ps), compile=False,
                          defaults={"cache": {"num_pages": synthetic_pages(batches.values())}},   # all they use
                          extra={"execution": {"strategies": strats}})
    out["engine_config"] = config_record(runner.config)
    if args.streams:
        from nfjax.experimental.streams import use_streams
        use_streams(runner, [s.label for s in strats if s.label.startswith("nanoflow-streams:")])
    runner.compile_all()
    out["compile_s"] = runner.compile_seconds
    out["skipped"] = {f"{b}:{lb}": why for (b, lb), why in runner.variants.skipped.items()}
    rng = np.random.default_rng(0)
    rows = []
    for b in buckets:
        inp = make_step_input(runner, batches[b], b, args.decode * b // max(buckets), rng)
        res = {}
        for label in runner.variants.by_bucket[b]:
            t = time_fn(lambda: run_step(runner, b, label, inp), iters=5, reps=5, warmup=2)
            res[label] = {"step_ms": t["median_s"] * 1e3, "per_layer_ms": t["median_s"] * 1e3 / cfg.num_layers,
                          "dispatch_ms": dispatch_ms(lambda: run_step(runner, b, label, inp))}
            print(f"[{b}] {label:28s} {res[label]['step_ms']:8.2f} ms  (dispatch {res[label]['dispatch_ms']:.2f} ms)",
                  flush=True)
        # the sampled tokens of one step against Sequential's (greedy; random weights may put a few rows at a near
        # tie, so this is recorded, not required)
        ref = np.asarray(jax.device_get(run_step(runner, b, "sequential", inp)))
        for label in res:
            got = np.asarray(jax.device_get(run_step(runner, b, label, inp)))
            res[label]["tokens_as_sequential"] = float(np.mean(got == ref))
        seq = res["sequential"]["step_ms"]
        best = min((lb for lb in res if lb != "sequential" and not lb.startswith("nanobatch")),
                   key=lambda lb: res[lb]["step_ms"], default=None)
        out["buckets"][str(b)] = {"strategies": res, "decode": args.decode * b // max(buckets), "ctx": args.ctx,
                                  "best_overlapped": best,
                                  "overlap_ratio": seq / res[best]["step_ms"] if best else None,
                                  "nanobatch_overhead": (res.get("nanobatch:1-1", {}).get("step_ms", seq) / seq)}
        for lb, r in res.items():
            rows.append([b, lb, r["step_ms"], r["per_layer_ms"], seq / r["step_ms"], r["tokens_as_sequential"]])
        if args.trace and best:
            plans = [lb for lb in res if lb.startswith("nanoflow:")]
            for lb in dict.fromkeys(("sequential", best, *plans[:1])):     # and the first plan
                pd = trace(lambda: run_step(runner, b, lb, inp), "/tmp/nfjax_prof", f"nanoflow_{b}_{lb}", calls=1)
                out["buckets"][str(b)].setdefault("kernels", {})[lb] = kernel_table(pd, calls=1, top=25)
                if b == max(buckets):
                    tl = stream_timeline(pd)
                    out.setdefault("timelines", {})[lb] = _one_layer(tl, cfg.num_layers)
    out["table"] = rows


def dispatch_ms(fn, reps: int = 5) -> float:
    """Host time to enqueue one step on an idle GPU (median): the L + 2 program launches alone."""
    import statistics
    import time

    import jax
    ts = []
    for _ in range(reps):
        jax.block_until_ready(fn())
        t = time.perf_counter()
        out = fn()
        ts.append((time.perf_counter() - t) * 1e3)
        jax.block_until_ready(out)
    return statistics.median(ts)


def _one_layer(tl: dict, layers: int) -> dict:
    """The middle layer's window of a one-step timeline (the step split evenly by layers)."""
    if not tl or "error" in tl:
        return tl
    end = max(s + d for rows in tl.values() for _, s, d in rows)
    lo = end * (layers // 2) / layers
    hi = end * (layers // 2 + 1) / layers
    return {ln: [r for r in rows if lo <= r[1] < hi] for ln, rows in tl.items()}


def rp_table(args, out: dict) -> None:
    """Share R of the SMs for a persistent GEMM (stream 1) vs decode attention (the rest, stream 2)."""
    import jax
    from bench.common import time_fn
    from bench.step_bench import gemm_beside_attention
    from nfjax.compat import num_sms
    from nfjax.experimental.streams import on_stream
    from pallas_kernels.persistent_gemm import persistent_gemm

    sms = num_sms()
    b, ctx = args.decode, args.ctx
    x, w, q, paged_attn = gemm_beside_attention(args.rp_gemm, b, ctx, swapped=args.rp_swapped)

    def gemm(x, w, p):
        return persistent_gemm(x, w, num_ctas=p)

    def attn(q, p):
        return paged_attn(q, p, args.rp_stages)

    def timed(f, *a):
        return time_fn(jax.jit(f), *a, iters=10, reps=5)["median_s"] * 1e3

    g_full = timed(lambda x, w: gemm(x, w, sms), x, w)
    a_full = timed(lambda q: attn(q, sms), q)
    rows = []
    for r in args.rp_shares:
        pg = max(1, round(r * sms))
        pa = max(1, sms - pg)
        g = timed(lambda x, w: gemm(x, w, pg), x, w)
        a = timed(lambda q: attn(q, pa), q)

        def both(x, w, q):
            return on_stream(lambda x, w: gemm(x, w, pg), 1)(x, w), on_stream(lambda q: attn(q, pa), 2)(q)

        t = timed(both, x, w, q)
        rows.append({"R": r, "gemm_programs": pg, "attn_programs": pa, "gemm_alone_ms": g, "attn_alone_ms": a,
                     "together_ms": t, "serial_full_ms": g_full + a_full,
                     "gain_vs_serial_full": (g_full + a_full) / t,
                     "P_gemm": g_full / g, "P_attn": a_full / a})
        out["rp"] = {"gemm_shape": list(args.rp_gemm), "decode_batch": b, "ctx": ctx, "sms": sms, "gemm_full_ms": g_full,
                     "attn_full_ms": a_full, "num_stages": args.rp_stages, "swapped": args.rp_swapped, "rows": rows}
        save(args, out)                 # after every row: the table is slow to compile
        print(f"R={r:.2f} gemm {pg:3d} progs {g:.3f} ms  attn {pa:3d} progs {a:.3f} ms  together {t:.3f} ms  "
              f"serial(full) {g_full + a_full:.3f} ms  gain {(g_full + a_full) / t:.3f}x", flush=True)


def plot_timeline(path: str, timelines: dict) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [(lb, tl) for lb, tl in timelines.items() if tl and "error" not in tl]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 2.2 + 1.1 * max(len(t) for _, t in panels)),
                             squeeze=False)
    colors = {}
    for ax, (lb, tl) in zip(axes[:, 0], panels):
        t0 = min(s for rows in tl.values() for _, s, _ in rows)
        for i, (ln, rows) in enumerate(sorted(tl.items())):
            for name, s, d in rows:
                key = name.split("@")[0]
                c = colors.setdefault(key, f"C{len(colors) % 10}")
                ax.barh(i, d, left=s - t0, color=c, edgecolor="k", linewidth=0.3)
                if d > 0.02:
                    ax.text(s - t0 + d / 2, i, name[:18], ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(tl)))
        ax.set_yticklabels([ln[:28] for ln in sorted(tl)], fontsize=7)
        ax.set_title(f"{lb}: one layer, kernels per GPU stream (ms)", fontsize=9)
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap)
    ap.add_argument("--decode", type=int, default=256, help="decode sequences in the largest bucket (scaled)")
    ap.add_argument("--ctx", type=int, default=1280, help="decode context length")
    ap.add_argument("--align", type=int, default=64, help="nano-batch boundaries of the split baselines")
    ap.add_argument("--no-trace", dest="trace", action="store_false")
    ap.add_argument("--streams", action="store_true",
                    help="also each plan with its stream k >= 1 steps in compute_on stream regions (experimental, "
                         "nfjax/experimental/streams.py)")
    ap.add_argument("--only-plans", action="store_true", help="Sequential and the plans only (no split baselines)")
    ap.add_argument("--rp", action="store_true", help="also the R -> P table (GPU: needs the persistent GEMM)")
    ap.add_argument("--no-ablation", dest="ablation", action="store_false", help="only the R -> P table")
    ap.add_argument("--rp-stages", type=int, default=2, help="decode attention's KV pipeline depth in the table")
    ap.add_argument("--rp-swapped", action="store_true", help="the positions-as-rows decode kernel in the table")
    ap.add_argument("--rp-gemm", default="1024,4096,14336")
    ap.add_argument("--rp-shares", default="0.5,0.6,0.67,0.75,0.8,0.9")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="nanoflow")
    args = ap.parse_args()
    args.token_buckets = tuple(sorted(args.token_buckets or BUCKETS))
    args.rp_gemm = tuple(int(v) for v in args.rp_gemm.split(","))
    args.rp_shares = [float(v) for v in args.rp_shares.split(",")]
    from bench.common import device_info, print_table
    from bench.setup import model_config
    cfg = model_config(args)
    out = {"device": device_info(), "config": cfg.to_json(), "buckets": {}}
    if args.ablation:
        step_ablation(args, cfg, out)
        print_table(["bucket", "strategy", "step ms", "per-layer ms", "Sequential / this", "tokens as Sequential"],
                    out["table"])
        save(args, out)                 # written before the R -> P table, which may run out of time
    if args.rp:
        try:
            rp_table(args, out)
        except Exception as e:  # noqa: BLE001 - what was measured is still written
            out["rp"] = {"error": repr(e)[:800]}
            print(f"R->P table failed: {e!r}"[:800], flush=True)
        save(args, out)


def save(args, out: dict) -> None:
    from bench.common import write_results
    summary = {}
    big = out["buckets"].get(str(max(args.token_buckets)), {})
    if big.get("overlap_ratio"):
        summary["overlap_ratio_1gpu" if (args.tp or 1) == 1 else f"overlap_ratio_tp{args.tp}"] = big["overlap_ratio"]
        summary["overlap_strategy"] = big["best_overlapped"]
    for b, r in out["buckets"].items():
        summary[f"sequential_step_ms_{b}"] = r["strategies"]["sequential"]["step_ms"]
        if r.get("overlap_ratio"):
            summary[f"overlap_ratio_{b}"] = r["overlap_ratio"]
    if isinstance(out.get("rp"), dict) and out["rp"].get("rows"):
        best = max(out["rp"]["rows"], key=lambda r: r["gain_vs_serial_full"])
        summary["rp_best_gain"] = best["gain_vs_serial_full"]
        summary["rp_best_R"] = best["R"]
    path = write_results(args.name, summary, {"args": vars(args), **out}, out_dir=args.out)
    if out.get("timelines"):
        plot_timeline(path.replace(".json", "-timeline.png"), out["timelines"])


if __name__ == "__main__":
    main()
