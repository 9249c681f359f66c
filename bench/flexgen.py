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

from bench.common import merged_parts, print_table, result_path, write_results
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


_PLACED: dict = {}      # the last run's engine and graphdefs: its placed weights serve the next policy placing alike
_PROGRAMS: dict = {}    # Top-K -> compiled Programs, shared by every engine of the run (each shape compiles once)


class _Enough(Exception):
    """Raised at the start of a pass past the ones asked for (`_timed_generate`)."""


def _timed_generate(eng, prompts, gen_len: int, passes: int | None = None, log=None):
    """Generate up to `gen_len` tokens a sequence with the engine's KV arrays sized for all of them (the shapes
    of the full run: nothing compiles again when a shorter run came first), stopping at the start of pass
    `passes` + 1 when `passes` is set. Returns (outputs or None when stopped, each pass's seconds: from its start
    to the next pass's start, or to the end of the block: the layers plus the head, sampling and embedding; the
    seconds before the first pass: the block's KV buffers, the prompts' embedding)."""
    from nfjax.engine import SamplingParams
    starts: list[float] = []
    run = eng.executor.run

    def timed(*a, **kw):
        now = time.perf_counter()
        if starts and log is not None:
            log(len(starts) - 1, now - starts[-1])
        starts.append(now)
        if passes is not None and len(starts) > passes:
            raise _Enough
        return run(*a, **kw)
    eng.executor.run = timed
    outs = None
    t_call = time.perf_counter()
    try:
        outs = eng.generate(prompts, SamplingParams.greedy(max_tokens=gen_len, ignore_eos=True))
        starts.append(time.perf_counter())
        if log is not None:
            log(len(starts) - 2, starts[-1] - starts[-2])
    except _Enough:
        pass
    finally:
        eng.executor.run = run
    return outs, [b - a for a, b in zip(starts, starts[1:])], (starts[0] - t_call) if starts else 0.0


def run_policy(cfg, policy, args, trace: bool = False, hw=None, passes: int | None = None, label: str = "") -> dict:
    """Place random weights by `policy` (or take the previous run's, placed alike: `same_placement`), run a
    warm-up block (its first two passes: the prefill and a decode pass, at the timed block's shapes), then the
    timed block; returns its numbers. `passes`: time only the prefill and `passes - 1` decode passes and
    extrapolate the block's time to `--gen-len` tokens from the prefill pass and the decode passes' mean."""
    import numpy as np

    from nfjax.offload.compute import Programs
    from nfjax.offload.engine import OffloadEngine, same_placement
    from nfjax.offload.random_layers import random_parts
    from nfjax.tokenizer.silent import SilentTokenizer
    rng = np.random.default_rng(0)
    n = policy.block_size
    prompts = [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(n)]
    import gc
    _reset_peak_rss()
    last = _PLACED.pop("engine", None)
    reuse = last is not None and same_placement(last.policy, policy)
    if not reuse:
        last = None                                  # freed before the new placement (one fits, not two)
    gc.collect()                                     # the last engine's reference cycles hold its host arrays
    if reuse:
        (rest_gd, layer_gd), rest_state, source = _PLACED["gds"], None, None
    else:
        rest_gd, rest_state, layer_gd, source = random_parts(cfg)
        _PLACED["gds"] = (rest_gd, layer_gd)
    topk = policy.attention_topk / 100
    programs = _PROGRAMS.get(topk) or _PROGRAMS.setdefault(topk, Programs(cfg, rest_gd, layer_gd, topk=topk))
    name = label or policy.schedule
    print(f"[{name}: placing ({'weights reused' if source is None else 'new weights'})]", flush=True)
    t0 = time.perf_counter()
    eng = OffloadEngine(cfg, rest_state, layer_gd, source, SilentTokenizer(cfg.vocab_size), policy,
                        max_model_len=args.prompt_len + args.gen_len, rest_gd=rest_gd, trace=trace,
                        weights_from=last, programs=programs)
    del last, rest_state
    _PLACED["engine"] = eng
    try:
        place_s = time.perf_counter() - t0
        print(f"[{name}: placed in {place_s:.1f} s; warm-up block (2 passes)]", flush=True)

        def progress(i, dt):
            print(f"[{name}: pass {i} ({'prefill' if i == 0 else 'decode'}) {dt:.3f} s]", flush=True)
        t0 = time.perf_counter()
        _timed_generate(eng, prompts, args.gen_len, passes=2)                       # compiles the shapes
        warm_s = time.perf_counter() - t0
        gen = args.gen_len
        if trace:                                      # the prefill and two decode passes, traced
            eng.trace.flush()
            eng.trace.events.clear()
            passes = 3
        if passes is not None and passes >= gen:
            passes = None                              # the whole block is timed anyway
        t0 = time.perf_counter()
        outs, pass_s, setup_s = _timed_generate(eng, prompts, gen, passes=passes, log=progress if passes else None)
        dt = time.perf_counter() - t0
        res = {"block": n, "gen_len": gen, "warmup_s": warm_s, "place_s": place_s, "weights_reused": source is None,
               "tier_bytes": eng.tier_bytes, "weight_bytes": eng.weights.bytes_by_tier(),
               "host_memory": policy.host_memory, "policy": policy.to_json(), "pass_s": pass_s, "setup_s": setup_s,
               "prefill_pass_s": pass_s[0] if pass_s else None,
               "decode_pass_mean_s": float(np.mean(pass_s[1:])) if len(pass_s) > 1 else None}
        if outs is not None:
            res.update(seconds=dt, out_tok_s=sum(len(o.token_ids) for o in outs) / dt, extrapolated=False)
        else:           # the prefill pass and passes - 1 decode passes measured; the block's time extrapolated
            est = setup_s + pass_s[0] + (gen - 1) * res["decode_pass_mean_s"]
            res.update(seconds=est, out_tok_s=n * gen / est, extrapolated=True, measured_passes=len(pass_s),
                       measured_s=dt, extrapolation=f"setup + prefill pass + ({gen} - 1) x the mean of "
                                                    f"{len(pass_s) - 1} measured decode passes")
        if hw is not None and not trace:
            from bench.flexgen_model import error_pct, predicted
            res.update(predicted(cfg, res["policy"], args, hw))
            res["predicted_err_pct"] = error_pct(res)
        if trace:
            eng.trace.flush()
            res["events"] = eng.trace.to_json()
        res["host_peak_rss_gb"] = _peak_rss_gb()
        res["host_rss_parts_gb"] = _rss_parts_gb()
        return res
    finally:
        eng.close()


def _reset_peak_rss() -> None:
    """Start this process's peak-RSS count again (Linux: 5 into clear_refs), so that each run records its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def host_fits(cfg, policy, args, runs: dict) -> str | None:
    """Why a policy would not fit this host's memory, or None, against 95% of the machine's memory. A run killed
    for memory would end the command and lose the policies after it.

    Runs that recorded their memory by kind (`host_rss_parts_gb`): the process's pinned pool (RssShmem) never
    shrinks but serves the next tier's pinned arrays, so the policy needs max(the largest pool so far, its host
    tier) plus the most any run held outside the pool (peak RSS less its pool: ~6-8 GB on the H100 host,
    bench/NOTES.md 23.1). Older records: its host tier plus the most any run held beyond its own tier (22.4)."""
    import psutil

    from nfjax.offload import budget
    tier = sum(n.bytes for n in budget.needs(cfg, policy, args.prompt_len + args.gen_len) if n.tier == "cpu")
    total = psutil.virtual_memory().total
    done = [r for r in runs.values() if r.get("host_peak_rss_gb")]
    if done and all(r.get("host_rss_parts_gb", {}).get("RssShmem") is not None for r in done):
        pool = max(r["host_rss_parts_gb"]["RssShmem"] for r in done) * 1e9
        rest = max(r["host_peak_rss_gb"] - r["host_rss_parts_gb"]["RssShmem"] for r in done) * 1e9
        if max(pool, tier) + rest > 0.95 * total:
            return (f"host memory: max(the pinned pool's {pool / 1e9:.0f} GB, its host tier's {tier / 1e9:.0f} "
                    f"GB) + {rest / 1e9:.0f} GB an earlier run held outside the pool > 95% of the machine's "
                    f"{total / 1e9:.0f} GB")
        return None
    held = max((r["host_peak_rss_gb"] * 1e9 - r["tier_bytes"].get("cpu", 0) for r in done), default=0.0)
    if tier + held > 0.95 * total:
        return (f"host memory: {tier / 1e9:.0f} GB in its host tier + {held / 1e9:.0f} GB held "
                f"beyond the tier by an earlier run > 95% of the machine's {total / 1e9:.0f} GB")
    return None


def _peak_rss_gb() -> float | None:
    """This process's peak resident host memory since the run began (Linux VmHWM), GB."""
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 / 1e9 for x in f if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def _rss_parts_gb() -> dict:
    """This process's resident memory now by kind (Linux RssAnon, RssFile, RssShmem; pinned host buffers show as
    shared memory), GB: where the bytes beyond the host tier are (bench/NOTES.md 22.4)."""
    try:
        with open("/proc/self/status") as f:
            return {x.split(":")[0]: int(x.split()[1]) * 1024 / 1e9 for x in f if x.startswith("Rss")}
    except OSError:
        return {}


def overlap_stats(events: list[dict]) -> dict:
    """Busy ms per lane and the share of transfer time that ran while a computation ran."""
    comp = sorted((e["start_ms"], e["end_ms"]) for e in events if e["lane"] == "compute")
    out = {}
    for lane in sorted({e["lane"] for e in events}):
        spans = [(e["start_ms"], e["end_ms"]) for e in events if e["lane"] == lane]
        busy = sum(b - a for a, b in spans)
        out[f"busy_ms_{lane.replace(' ', '_')}"] = busy
        if lane != "compute" and busy > 0:
            hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in comp)
            out[f"overlapped_pct_{lane.replace(' ', '_')}"] = 100 * hidden / busy
    return out


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


def _summary(args, runs: dict) -> dict:
    """The headline keys, each from its own kind of run and absent where no run is of that kind: the best policy
    with uncompressed weights (4-bit KV allowed: KV compression is a policy field, FlexGen's §5), the best with
    4-bit weights (`_int4`), the best with 4-bit KV and uncompressed weights (`_kv4`), the best with no compression
    at all (`_nocompress`); `flexgen_best_policy_any` is the fastest run of all."""
    kinds = {"": lambda p: not p["compress_weights"],
             "_int4": lambda p: p["compress_weights"],
             "_kv4": lambda p: p["compress_cache"] and not p["compress_weights"],
             "_nocompress": lambda p: not (p["compress_weights"] or p["compress_cache"])}
    tag = f"{args.shape.replace('-', '')}_{args.gpu_memory_gb:g}gb"
    summary = {"flexgen_best_policy_any": max(runs, key=lambda k: runs[k]["out_tok_s"])}
    for suffix, pick in kinds.items():
        group = [k for k, v in runs.items() if pick(v["policy"])]
        if group:
            best = max(group, key=lambda k: runs[k]["out_tok_s"])
            summary.update({f"flexgen_out_tok_s_{tag}{suffix}": runs[best]["out_tok_s"],
                            f"flexgen_best_policy{suffix}": best})
    if "flexgen_best_policy" in summary:
        summary["flexgen_best_extrapolated"] = bool(runs[summary["flexgen_best_policy"]].get("extrapolated", False))
    return summary


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


def _baseline_summary(runs: dict, base: dict, summary: dict, data: dict) -> None:
    """The baselines' keys, and FlexGen's best over each. `flexgen_vs_rowbyrow` is over the pinned baseline: the
    zig-zag runs load their host weights from pinned memory too, so the two differ only in the schedule
    (docs/design.md 11); `_numpy` is over the pageable one (Accelerate's offload)."""
    if not base:
        return
    data["rowbyrow"] = base
    head = "pinned" if "pinned" in base else next(iter(base))
    summary["flexgen_rowbyrow_basis"] = head
    summary["flexgen_rowbyrow_batch"] = base[head]["policy"]["gpu_batch_size"]
    summary["flexgen_rowbyrow_extrapolated"] = bool(base[head].get("extrapolated", False))
    summary["flexgen_rowbyrow_out_tok_s"] = base[head]["out_tok_s"]
    for mem, r in base.items():
        summary[f"flexgen_rowbyrow_out_tok_s_{mem}"] = r["out_tok_s"]
        if "predicted_err_pct" in r:           # the cost model's serial sum for the baseline (not in the mean error)
            summary[f"cost_model_rowbyrow_err_pct_{mem}"] = r["predicted_err_pct"]
    if runs and "flexgen_best_policy" in summary:
        best = runs[summary["flexgen_best_policy"]]
        summary["flexgen_vs_rowbyrow"] = best["out_tok_s"] / base[head]["out_tok_s"]
        for mem, r in base.items():
            summary[f"flexgen_vs_rowbyrow_{mem}"] = best["out_tok_s"] / r["out_tok_s"]
    for kind in ("int4", "kv4", "nocompress"):          # each kind of FlexGen run over the same (uncompressed) baseline
        if f"flexgen_best_policy_{kind}" in summary:
            summary[f"flexgen_vs_rowbyrow_{kind}"] = (runs[summary[f"flexgen_best_policy_{kind}"]]["out_tok_s"]
                                                      / base[head]["out_tok_s"])


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


def _finish(args, summary: dict, data: dict) -> None:
    """The GPU's peak memory, the table, the result file."""
    stats = {}
    if not args.merge_only:
        import jax
        stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:                      # what the engine really took of the GPU, all runs
        summary["flexgen_gpu_peak_gb"] = stats["peak_bytes_in_use"] / 1e9
    rows = {**data.get("runs", {}), **{f"row-by-row {m}": r for m, r in data.get("rowbyrow", {}).items()}}
    print_table(["policy", "block", "out tok/s", "predicted", "s", "prefill pass s", "decode pass s",
                 "weights gpu/cpu/disk MB"],
                [[k + (" *" if v.get("extrapolated") else ""), v["block"], v["out_tok_s"], v.get("predicted_tok_s", ""),
                  v["seconds"], v.get("prefill_pass_s") or "", v.get("decode_pass_mean_s") or "",
                  "/".join(f"{x / 1e6:.1f}" for x in v["weight_bytes"].values())]
                 for k, v in rows.items()])
    if any(v.get("extrapolated") for v in rows.values()):
        print(f"* extrapolated to {data.get('gen_len')} tokens a sequence: the measured setup + prefill pass + "
              "(gen-len - 1) x the mean measured decode pass (each pass's times in the JSON, `pass_s`)", flush=True)
    write_results(args.name, summary, data, args.out_dir)


def _merge(paths: str, runs: dict) -> dict:
    """Runs of earlier parts' result files added to `runs` (this invocation's win on a name clash); returns their
    LP and CPU-attention records and their baselines (`rowbyrow`: host memory kind -> run)."""
    out: dict = {}
    for _, data in merged_parts(paths, "bench.flexgen"):
        for k, v in data.get("runs", {}).items():
            runs.setdefault(k, v)
        for k in ("lp", "cpu_attention_ab"):
            if isinstance(data.get(k), dict):
                out.setdefault(k, data[k])
        base = data.get("rowbyrow")
        if isinstance(base, dict) and "policy" in base:            # an older file: one baseline run
            base = {base["policy"].get("host_memory", "pinned"): base}
        for mem, r in (base or {}).items():
            out.setdefault("rowbyrow", {}).setdefault(mem, r)
    return out


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
