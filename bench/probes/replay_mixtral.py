"""Mixtral-8x7B on one H200 with fp8 KV: a step-time model for bench/probes/batcher_replay.py (`--model mixtral`).

Fitted to the runs of bench/NOTES.md section 26. The replay forms those runs' steps exactly (the engine's warm-up of
8 prompts, whose pages the prefix cache keeps, and tokens landing a step late: `batcher_replay.run_steps`): 1,096 /
1,060 / 1,158 steps, every kind's count and the padding equal to the measured. A step's GPU time:
  LIN_MS[bucket]          everything but attention (the expert reads below 1k tokens, the GEMMs above), fitted by
                          bucket; a bucket no run had is interpolated linearly (past 8,192: extrapolated), a guess;
  + TILE_MS an extra tile decode steps (buckets <= 512): an expert whose rows pass the grouped GEMM's 128-row
                          tile reads its weights again, and padding rows (token 0) all route to the same two
                          experts, so a bucket padded by ~100 rows costs ~2 tiles (`extra_tiles`);
  + decode attention      ATTN_MS_PER_MTOK a million KV tokens read (fp8, 69,632 bytes a token);
  + prefill attention     QK/PV flops at PREFILL_TFLOPS, and CHUNK_MS a prefill chunk (the 8B's; not identifiable).
A step's measured GPU time is read from bench/offline.py's trace as its wait + the next step's host time + the
run's mean time from a read to the next step (the host runs a step ahead: a step's `mean_ms - wait_ms`, what
`batcher_replay --measured` prints, is its predecessor's time; see `measured_own`); summed they equal the runs'
seconds. Fits (`FITS`, `--fit` of batcher_replay): "runs" (every run but tiles64, whose decode GEMMs differ),
"default-runs" (the default-bucket runs and profile_step only; 384, 1,024, 4,096 interpolated: the out-of-sample
check) and "no-tiles" (no padding term). Machines differ by ~4.5% on one schedule (66.2-69.2 s), so the model
reads a run within ~2.5%, and compares policies on one machine, not a machine's %.

    python -m bench.probes.replay_mixtral            # the three fits, each run against them
    python -m bench.probes.batcher_replay --model mixtral --measured bench/results/offline-mixtral-budget-20261128.json
    python -m bench.probes.batcher_replay --model mixtral --variants "now=;b8192=--buckets \\
        16,32,64,128,160,192,256,384,512,1024,2048,8192 --prefill-bucket 0;pf=--prefill-first"
"""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import numpy as np

from nfjax.config import BatcherConfig, ModelConfig
from nfjax.engine.batcher import Batcher
from nfjax.engine.memory_forecast import MemoryForecast
from nfjax.engine.request import Status

MIXTRAL = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, max_position_embeddings=32768, dtype="bfloat16",
                      model_type="mixtral", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336)
KV_BYTES = 69632                    # fp8 K+V with scales, all layers, a token
NUM_PAGES = 36017                   # the pool with CUDA's stream-ordered allocator (25,866 with JAX's BFC pool)
OPTIMAL_TOK_S = 26970.0             # 695 TFLOP/s / (2 x 12.88e9): the mean ceiling of the fitted runs' machines
BUCKETS = (16, 32, 64, 128, 256, 384, 512, 1024, 2048)
PREFILL_BUCKET = 8192
# fitted (`fit`, all runs but tiles64); ms
LIN_MS = {16: 29.6, 32: 30.3, 64: 31.6, 128: 33.3, 256: 32.9, 384: 34.7, 512: 35.2, 1024: 62.9, 2048: 107.8,
          4096: 198.2, 8192: 343.0}
TILE_MS = 2.2
ATTN_MS_PER_MTOK = 22.21            # 3.1 TB/s: ~0.75 of the copy rate
NO_TILES_LIN = {16: 27.3, 32: 30.2, 64: 31.6, 128: 33.3, 256: 35.1, 384: 36.1, 512: 39.6, 1024: 62.9, 2048: 107.8,
                4096: 198.2, 8192: 343.0}
NO_TILES_ATTN = ATTN_MS_PER_MTOK
CHUNK_MS = 0.6
PREFILL_TFLOPS = 400.0
TILE, EXPERTS, TOP_K = 128, 8, 2

RESULTS = Path(__file__).parents[1] / "results"
RUNS = {  # label: (file, engine, fitted?) -- tiles64 ran 64-row tiles at <= 1,024 tokens: its decodes differ
    "async": ("offline-mixtral-fp8-async-20261128.json", "engine", True),
    "budget-b2048": ("offline-mixtral-budget-20261128.json", "b2048", True),
    "budget-b4096": ("offline-mixtral-budget-20261128.json", "b4096", True),
    "tiles64": ("offline-mixtral-tiles64-20261128.json", "engine", False),
    "bfc-25866": ("offline-mixtral-fp8-20261128.json", "engine", True),
    "b4096-662": ("offline-mixtral-fp8-async-b4096-20261128.json", "engine", True),
}


def _binom(n: int, p: float) -> np.ndarray:
    k = np.arange(n + 1)
    lg = np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in k])
    with np.errstate(divide="ignore"):
        return np.exp(lg + k * math.log(p) + (n - k) * (math.log1p(-p) if p < 1 else 0.0))


@lru_cache(maxsize=None)
def extra_tiles(tokens: int, pad: int) -> float:
    """Expected 128-row tiles of the grouped GEMMs beyond one an expert: `tokens` routed uniformly (top-2 of 8,
    random weights), `pad` padding rows added to two experts. Negative where an expert may get no row."""
    pm = _binom(tokens, TOP_K / EXPERTS)
    rows = np.arange(tokens + 1)
    other = float(np.sum(pm * np.ceil(rows / TILE)))
    padded = float(np.sum(pm * np.ceil((rows + pad) / TILE)))
    return (EXPERTS - 2) * other + 2 * padded - EXPERTS


def features(batch, pad_tiles: bool = True) -> tuple[int, float, float, float, int]:
    """(bucket, extra tiles, KV tokens the decodes read, prefill QK/PV pairs, prefill chunks). `pad_tiles` off:
    the padding rows as if routed to no expert."""
    nd = batch.num_decode
    kv = sum(s.start + 1 for s in batch.seqs[:nd])
    pre = sum(s.num_tokens * (s.start + s.num_tokens / 2) for s in batch.seqs[nd:])
    pad = batch.bucket - batch.num_tokens if pad_tiles else 0
    tiles = extra_tiles(batch.num_tokens, pad) if batch.bucket <= 512 else 0.0
    return batch.bucket, tiles, kv, pre, len(batch.seqs) - nd


def lin_ms(bucket: int, lin: dict = LIN_MS) -> float:
    """LIN at `bucket`: linear between the fitted buckets, and past the largest on the last two's slope."""
    xs = sorted(lin)
    if bucket > xs[-1]:
        return lin[xs[-1]] + (bucket - xs[-1]) * (lin[xs[-1]] - lin[xs[-2]]) / (xs[-1] - xs[-2])
    return float(np.interp(bucket, xs, [lin[x] for x in xs]))


PRE_MS = 4 * MIXTRAL.num_heads * MIXTRAL.head_dim * MIXTRAL.num_layers / (PREFILL_TFLOPS * 1e12) * 1e3


def step_ms(batch, lin: dict = LIN_MS, tile_ms: float = TILE_MS, attn: float = ATTN_MS_PER_MTOK,
            chunk_ms: float = CHUNK_MS, pad_tiles: bool = True) -> tuple[float, float]:
    """(modelled GPU ms of the step, of which decode attention)."""
    b, tiles, kv, pre, chunks = features(batch, pad_tiles)
    a = kv / 1e6 * attn
    return lin_ms(b, lin) + tile_ms * tiles + a + pre * PRE_MS + chunk_ms * chunks, a


def batcher_config(buckets=BUCKETS, max_seqs: int = 1024, max_prefill_seqs: int = 16,
                   prefill_bucket: int = PREFILL_BUCKET, predict: bool = True) -> BatcherConfig:
    return BatcherConfig(token_buckets=tuple(buckets), max_seqs=max_seqs, max_prefill_seqs=max_prefill_seqs,
                         prefill_bucket=prefill_bucket, predict_memory=predict)


def workload(num_requests: int = 512, spec: str = "1024x512"):
    from bench.workloads import parse
    return parse(spec, num_requests, MIXTRAL.vocab_size, seed=1)


def load(label: str) -> dict:
    f, eng, _ = RUNS[label]
    e = json.load(open(RESULTS / f))["data"]["engines"][eng]
    return {"buckets": tuple(e["buckets"]), "num_pages": e["num_pages"], "gemm": e["gemm_tflops"],
            "optimal": e["optimal_tok_s"], **e["results"]["1024x512"]}


class BoundForecast(MemoryForecast):
    """The forecast the measured runs (RUNS, 2026-11-28) admitted by: the peak bounded above by a page a request,
    before `MemoryForecast` counted pages exactly (~1% of their pools: a replay with the exact count forms other
    steps than they ran)."""

    def _pages(self, now, left):
        alive = np.arange(1, now.size + 1)
        return (np.cumsum(now) + alive * left + alive * (self.page_size - 1)) / self.page_size


class MeasuredBatcher(Batcher):
    """The Batcher as the measured runs had it (`BoundForecast`)."""
    FORECAST = BoundForecast


def schedule(run: dict) -> list[tuple[str, tuple]]:
    """The replay of a measured run's config: each step's (kind, features)."""
    from bench.probes.batcher_replay import replay
    out = []

    def record(batch):
        nd = batch.num_decode
        kind = ("decode+prefill" if nd < len(batch.seqs) and nd else "decode" if nd else "prefill") + \
            f"@{batch.bucket}"
        out.append((kind, features(batch)))
        return 1.0, 0.0
    replay(workload(), run["num_pages"], batcher_config(run["buckets"]), None, model=MIXTRAL, step_fn=record,
           warmup=8, lag=True, batcher_cls=MeasuredBatcher)
    return out


def measured_own(run: dict, kinds: list[str]) -> dict[str, float]:
    """Each kind's summed GPU ms from the trace, by the replay's step order `kinds` (which matches the run's).
    With the GPU the bottleneck, step N's tokens are read when it ends, after step N+1 was formed and launched:
    GPU(N) = wait(N) + host(N+1) + the time from the read of N-1 to the start of the engine's next step
    (processing tokens; not in the trace: the run's seconds less every step's wait + host, spread evenly)."""
    m = run["step_ms_by_kind"]
    gap = (run["seconds"] * 1e3 - sum(v["steps"] * (v["wait_ms"] + v["host_ms"]) for v in m.values())) / len(kinds)
    own: dict[str, float] = defaultdict(float)
    for i, k in enumerate(kinds):
        nxt = m[kinds[i + 1]]["host_ms"] if i + 1 < len(kinds) else 0.0
        own[k] += m[k]["wait_ms"] + nxt + (gap if i >= 2 else 0.0)
    return own


PROFILE = ("profile_step-mixtral-fp8-h200-20261128.json", 50)     # its synthetic steps, each weighted as 50 steps


def profile_points() -> list[tuple[tuple, float]]:
    """(features, GPU ms) of profile_step's synthetic steps (decodes at context 1,280; 2 first chunks)."""
    doc = json.load(open(RESULTS / PROFILE[0]))
    ctx, pts = doc["ctx"], []
    for name, b in doc["batches"].items():
        nd, n = b["decode"], b["tokens"]
        chunk = (n - nd) // 2
        pre = 2 * chunk * chunk / 2 if n > nd else 0.0
        tiles = extra_tiles(n, 0) if b["bucket"] <= 512 else 0.0
        pts.append(((b["bucket"], tiles, nd * (ctx + 1), pre, 2 if n > nd else 0), b["step_ms"]))
    return pts


def fit(labels: list[str], interpolate: tuple[int, ...] = (), tiles: bool = True, attn: float | None = None) -> dict:
    """Least squares over the runs' kinds (each weighted by its steps) and the profile's steps: LIN_MS by bucket,
    TILE_MS and ATTN_MS_PER_MTOK; CHUNK_MS and the prefill rate fixed. `interpolate`: buckets left out of the
    fit and set by linear interpolation between their neighbours (to test the model on a bucket it never saw).
    `tiles` off: no tile term; `attn`: ATTN_MS_PER_MTOK fixed at this."""
    buckets = sorted({b for lb in labels for b in load(lb)["buckets"]} | {PREFILL_BUCKET, 2048})
    fitted = [b for b in buckets if b not in interpolate]
    rows, ys, ws = [], [], []

    def add(f, ms, w, n=1):
        b, extra, kv, pre, ch = f
        x = np.zeros(len(fitted) + 2)
        if b in fitted:
            x[fitted.index(b)] = n
        else:                     # a bucket in `interpolate`: its weights on the neighbours
            lo, hi = max(x for x in fitted if x < b), min(x for x in fitted if x > b)
            x[fitted.index(lo)], x[fitted.index(hi)] = n * (hi - b) / (hi - lo), n * (b - lo) / (hi - lo)
        x[-2], x[-1] = extra if tiles else 0.0, kv / 1e6
        if attn is not None:
            ms, x[-1] = ms - attn * x[-1], 0.0
        rows.append(x / n)
        ys.append((ms - pre * PRE_MS - ch * CHUNK_MS) / n)
        ws.append(w)
    for lb in labels:
        run = load(lb)
        steps = schedule(run)
        own = measured_own(run, [k for k, _ in steps])
        agg: dict[str, list] = {}
        for k, f in steps:
            a = agg.setdefault(k, [np.zeros(5), 0])
            a[0][0] = f[0]
            a[0][1:] += np.array(f[1:])
            a[1] += 1
        for k, (f, n) in agg.items():
            add((int(f[0]), *f[1:]), own[k], n, n)
    for f, ms in profile_points():
        add(f, ms, PROFILE[1])
    X, y, w = np.array(rows), np.array(ys), np.sqrt(np.array(ws, float))
    cols = [j for j in range(X.shape[1]) if (tiles or j != X.shape[1] - 2) and (attn is None or j != X.shape[1] - 1)]
    sol = np.zeros(X.shape[1])
    sol[cols] = np.linalg.lstsq(X[:, cols] * w[:, None], y * w, rcond=None)[0]
    if attn is not None:
        sol[-1] = attn
    lin = {b: round(float(v), 1) for b, v in zip(fitted, sol)}
    for b in interpolate:
        lo, hi = max(x for x in fitted if x < b), min(x for x in fitted if x > b)
        lin[b] = round(lin[lo] + (lin[hi] - lin[lo]) * (b - lo) / (hi - lo), 1)
    return {"lin": dict(sorted(lin.items())), "tile_ms": round(float(sol[-2]), 2), "attn": round(float(sol[-1]), 2)}


def validate(model: dict, labels: list[str]) -> list[dict]:
    """Each run replayed: its steps by kind against the measured, and the modelled seconds against the run's."""
    rows = []
    for lb in labels:
        run = load(lb)
        steps = schedule(run)
        own = measured_own(run, [k for k, _ in steps])
        kinds: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for k, f in steps:
            b, tiles, kv, pre, ch = f
            t = lin_ms(b, model["lin"]) + model["tile_ms"] * tiles + model["attn"] * kv / 1e6 + pre * PRE_MS + \
                CHUNK_MS * ch
            kinds[k][0] += 1
            kinds[k][1] += t
        measured = {k: v["steps"] for k, v in run["step_ms_by_kind"].items()}
        rows.append({"run": lb, "steps": (len(steps), run["trace"]["steps"]),
                     "kind_steps_off": sum(abs(kinds[k][0] - measured.get(k, 0)) for k in set(kinds) | set(measured)),
                     "model_s": sum(v[1] for v in kinds.values()) / 1e3, "measured_s": run["seconds"],
                     "gemm": run["gemm"], "kinds": {k: (v[0], v[1] / v[0], own[k] / v[0]) for k, v in kinds.items()}})
    return rows


def print_validation(rows: list[dict], detail: bool = True) -> None:
    print(f"{'run':14s} {'steps (replay/measured)':>24s} {'kinds off':>9s} {'model s':>8s} {'measured s':>10s} "
          f"{'error':>7s} {'kind rms':>8s} {'GEMM TFLOP/s':>12s}")
    for r in rows:
        n = sum(v[0] for v in r["kinds"].values())
        rms = math.sqrt(sum(v[0] * (v[1] - v[2]) ** 2 for v in r["kinds"].values()) / n)
        print(f"{r['run']:14s} {r['steps'][0]:>11d} / {r['steps'][1]:<10d} {r['kind_steps_off']:9d} "
              f"{r['model_s']:8.2f} {r['measured_s']:10.2f} {100 * (r['model_s'] / r['measured_s'] - 1):+6.1f}% "
              f"{rms:6.1f}ms {r['gemm']:12.0f}")
        if detail:
            for k, (n, mod, meas) in sorted(r["kinds"].items(), key=lambda t: -t[1][0]):
                if n >= 5:
                    print(f"    {k:22s} {n:5d} steps  model {mod:6.1f} ms  measured {meas:6.1f} ms "
                          f"({100 * (mod / meas - 1):+5.1f}%)")


FITS = {  # name: (LIN_MS, TILE_MS, ATTN_MS_PER_MTOK); `fit` prints them
    "runs": (LIN_MS, TILE_MS, ATTN_MS_PER_MTOK),
    # the default-bucket runs and the profile only, 384 / 1,024 / 4,096 interpolated (the out-of-sample check)
    "default-runs": ({16: 32.0, 32: 29.9, 64: 31.0, 128: 32.3, 256: 29.8, 384: 28.6, 512: 27.4, 1024: 53.6,
                      2048: 106.1, 4096: 183.9, 8192: 339.5}, 4.69, 27.69),
    # every run, no tile term (padding costs as a real row)
    "no-tiles": (NO_TILES_LIN, 0.0, NO_TILES_ATTN),
}
SWAP_GB_S = 20.0          # a preempted request's KV to the host and back (a guess: no Mixtral run preempted)


def add_variant_args(vp: argparse.ArgumentParser) -> None:
    """Replay-only switches (not in the engine): `variant` reads them."""
    vp.add_argument("--prefill-first", action="store_true", help="a prefill-only step of the prefill bucket "
                    "whenever admissible prompts fill 3/4 of it, the decodes waiting that step (`prefill_first`)")
    vp.add_argument("--no-pad-tiles", action="store_true", help="padding rows routed to no expert (a model "
                    "change: no extra tile from padding)")
    vp.add_argument("--swap-gb-s", type=float, default=SWAP_GB_S, help="preemption copies' rate, each way")


def prefill_first(base: type[Batcher]) -> type[Batcher]:
    """`base` forming a prefill-only step of the prefill bucket while decodes run, when the prompts first in line
    (running prefills, then waiting requests the memory forecast admits beside every running request) fill at
    least (1 - SHORTEN_PAD) of it. The running decodes are hidden from that step's formation (they wait) but
    stay in the forecast."""
    class PrefillFirst(base):
        _hidden: list = []

        def _prefill_ready(self) -> bool:
            if not self.prefill_budget or self.swapped or all(r.in_prefill for r in self.running):
                return False
            need = (1 - self.SHORTEN_PAD) * self.prefill_budget
            tokens = sum(r.prompt_len - r.num_computed for r in self.running if r.in_prefill)
            f = self._forecast()
            for req in list(self.waiting)[:self.cfg.prefill_seqs_for(self.prefill_budget)]:
                if tokens >= need:
                    break
                if self.cfg.predict_memory and f.peak_with(*self._span(req)) > self.allocator.capacity:
                    break
                f.add(*self._span(req))
                tokens += req.prompt_len - self._cached_prefix(req)
            return tokens >= need

        def next_batch(self, prev_slots):
            if self._burst:
                self._order_burst()
            if not self._prefill_ready():
                return super().next_batch(prev_slots)
            keep = self.running
            self._hidden = [r for r in keep if not r.in_prefill]
            self.running = [r for r in keep if r.in_prefill]
            try:
                return super().next_batch(prev_slots)
            finally:
                self.running = [r for r in keep if r.status is Status.RUNNING] + \
                    [r for r in self.running if all(r is not k for k in keep)]
                self._hidden = []

        def _forecast(self):
            f = super()._forecast()
            for r in self._hidden:
                f.add(*self._span(r))
            return f

        def _fits_prediction(self, req, forecast=None):
            if self._hidden and not self.running and self.cfg.predict_memory:
                return self._forecast().peak_with(*self._span(req)) <= self.allocator.capacity
            return super()._fits_prediction(req, forecast)
    return PrefillFirst


def variant(cls: type[Batcher], f: argparse.Namespace, fit_name: str = "runs"):
    """(batcher class, step function) of a replay variant's flags under fit `fit_name`."""
    lin, tile, attn = FITS[fit_name]
    if f.prefill_first:
        cls = prefill_first(cls)

    def fn(batch):
        ms, a = step_ms(batch, lin, tile, attn, pad_tiles=not f.no_pad_tiles)
        moved = sum(len(pages) for _, pages in batch.swap_out) + sum(len(r.pages) for r in batch.swap_in)
        return ms + moved * 16 * KV_BYTES / (f.swap_gb_s * 1e9) * 1e3, a
    return cls, fn


def measured_own_file(path: str, spec: str, kinds: list[str]) -> dict[str, float]:
    """`measured_own` per step (mean by kind) of a bench/offline.py result's last engine with workload `spec`,
    when the replay's steps `kinds` have its counts (else {})."""
    doc = json.load(open(path))
    run = [e["results"][spec] for e in doc["data"]["engines"].values() if spec in e["results"]][-1]
    n = {k: v["steps"] for k, v in run["step_ms_by_kind"].items()}
    if {k: kinds.count(k) for k in set(kinds)} != n:
        return {}            # not the run's schedule: no step order to read its trace by
    return {k: v / n[k] for k, v in measured_own(run, kinds).items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--brief", action="store_true", help="one line a run")
    a = p.parse_args(argv)
    fitted = [lb for lb, (_, _, f) in RUNS.items() if f]
    default = ["async", "budget-b2048"]
    print("1) fitted on the default-bucket runs (36,017 pages) and the profile only; 384 (one step there), 1,024 "
          "and 4,096 interpolated")
    m1 = fit(default, interpolate=(384, 1024, 4096))
    print(f"   {m1}")
    print_validation(validate(m1, list(RUNS)), detail=not a.brief)
    print("\n2) fitted on every run but tiles64 (the model `--model mixtral` uses)")
    m2 = fit(fitted)
    print(f"   {m2}")
    print_validation(validate(m2, list(RUNS)), detail=not a.brief)
    print("\n3) as 2), no tile term (alone its attention comes out negative, so fixed at 2)'s)")
    m3 = fit(fitted, tiles=False, attn=m2["attn"])
    print(f"   {m3}")
    print_validation(validate(m3, list(RUNS)), detail=not a.brief)
    print(f"\n   in use (FITS): {FITS}")


if __name__ == "__main__":
    main()
