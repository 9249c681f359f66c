"""FlexGen mode: output tokens/s of a model larger than the GPU's share, the best of a grid of offload policies
against the row-by-row baseline (each GPU batch loads each layer's weights synchronously, nothing overlaps:
what Accelerate and DeepSpeed offloading do), with and without 4-bit weights (and 4-bit KV), and a timeline of one
traced decode pass (transfers and computations as they really ran). The headline is the best policy without
compression; `_int4` the best with 4-bit weights.

    python -m bench.flexgen                                   # OPT-30B shape, bf16 random weights, GPU capped at 16 GB
    python -m bench.flexgen --policies w0-kvcpu-4x16,int4-w0-8x16 --gen-len 32
    python -m bench.flexgen --shape opt-smoke --layers 2 --prompt-len 16 --gen-len 4 --gpu-memory-gb 1   # a CPU

On the GPU machine one command may run 10 minutes: placing OPT-30B's 60 GB and a block of prefill + 32 tokens
take a few minutes a policy, so run the grid a few `--policies` at a time (`--no-baseline` on all but one) with
BENCH_RESULTS_DIR=$OUT and `--name` per call.

Throughput is FlexGen's: a block's generated tokens (block size x gen-len) over the time from its prefill to its
last token, after a warm-up block of the same shapes (its first two passes, with the KV arrays of the full
gen-len, so nothing compiles in the timed one); placing the weights is not counted. Every run records each pass's
seconds (`pass_s`: the layers plus the head, sampling and embedding up to the next pass). Policies that do not fit
the caps (`nfjax.offload.budget`) are skipped and listed with the reason. `--offload FILE` adds a policy file.
Summary keys: flexgen_out_tok_s_<shape>_<N>gb, flexgen_vs_rowbyrow, flexgen_out_tok_s_<shape>_<N>gb_int4.

The row-by-row baseline runs one GPU batch (`--baseline-batch`, default the best policy's size) with the same
placement: its tokens/s does not depend on how many batches run one after another. It is timed over its prefill
and `--baseline-gen-len` - 1 decode passes (default 4 tokens) and its block time extrapolated to --gen-len as the
setup + prefill pass + (gen-len - 1) x the mean decode pass (`extrapolated`, `extrapolation`, `pass_s` in
its record; a row-by-row pass of OPT-30B takes seconds). Its weights come from pinned host memory (DeepSpeed
ZeRO-Inference's pinned buffers; the zig-zag runs' host memory too) and/or pageable numpy arrays (Accelerate's cpu
offload: synchronous copies of pageable tensors), `--baseline-memory`: `flexgen_vs_rowbyrow` is over the pinned one
(the two runs then differ only in the schedule), `flexgen_vs_rowbyrow_numpy` over the pageable one;
`flexgen_vs_rowbyrow_int4`: the best 4-bit run over the same (uncompressed, pinned) baseline.

    python -m bench.flexgen --baseline-only --baseline-batch 8          # numpy then pinned, placed as w0-kvcpu-8x8
    python -m bench.flexgen --merge-only --merge base.json,policies.json  # one summary of both, no device work

The cost model and the LP (issue #25, bench/flexgen_model.py): this machine's hardware profile is measured (or read
from its cache) first, and every run records the cost model's predicted tokens/s beside the measured one
(summary `cost_model_mean_abs_err_pct`, over the zig-zag runs). `--grid auto` replaces the named grid by
`--grid-size` (default 24) feasible policies spread over the model's ranking; `--lp` (or `--offload auto`) also runs
the policy the LP search picks for the caps (`--gpu-memory-gb`, `--cpu-memory-gb`, `--disk-gb`), logging it with
its predicted tokens/s, and reports its measured tokens/s over the grid's best (`lp_policy_vs_best_grid`);
`--cpu-attention-ab` runs the best policy with KV off the GPU once more with `cpu_attention` flipped
(`cpu_attention_speedup`: on over off).

    python -m bench.flexgen --grid auto --lp --cpu-attention-ab --no-baseline     # the issue #25 run, in one go

A run longer than one device command splits: `--grid-part K/N` runs every N-th policy of the (sorted) grid from
the K-th, each part writing its own results (`--name`), and `--merge A.json,B.json` adds the runs of earlier
parts (and their LP and CPU-attention records) before the summary is computed (`--no-trace`, `--no-baseline`
on all but one part).
"""
from __future__ import annotations

import argparse
import os
import time

from bench.common import merged_parts, result_path, write_results
from bench.flexgen_run import _timed_generate, host_fits, overlap_stats, run_policy  # noqa: F401 - the tests' names
from bench.flexgen_summary import _baseline_summary, _finish, _merge, _summary
from bench.setup import add_bench_args

# name -> policy fields (weights / cache / activations as gpu-cpu-disk percentages); the default grid of a shape
GRIDS = {
    # OPT-30B: 60 GB of bf16 weights, 0.75 GB of KV a sequence at 544 positions. A 16 GB GPU holds no useful share
    # of the weights (a layer's split is by tensor: the next step past 0% is 33%, 20 GB), so they live in host
    # memory and the KV cache fills the rest of it (128 GB); many small GPU batches a block amortize each weight
    # load (decode compute per batch is ~1% of a layer's transfer).
    "opt-30b": {
        "w0-kvcpu-4x16": dict(gpu_batch_size=4, num_gpu_batches=16, weights=(0, 100, 0), cache=(12, 88, 0)),
        "w0-kvcpu-8x8": dict(gpu_batch_size=8, num_gpu_batches=8, weights=(0, 100, 0), cache=(12, 88, 0)),
        "w0-kvcpu-8x6": dict(gpu_batch_size=8, num_gpu_batches=6, weights=(0, 100, 0), cache=(16, 84, 0)),
        "w0-kvdisk-8x10": dict(gpu_batch_size=8, num_gpu_batches=10, weights=(0, 100, 0), cache=(10, 60, 30)),
        # the same as w0-kvcpu-8x8 with the host weights in numpy arrays, not pinned_host ones: which is faster
        "w0-kvcpu-8x8-numpy": dict(gpu_batch_size=8, num_gpu_batches=8, weights=(0, 100, 0), cache=(12, 88, 0),
                                   host_memory="numpy"),
        "int4-w0-8x16": dict(gpu_batch_size=8, num_gpu_batches=16, weights=(0, 100, 0), cache=(6, 94, 0),
                             compress_weights=True),
        "int4-w0-16x8": dict(gpu_batch_size=16, num_gpu_batches=8, weights=(0, 100, 0), cache=(6, 94, 0),
                             compress_weights=True),
        "int4-kv4-w0-16x16": dict(gpu_batch_size=16, num_gpu_batches=16, weights=(0, 100, 0), cache=(8, 92, 0),
                                  compress_weights=True, compress_cache=True),
        # the LP's picks from the H100's measured profile (bench/NOTES.md section 17): 4-bit KV alone (55.8 tok/s
        # predicted, 15x the pinned row-by-row 3.72) and with 4-bit weights (106 tok/s); uncompressed, the model's
        # best is 16.7 tok/s (4.5x): KV traffic, not weight loads, bounds a large block
        "kv4-w0-8x16": dict(gpu_batch_size=8, num_gpu_batches=16, weights=(0, 100, 0), cache=(25, 75, 0),
                            compress_cache=True),
        "int4-kv4-w0-8x8": dict(gpu_batch_size=8, num_gpu_batches=8, weights=(0, 100, 0), cache=(70, 30, 0),
                                compress_weights=True, compress_cache=True),
    },
    "opt-smoke": {
        "w50-kvcpu-2x4": dict(gpu_batch_size=2, num_gpu_batches=4, weights=(50, 50, 0), cache=(0, 100, 0)),
        "w0-disk-4x2": dict(gpu_batch_size=4, num_gpu_batches=2, weights=(0, 50, 50), cache=(0, 100, 0)),
        "int4-w0-2x4": dict(gpu_batch_size=2, num_gpu_batches=4, weights=(0, 100, 0), cache=(0, 100, 0),
                            compress_weights=True),
        "int4-kv4-w0-2x4": dict(gpu_batch_size=2, num_gpu_batches=4, weights=(0, 100, 0), cache=(0, 100, 0),
                                compress_weights=True, compress_cache=True),
        "kv4-w0-2x4": dict(gpu_batch_size=2, num_gpu_batches=4, weights=(0, 100, 0), cache=(0, 100, 0),
                           compress_cache=True),
    },
}


def make_policy(fields: dict, args):
    from nfjax.offload import Policy, Split
    kw = dict(fields)
    for f in ("weights", "cache", "activations"):
        if isinstance(kw.get(f), tuple):
            kw[f] = Split(*kw[f])
    return Policy(**kw, gpu_memory_gb=args.gpu_memory_gb, cpu_memory_gb=args.cpu_memory_gb, disk_gb=args.disk_gb,
                  offload_dir=args.offload_dir)


def grid(args) -> dict:
    from nfjax.offload import Policy
    shape = args.shape if args.shape in GRIDS else "opt-smoke"
    pols = {n: make_policy(f, args) for n, f in GRIDS[shape].items()}
    if args.policies:
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        bad = [n for n in names if n not in pols]
        if bad:
            raise SystemExit(f"--policies: unknown {bad[0]!r}; the {shape} grid has {', '.join(pols)}")
        pols = {n: pols[n] for n in names}
    if args.offload and args.offload != "auto":           # --offload auto is --lp (main)
        pols[os.path.basename(args.offload)] = Policy.load(args.offload)
    return pols


BASELINE_FROM = {"opt-30b": "w0-kvcpu-8x8"}     # --baseline-only's policy (placement, GPU batch size) by default
HOST_MEMORIES = ("pinned", "numpy")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(p, shape="opt-30b")
    g = p.add_argument_group("flexgen")
    g.add_argument("--prompt-len", type=int, default=512)
    g.add_argument("--gen-len", type=int, default=32)
    p.set_defaults(gpu_memory_gb=16.0)          # the engine flags' --gpu-memory-gb: 16 GB here (issue #24's cap)
    g.add_argument("--grid", choices=("named", "auto"), default="named",
                   help="named: the shape's policies (GRIDS); auto: --grid-size feasible policies over the cost model")
    g.add_argument("--grid-size", type=int, default=24)
    g.add_argument("--max-block", type=int, default=1024, help="most sequences a block (auto grid and --lp)")
    g.add_argument("--lp", action="store_true", help="also run the LP search's policy, against the grid's best")
    g.add_argument("--cpu-attention-ab", action="store_true",
                   help="the best policy with KV off the GPU, again with cpu_attention flipped")
    g.add_argument("--grid-part", default=None, metavar="K/N", help="run every N-th policy from the K-th (0-based)")
    g.add_argument("--merge", default=None, help="result JSONs of earlier parts, comma-separated")
    g.add_argument("--merge-only", action="store_true",
                   help="run nothing: the summary of the --merge parts (policy runs, baselines) alone")
    g.add_argument("--no-trace", action="store_true", help="skip the traced decode pass and its timeline")
    g.add_argument("--policies", default=None, help="names from the shape's grid, comma-separated (default all)")
    g.add_argument("--no-baseline", action="store_true", help="skip the row-by-row baseline")
    g.add_argument("--baseline-only", action="store_true",
                   help="run only the row-by-row baseline, placed as the first --policies policy (opt-30b: "
                        "w0-kvcpu-8x8), one GPU batch of --baseline-batch")
    g.add_argument("--baseline-batch", type=int, default=None,
                   help="the baseline's GPU batch size (default: the best / selected policy's)")
    g.add_argument("--baseline-gen-len", type=int, default=4,
                   help="tokens a sequence the baseline's timed block generates (its prefill and N - 1 decode "
                        "passes), extrapolated to --gen-len; >= --gen-len times the whole block")
    g.add_argument("--baseline-memory", default=None,
                   help="host memory kinds of the baseline's weights, in order, comma-separated: pinned (JAX "
                        "pinned_host, DeepSpeed ZeRO-Inference's pinned buffers) and/or numpy (pageable, Accelerate's "
                        "cpu offload); default numpy,pinned with --baseline-only, else pinned")
    g.add_argument("--policy-gen-len", type=int, default=None,
                   help="time the policies' blocks over their prefill and N - 1 decode passes and extrapolate to "
                        "--gen-len as the baseline is (default: the whole block)")
    g.add_argument("--budget-s", type=float, default=None,
                   help="skip a policy whose run (warm-up and timed passes, as the cost model predicts them) would "
                        "end past this many seconds from the start; the results file is rewritten after each run")
    g.add_argument("--hardware", default=None, metavar="FILE",
                   help="the hardware profile to rank and predict with (a profile JSON, or a result file holding "
                        "one) instead of this machine's measured one")
    g.add_argument("--out-dir", default=None, help="results folder (default bench/results)")
    g.add_argument("--name", default="flexgen")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    if args.merge_only:
        return _merge_only(args)
    from nfjax import pinned_pool
    from nfjax.offload.budget import host_cap_gb
    print(f"[{pinned_pool.ENV}={pinned_pool.size_for(host_cap_gb(args.cpu_memory_gb), log=print)}]", flush=True)
    mems = [m.strip() for m in (args.baseline_memory or ("numpy,pinned" if args.baseline_only else "pinned"))
            .split(",") if m.strip()]
    if not mems or any(m not in HOST_MEMORIES for m in mems):
        raise SystemExit(f"--baseline-memory: a comma-separated list of {', '.join(HOST_MEMORIES)}, "
                         f"got {args.baseline_memory!r}")
    if args.baseline_gen_len < 2 or (args.policy_gen_len is not None and args.policy_gen_len < 2):
        raise SystemExit("--baseline-gen-len and --policy-gen-len: integers >= 2 (the prefill and a decode pass)")
    if args.baseline_batch is not None and args.baseline_batch < 1:
        raise SystemExit("--baseline-batch: an integer >= 1")
    from bench.setup import model_config
    from nfjax.offload import PolicyError
    from bench import flexgen_model as fm
    cfg = model_config(args)
    hw = fm.profile(cfg, args, log=lambda m: print(f"[{m}]", flush=True))
    limits = fm.caps(args)
    if args.cpu_memory_gb is None and limits.get("cpu"):
        # the host memory free now, before any placement: a later policy's check would otherwise count the memory
        # the previous one's freed arrays leave in the process's pinned pool as taken (the H200's baseline saw 47
        # of ~125 GB after the 60 GB placement was freed)
        args.cpu_memory_gb = limits["cpu"] / 1e9
    pols = grid(args)
    if args.baseline_only:
        return _baseline_only(cfg, args, hw, limits, pols, mems)
    if args.grid == "auto":
        pols = {**fm.auto_grid(cfg, args, hw, limits, args.grid_size, make_policy),
                **({k: v for k, v in pols.items() if k == os.path.basename(args.offload)}
                   if args.offload and args.offload != "auto" else {})}
    lp = fm.lp_policy(cfg, args, hw, limits, make_policy, log=lambda m: print(f"[{m}]", flush=True)) \
        if args.lp or args.offload == "auto" else None
    runs, skipped = {}, {}
    order = sorted(pols)
    if args.grid_part:
        try:
            k, n = (int(x) for x in args.grid_part.split("/"))
            assert 0 <= k < n
        except (ValueError, AssertionError):
            raise SystemExit(f"--grid-part: K/N with 0 <= K < N, got {args.grid_part!r}") from None
        order = order[k::n]
    if lp is not None:
        pols["lp"] = lp.policy
        order.append("lp")
    # policies that place their weights alike run one after another, the weights placed once (`same_placement`)
    w = {k: pols[k].weights for k in pols}
    # the LP's run first among its placement: the summary's headline ratio needs it, and a later run may not finish
    order.sort(key=lambda k: (w[k].gpu, w[k].cpu, w[k].disk, pols[k].compress_weights, pols[k].host_memory,
                              k != "lp"))
    for name in order:
        pol = pols[name]
        if args.budget_s is not None:
            est, left = fm.run_seconds(cfg, pol, args, hw), args.budget_s - (time.perf_counter() - t_start)
            if est > left:
                skipped[name] = f"--budget-s: its run predicted {est:.0f} s, {left:.0f} s left"
                print(f"[skip {name}: {skipped[name]}]", flush=True)
                continue
        why = host_fits(cfg, pol, args, runs)
        if why:
            skipped[name] = why
            print(f"[skip {name}: {why}]", flush=True)
            continue
        try:
            runs[name] = run_policy(cfg, pol, args, hw=hw, label=name,       # the budget is checked before placing
                                    passes=args.policy_gen_len)
        except PolicyError as e:
            skipped[name] = str(e)
            print(f"[skip {name}: {e}]", flush=True)
            continue
        print(f"[{name}: {runs[name]['out_tok_s']:.2f} tok/s{' (extrapolated)' if runs[name]['extrapolated'] else ''}"
              f", predicted {runs[name].get('predicted_tok_s', 0):.2f}]", flush=True)
        # what has run so far, in case the command is killed before the end (a --merge part as it is)
        write_results(args.name, {"partial": True}, {"shape": args.shape, "layers": cfg.num_layers,
                                                      "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                                                      "runs": runs, "skipped": skipped, "hardware": hw.to_json()},
                      args.out_dir)
    merged = _merge(args.merge, runs) if args.merge else {}
    if not runs:
        raise SystemExit("no policy of the grid fits the caps: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    data = {"shape": args.shape, "layers": cfg.num_layers, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "runs": runs, "skipped": skipped, "hardware": hw.to_json(),
            "caps": {k: v for k, v in limits.items()}}
    lp_info = merged.get("lp")
    if lp is not None:
        lp_info = {"policy": lp.policy.to_json(), "predicted_tok_s": lp.predicted_tok_s, "lp_tok_s": lp.lp.out_tok_s,
                   "solver": lp.solver, "solve_s": lp.solve_seconds, "feasible_lps": len(lp.solutions)}
    if isinstance(merged.get("cpu_attention_ab"), dict):
        data["cpu_attention_ab"] = merged["cpu_attention_ab"]
    summary = _summary(args, runs)
    _model_summary(cfg, args, hw, runs, lp_info, summary, data)
    base = dict(merged.get("rowbyrow", {}))
    if not args.no_baseline:
        best = summary.get("flexgen_best_policy", summary["flexgen_best_policy_any"])
        base.update(_baselines(cfg, args, runs[best]["policy"], mems, hw=hw))
    _baseline_summary(runs, base, summary, data)
    if not args.no_trace:
        _trace(cfg, args, runs, summary["flexgen_best_policy_any"], summary, data)
    _finish(args, summary, data)
    return 0


def _baselines(cfg, args, template: dict, mems: list[str], done=None, hw=None) -> dict:
    """The row-by-row baseline: one GPU batch (`--baseline-batch`, default the template's size) placed as the
    template policy, its weights in each host memory kind of `mems` (in that order), each timed over the prefill and
    `--baseline-gen-len` - 1 decode passes and extrapolated to --gen-len (`run_policy`). host memory kind -> run;
    `done(runs so far)` after each."""
    out = {}
    bs = args.baseline_batch or template["gpu_batch_size"]
    for mem in mems:
        # uncompressed whatever the template: the baseline is what Accelerate and DeepSpeed offloading do
        pol = make_policy({**_fields(template), "gpu_batch_size": bs, "num_gpu_batches": 1, "schedule": "row_by_row",
                           "host_memory": mem, "compress_weights": False, "compress_cache": False}, args)
        run = run_policy(cfg, pol, args, passes=args.baseline_gen_len, label=f"row-by-row {mem}", hw=hw)
        print(f"[row-by-row {mem}: {run['out_tok_s']:.3f} tok/s, predicted {run.get('predicted_tok_s', 0):.3f}"
              + (f" (extrapolated: {run['extrapolation']}; prefill pass {run['prefill_pass_s']:.3g} s, decode pass "
                 f"{run['decode_pass_mean_s']:.3g} s)" if run["extrapolated"] else "") + "]", flush=True)
        out[mem] = run
        if done is not None:
            done(out)
    return out


def _baseline_only(cfg, args, hw, limits, pols: dict, mems: list[str]) -> int:
    """`--baseline-only`: the baselines alone (with --merge: joined to earlier parts' runs into one summary)."""
    name = next(iter(pols)) if args.policies else BASELINE_FROM.get(args.shape, next(iter(pols)))
    template = pols[name].to_json()
    info = {"shape": args.shape, "layers": cfg.num_layers, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "runs": {}, "hardware": hw.to_json(), "baseline_template": name}
    # each baseline written as it finishes, in case the command is killed before the end (a --merge part as it is)
    base = _baselines(cfg, args, template, mems, hw=hw,
                      done=lambda b: write_results(args.name, {"partial": True}, {**info, "rowbyrow": b}, args.out_dir))
    runs: dict = {}
    merged = _merge(args.merge, runs) if args.merge else {}
    base = {**merged.get("rowbyrow", {}), **base}
    data = {"shape": args.shape, "layers": cfg.num_layers, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "runs": runs, "skipped": {}, "hardware": hw.to_json(), "caps": dict(limits),
            "baseline_template": name}
    summary = _summary(args, runs) if runs else {}
    if runs:
        _model_summary(cfg, args, hw, runs, merged.get("lp"), summary, data)
    _baseline_summary(runs, base, summary, data)
    _finish(args, summary, data)
    return 0


def _merge_only(args) -> int:
    """`--merge-only`: the summary of earlier parts (policy runs, baselines, LP and CPU-attention records), no
    device work; the hardware profile is the first part's."""
    if not args.merge:
        raise SystemExit("--merge-only: name the parts with --merge A.json,B.json")
    runs: dict = {}
    merged = _merge(args.merge, runs)
    parts = merged_parts(args.merge, "bench.flexgen")
    first = parts[0][1]
    data = {k: first[k] for k in ("shape", "layers", "prompt_len", "gen_len", "hardware", "caps") if k in first}
    data.update(runs=runs, skipped={k: v for _, d in parts for k, v in d.get("skipped", {}).items()},
                parts=[p for p, _ in parts])
    if isinstance(merged.get("cpu_attention_ab"), dict):
        data["cpu_attention_ab"] = merged["cpu_attention_ab"]
    args.shape = data.get("shape", args.shape)
    caps = [r["policy"].get("gpu_memory_gb") for r in runs.values() if r["policy"].get("gpu_memory_gb")]
    args.gpu_memory_gb = caps[0] if caps else args.gpu_memory_gb        # the runs' cap names the summary keys
    summary = _summary(args, runs) if runs else {}
    if runs:
        _model_summary(None, args, None, runs, merged.get("lp"), summary, data)
    _baseline_summary(runs, merged.get("rowbyrow", {}), summary, data)
    if not summary:
        raise SystemExit("--merge-only: the parts hold no policy run and no baseline")
    _finish(args, summary, data)
    return 0


def _trace(cfg, args, runs: dict, best: str, summary: dict, data: dict) -> None:
    """A traced decode pass of the best run that moves data (weights or KV off the GPU; GPU attention, one compute a
    batch), its overlap shares and its timeline picture."""
    from nfjax.offload.trace import plot
    moving = {k: v for k, v in runs.items() if not v["policy"]["cpu_attention"]
              and (v["policy"]["weights"]["gpu"] < 100 or v["policy"]["cache"]["gpu"] < 100)}
    shown = max(moving, key=lambda k: runs[k]["out_tok_s"]) if moving else best
    traced = run_policy(cfg, make_policy(_fields(runs[shown]["policy"]), args), args, trace=True,
                        label=f"{shown} traced")
    events = traced.pop("events")
    passes = [e for e in events if e["lane"] == "compute" and "unpack" not in e["label"]]
    per = cfg.num_layers * runs[shown]["policy"]["num_gpu_batches"]
    # the first decode pass: from the prefill's last computation to its own last one
    window = (passes[per - 1]["end_ms"], passes[2 * per - 1]["end_ms"]) if len(passes) >= 2 * per else None
    data["trace"] = {"events": events, "decode_window_ms": window, **overlap_stats(
        [e for e in events if window is None or window[0] <= e["start_ms"] <= window[1]])}
    summary.update({f"trace_{k}": v for k, v in data["trace"].items() if k.startswith("overlapped_pct")})
    png = result_path(args.name, args.out_dir).replace(".json", "-timeline.png")
    os.makedirs(os.path.dirname(png), exist_ok=True)
    data["trace"]["policy"] = shown
    data["timeline_png"] = plot(events, png, f"{args.shape}, policy {shown}: one decode pass (measured)", window)


def _model_summary(cfg, args, hw, runs: dict, lp: dict | None, summary: dict, data: dict) -> None:
    """The LP against the grid's best, CPU attention on/off, and the cost model's error over every zig-zag run
    (`lp`: the LP's record, this invocation's or a merged part's)."""
    from nfjax.offload import Policy
    grid_runs = {k: v for k, v in runs.items() if k != "lp"}
    if lp is not None and "lp" in runs and grid_runs:
        best = max(grid_runs, key=lambda k: grid_runs[k]["out_tok_s"])
        summary["lp_policy_vs_best_grid"] = runs["lp"]["out_tok_s"] / grid_runs[best]["out_tok_s"]
        summary["lp_predicted_tok_s"] = lp["predicted_tok_s"]
        summary["lp_grid_size"] = len(grid_runs)
        data["lp"] = {**lp, "best_grid_policy": best}
    ab = data.get("cpu_attention_ab")
    if not args.cpu_attention_ab and isinstance(ab, dict):          # merged from an earlier part
        summary["cpu_attention_speedup"] = ab["on"]["out_tok_s"] / ab["off"]["out_tok_s"]
        orig = runs.get(ab["policy"], {}).get("policy")
        runs_all = [*runs.values(), *(r for r in (ab["on"], ab["off"]) if r["policy"] != orig)]
    elif args.cpu_attention_ab:
        off_gpu = sorted((k for k, v in runs.items() if v["policy"]["cache"]["gpu"] < 100),
                         key=lambda k: -runs[k]["out_tok_s"])
        # the fastest such run whose flip fits the host (CPU attention holds more host memory: 22.3's A/B was killed)
        why = {k: host_fits(cfg, Policy.from_json(runs[k]["policy"]).replace(
            cpu_attention=not runs[k]["policy"]["cpu_attention"]), args, runs) for k in off_gpu}
        fits = [k for k in off_gpu if not why[k]]
        if fits:
            name = fits[0]
            pol = Policy.from_json(runs[name]["policy"])
            flipped = run_policy(cfg, pol.replace(cpu_attention=not pol.cpu_attention), args, hw=hw,
                                 passes=args.policy_gen_len, label=f"{name} cpu_attention flipped")
            on, off = (runs[name], flipped) if pol.cpu_attention else (flipped, runs[name])
            summary["cpu_attention_speedup"] = on["out_tok_s"] / off["out_tok_s"]
            data["cpu_attention_ab"] = {"policy": name, "on": on, "off": off}
            runs_all = [*runs.values(), flipped]
        elif off_gpu:
            data["cpu_attention_ab"] = f"no flip fits: {why[off_gpu[0]]}"
            runs_all = list(runs.values())
        else:
            data["cpu_attention_ab"] = "no run holds KV off the GPU"
            runs_all = list(runs.values())
    else:
        runs_all = list(runs.values())
    errs = [abs(r["predicted_err_pct"]) for r in runs_all if "predicted_err_pct" in r]
    if errs:
        summary["cost_model_mean_abs_err_pct"] = sum(errs) / len(errs)
        summary["cost_model_runs"] = len(errs)


def _fields(policy_json: dict) -> dict:
    d = {k: v for k, v in policy_json.items() if k not in ("gpu_memory_gb", "cpu_memory_gb", "disk_gb", "offload_dir")}
    for f in ("weights", "cache", "activations"):
        d[f] = tuple(d[f].values())
    return d


if __name__ == "__main__":
    raise SystemExit(main())
