"""One offload policy's timed run for bench/flexgen.py: place random weights (or reuse the last run's placement),
a warm-up block, the timed block with each pass's seconds; and the guard that skips a policy whose host tier would
not fit this machine's memory beside what earlier runs held."""
from __future__ import annotations

import time

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
