"""NanoFlow auto-search on one GPU: profile the model shape's layer ops (random weights), search plans for the
benchmark's batch classes, and time the searched plans against the hand-tuned plan and Sequential on dense mixed
batches, per step as bench/nanoflow.py times them (one process, one device call).

Writes <out>/autosearch-<date>.json (summary: autosearch_vs_handtuned, overlap_ratio_1gpu, autosearch_solve_s,
per bucket the same), the profile (<out>/<model>_<device>_tp1.json), the searched plans (<out>/plans/), and the
timeline of one layer of the searched plan at the largest bucket from a real trace (PNG).

usage: python -m bench.autosearch --shape llama3-8b --page-size 64 --out $OUT
CPU smoke: python -m bench.autosearch --shape smoke --token-buckets 128,256 --decode 32 --ctx 64 --grid quick \\
               --no-trace --out /tmp/as
Offline (no device): the search from a saved profile, and the model against what a run measured:
  python -m bench.autosearch --shape llama3-8b --profile bench/results/autosearch-run5-profile-20261125.json \\
      --search-only --measured bench/results/autosearch-run5-20261125.json \\
      --measured-plans bench/results/autosearch-plans-run5-20261125 --out /tmp/as
"""
from __future__ import annotations

import argparse
import json
import os
import time

from bench.setup import add_bench_args

HAND = "llama3-8b_h100_tp1_beside_mact"
T0 = time.perf_counter()


def profile_step(args, cfg, out: dict, log) -> dict:
    import jax

    from nfjax.autosearch.profile import device_key, save_profile
    from nfjax.autosearch.profiler import CPU_GRID, GPU_GRID, Grid, pages_needed, profile, quick
    from nfjax.autosearch.subjects import LlamaSubject
    from nfjax.compat import num_sms, on_gpu
    from bench.setup import setting
    gpu = on_gpu()
    if args.profile:
        with open(args.profile) as f:
            return json.load(f)
    grid = GPU_GRID if gpu else CPU_GRID
    if args.grid == "quick":
        grid = quick(grid)
    if not gpu:                     # the smoke shape: sizes of the smoke run's buckets
        b = max(args.token_buckets)
        grid = Grid(tokens=(16, b // 4, b), decodes=(0, args.decode), ctxs=(args.ctx,), chunks=(b // 4, b),
                    starts=(0, b // 4), share_decodes=args.decode, share_ctx=args.ctx, share_tokens=b - args.decode,
                    reps=2, target_ms=2.0)
    ps = setting(args, "cache", "page_size")
    t0 = time.perf_counter()
    subject = LlamaSubject(cfg, page_size=ps, max_seqs=512 if gpu else 64, max_pages=pages_needed(grid, ps))
    dev = device_key()
    d = jax.devices()[0]
    prof = profile(subject, grid, device=dev, device_name=getattr(d, "device_kind", d.platform),
                   num_sms=num_sms() if gpu else 0, align=64 if gpu else 16, log=log)
    prof["page_size"] = ps
    out["profile_s"] = time.perf_counter() - t0
    out["profile_file"] = str(save_profile(prof, os.path.join(args.out, f"{prof['model']}_{dev}_tp1.json")))
    return prof


def search_step(args, prof: dict, out: dict) -> dict:
    """Plans for every (bucket, decode band) class; returns bucket -> the plan file the bench's batch gets."""
    from nfjax.autosearch.costs import BatchClass, CostModel
    from nfjax.autosearch.emit import schedule_ms
    from nfjax.autosearch.search import SearchOptions, search
    from nfjax.schedule.graph import layer_graph
    from nfjax.schedule.plan import save_plan
    g = layer_graph()
    decodes = sorted({decode_of(args, b) for b in args.token_buckets})
    t0 = time.perf_counter()
    res = search(g, prof, args.token_buckets, decodes, args.ctx, 2, SearchOptions(time_limit=args.time_limit))
    out["autosearch_solve_s"] = time.perf_counter() - t0
    chosen, classes = {}, []
    pdir = os.path.join(args.out, "plans")
    for r in res:
        f = str(save_plan(r.plan, os.path.join(pdir, f"{r.plan.name}.json"))) if r.plan else None
        classes.append({"bucket": r.batch.tokens, "decodes": r.batch.decodes, "min_decode": r.min_decode,
                        "plan": f, "modelled_layer_ms": r.best_ms, "modelled_sequential_ms": r.sequential_ms,
                        "structure": {"bounds": r.structure.bounds, "split": sorted(r.structure.split),
                                      "pairs": r.structure.pairs, "shares": {str(k): v for k, v in r.shares.items()}},
                        "candidates": [{"bounds": s.bounds, "split": sorted(s.split), "pairs": s.pairs,
                                        "stage1_ms": a, "stage2_ms": b} for s, a, b in r.candidates],
                        "notes": r.notes, "seconds": r.seconds})
    for b in args.token_buckets:                  # the band the runtime would choose for the bench's batch
        d = decode_of(args, b)
        mine = [c for c in classes if c["bucket"] == b and c["min_decode"] <= d]
        best = max(mine, key=lambda c: c["min_decode"], default=None)
        chosen[b] = best["plan"] if best else None
        model = CostModel(prof, BatchClass(b, d, args.ctx))
        try:
            hand_ms = schedule_ms(_recorded(HAND, b, g), model)
        except Exception as e:  # noqa: BLE001 - the hand plan at a bucket it does not take
            hand_ms = repr(e)[:200]
        out.setdefault("modelled", {})[str(b)] = {
            "sequential_ms": best["modelled_sequential_ms"] if best else None,
            "sequential_ops_ms": sum(model.full_ms(op, 0, b) for op in g.names),
            "sequential_layer_ms": model.measured_sequential_ms(),
            "searched_ms": best["modelled_layer_ms"] if best else None, "handtuned_ms": hand_ms}
    out["classes"] = classes
    for b, m in out["modelled"].items():
        print(f"modelled layer ms, {b} tokens / {decode_of(args, int(b))} decodes: searched {_f(m['searched_ms'])}, "
              f"hand-tuned {_f(m['handtuned_ms'])}, Sequential {_f(m['sequential_ms'])} (its ops "
              f"{_f(m['sequential_ops_ms'])}, its measured layer {_f(m['sequential_layer_ms'])})", flush=True)
    print(f"search: {len(res)} classes in {out['autosearch_solve_s']:.1f} s; plans for the bench's batches: "
          f"{ {b: (os.path.basename(p) if p else 'Sequential') for b, p in chosen.items()} }", flush=True)
    return chosen


def _f(x) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def evaluate_measured(args, prof: dict, out: dict) -> None:
    """The model's layer time of every strategy a previous run timed (`--measured`: its result JSON), against its
    measured step / layers: Sequential (its measured layer where the profile has it, else its ops), the shipped
    plans, and that run's searched plans (looked up by name in `--measured-plans`)."""
    from nfjax.autosearch.costs import BatchClass, CostModel
    from nfjax.autosearch.emit import record, schedule_ms
    from nfjax.schedule.graph import layer_graph
    from nfjax.schedule.plan import load_plan
    with open(args.measured) as f:
        run = json.load(f)
    data = run.get("data", run)
    layers = data["config"]["num_layers"]
    g = layer_graph()
    rows = []
    for b, r in sorted(data["buckets"].items(), key=lambda kv: int(kv[0])):
        model = CostModel(prof, BatchClass(int(b), int(r["decode"]), int(r["ctx"])))
        for label, t in r["strategies"].items():
            measured = t["step_ms"] / layers
            if label == "sequential":
                lay = model.measured_sequential_ms()
                ms = lay if lay is not None else sum(model.full_ms(op, 0, int(b)) for op in g.names)
            else:
                name = label.split(":", 1)[1]
                path = os.path.join(args.measured_plans or "", f"{name}.json")
                plan = load_plan(path if args.measured_plans and os.path.isfile(path) else name)
                ms = schedule_ms(record(plan, g) if plan.bucket == int(b) else _recorded(name, int(b), g), model)
            rows.append({"bucket": int(b), "strategy": label, "measured_ms": measured, "modelled_ms": ms,
                         "error": ms / measured - 1.0})
            print(f"[{b}] {label:44s} measured {measured:.4f} ms a layer, modelled {ms:.4f} "
                  f"({ms / measured - 1.0:+.1%})", flush=True)
    out["evaluation"] = {"measured": args.measured, "rows": rows,
                         "max_abs_error": max((abs(r["error"]) for r in rows), default=None)}


def _recorded(name: str, bucket: int, g):
    from nfjax.schedule.api import ScheduleContext
    from nfjax.schedule.plan import load_plan
    from nfjax.schedule.strategies import NanoFlow
    return NanoFlow(load_plan(name)).record(ScheduleContext(bucket, g))


def decode_of(args, bucket: int) -> int:
    return args.decode * bucket // max(args.token_buckets)


def time_step(args, cfg, chosen: dict, out: dict) -> None:
    import numpy as np

    from bench.common import time_fn
    from bench.nanoflow import _one_layer, dispatch_ms
    from bench.setup import bench_runner, config_record, setting
    from bench.step_bench import (kernel_table, make_step_input, mixed_batch, run_step, stream_timeline,
                                  synthetic_context, synthetic_pages, trace)
    from nfjax.config import StrategyConfig
    ps = setting(args, "cache", "page_size")
    batches = {b: mixed_batch(b, args.ctx, ps, num_decode=decode_of(args, b))[1] for b in args.token_buckets}
    strats = [StrategyConfig("nanoflow", plan=HAND)] if args.hand else []
    searched = {}
    for b, f in chosen.items():
        if f:
            sc = StrategyConfig("nanoflow", plan=f)
            searched[b] = sc.label
            if sc.label not in [s.label for s in strats]:
                strats.append(sc)
    runner = bench_runner(args, context=synthetic_context(batches.values(), ps), compile=False,
                          defaults={"cache": {"num_pages": synthetic_pages(batches.values())}},
                          extra={"execution": {"strategies": tuple(strats)}})
    out["engine_config"] = config_record(runner.config)
    t0 = time.perf_counter()
    runner.compile_all()
    out["compile_s"] = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    hand_label = f"nanoflow:{HAND}"
    for b in args.token_buckets:
        inp = make_step_input(runner, batches[b], b, decode_of(args, b), rng)
        res = {}
        for label in runner.variants.by_bucket[b]:
            t = time_fn(lambda: run_step(runner, b, label, inp), iters=5, reps=5, warmup=2)
            res[label] = {"step_ms": t["median_s"] * 1e3, "per_layer_ms": t["median_s"] * 1e3 / cfg.num_layers,
                          "dispatch_ms": dispatch_ms(lambda: run_step(runner, b, label, inp))}
            print(f"[{b}] {label:44s} {res[label]['step_ms']:8.2f} ms", flush=True)
        seq = res["sequential"]["step_ms"]
        s_label = searched.get(b, "sequential")
        srch = res[s_label]["step_ms"]
        hand = res.get(hand_label, {}).get("step_ms")
        out["buckets"][str(b)] = {"strategies": res, "decode": decode_of(args, b), "ctx": args.ctx,
                                  "searched": s_label, "overlap_ratio": seq / srch,
                                  "autosearch_vs_handtuned": hand / srch if hand else None,
                                  "handtuned_vs_sequential": seq / hand if hand else None}
        late = time.perf_counter() - T0 > args.trace_after
        # the searched strategy's timeline, Sequential too when the search chose it (what a plan would have to beat)
        if args.trace and not late and b == max(args.token_buckets):
            pd = trace(lambda: run_step(runner, b, s_label, inp), "/tmp/nfjax_prof", f"autosearch_{b}", calls=1)
            out["kernels"] = kernel_table(pd, calls=1, top=25)
            out["timelines"] = {s_label: _one_layer(stream_timeline(pd), cfg.num_layers)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap)
    ap.add_argument("--decode", type=int, default=256, help="decode sequences in the largest bucket (scaled)")
    ap.add_argument("--ctx", type=int, default=1280, help="decode context length")
    ap.add_argument("--grid", choices=("full", "quick"), default="full", help="profile grid")
    ap.add_argument("--profile", default=None, help="use this profile instead of measuring one")
    ap.add_argument("--search-only", action="store_true",
                    help="search (and evaluate) only: no step is compiled or timed (with --profile, no device)")
    ap.add_argument("--measured", default=None,
                    help="a previous run's result JSON: model each strategy it timed against its measured time")
    ap.add_argument("--measured-plans", default=None, help="folder of that run's searched plans (by name)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds for the whole search")
    ap.add_argument("--no-hand", dest="hand", action="store_false", help="leave the hand-tuned plan out")
    ap.add_argument("--no-trace", dest="trace", action="store_false")
    ap.add_argument("--trace-after", type=float, default=420.0,
                    help="skip the timeline trace when the run has already taken this many seconds")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="autosearch")
    args = ap.parse_args()
    args.token_buckets = tuple(sorted(args.token_buckets or (1024, 2048)))
    args.out = args.out or os.environ.get("BENCH_RESULTS_DIR") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(args.out, exist_ok=True)
    from bench.common import device_info, print_table
    from bench.setup import model_config
    cfg = model_config(args)
    out = {"device": device_info(), "config": cfg.to_json(), "buckets": {}}

    def log(m):
        print(m, flush=True)
    prof = profile_step(args, cfg, out, log)
    out["profile_errors"] = prof.get("errors", [])
    chosen = search_step(args, prof, out)
    if args.measured:
        evaluate_measured(args, prof, out)
    save(args, out)
    if args.search_only:
        pdir = os.path.join(args.out, "plans")
        print(f"search only: plans in {pdir}; no step timed", flush=True)
        return
    try:
        time_step(args, cfg, chosen, out)
    finally:
        rows = [[b, lb, r["step_ms"], r["per_layer_ms"], out["buckets"][b]["strategies"]["sequential"]["step_ms"]
                 / r["step_ms"]] for b, v in out["buckets"].items() for lb, r in v["strategies"].items()]
        out["table"] = rows
        if rows:
            print_table(["bucket", "strategy", "step ms", "per-layer ms", "Sequential / this"], rows)
        save(args, out)


def save(args, out: dict) -> None:
    from bench.common import write_results
    from bench.nanoflow import plot_timeline
    summary = {"autosearch_solve_s": out.get("autosearch_solve_s"), "profile_s": out.get("profile_s")}
    for b, m in out.get("modelled", {}).items():
        for k in ("searched_ms", "handtuned_ms", "sequential_ms"):
            if isinstance(m.get(k), float):
                summary[f"modelled_{k}_{b}"] = m[k]
    if out.get("evaluation"):
        summary["model_max_abs_error"] = out["evaluation"]["max_abs_error"]
    big = out["buckets"].get(str(max(args.token_buckets)), {})
    if big:
        summary["overlap_ratio_1gpu"] = big["overlap_ratio"]
        summary["autosearch_vs_handtuned"] = big["autosearch_vs_handtuned"]
        summary["searched_plan"] = big["searched"]
    for b, r in out["buckets"].items():
        summary[f"overlap_ratio_{b}"] = r["overlap_ratio"]
        summary[f"autosearch_vs_handtuned_{b}"] = r["autosearch_vs_handtuned"]
        summary[f"handtuned_vs_sequential_{b}"] = r["handtuned_vs_sequential"]
        summary[f"sequential_step_ms_{b}"] = r["strategies"]["sequential"]["step_ms"]
    path = write_results(args.name, summary, {"args": vars(args), **out}, out_dir=args.out)
    if out.get("timelines"):
        plot_timeline(path.replace(".json", "-timeline.png"), out["timelines"])
    if out["buckets"]:
        plot_steps(path.replace(".json", "-steps.png"), out)


def plot_steps(path: str, out: dict) -> str | None:
    """Step time per bucket: Sequential, the hand-tuned plan, the searched plan (bars), and the modelled layer times
    x layers (ticks)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    buckets = sorted(out["buckets"], key=int)
    kinds = [("sequential", "Sequential"), (f"nanoflow:{HAND}", "hand-tuned"), (None, "searched")]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    layers = out["config"]["num_layers"]
    for i, (label, name) in enumerate(kinds):
        xs, ys = [], []
        for j, b in enumerate(buckets):
            r = out["buckets"][b]
            lb = label or r["searched"]
            if lb in r["strategies"]:
                xs.append(j + (i - 1) * 0.27)
                ys.append(r["strategies"][lb]["step_ms"])
        bars = ax.bar(xs, ys, width=0.25, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
        mod = [out.get("modelled", {}).get(b, {}) for b in buckets]
        key = {"Sequential": "sequential_ms", "hand-tuned": "handtuned_ms", "searched": "searched_ms"}[name]
        pts = [(j + (i - 1) * 0.27, m[key] * layers) for j, m in enumerate(mod) if isinstance(m.get(key), float)]
        if pts:
            ax.scatter(*zip(*pts), marker="_", s=200, color="k", zorder=3,
                       label="modelled (layer x layers)" if i == 0 else None)
    ax.set_xticks(range(len(buckets)))
    ax.set_xticklabels([f"{b} tokens, {out['buckets'][b]['decode']} decodes" for b in buckets])
    ax.set_ylabel("step ms")
    ax.set_title(f"auto-search vs hand-tuned vs Sequential ({out['device'].get('name', '')})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return path


if __name__ == "__main__":
    main()
