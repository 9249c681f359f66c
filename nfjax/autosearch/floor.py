"""Host-bound and noisy measurements in a profile, and the times the cost model reads in their place.

Token series are first read as non-decreasing (`monotone`: an op on fewer tokens takes at most what it took on
more) and subadditive (`subadditive`: at most the op on two smaller profiled sizes that add up), then for their
host-bound points as below.

The profiler times an op as `copies` of it in one program, called back to back; a call whose GPU work is shorter
than the host's dispatch of it measures the dispatch (floor / copies), whatever the op does. In run 4 on the H100
(bench/results/autosearch-run4-profile-20261124.json) every norm and the TP=1 no-op reduces took 0.012-0.036 ms
at 64 and at 2048 tokens alike, decode attention over no decode 0.047 ms, prefill attention over no prefill row
0.059 and over a 256-row chunk 0.052; the same launches in the step program's trace (run 4's timeline) took
0.003-0.015, 0.013 and 0.007 ms. Charged once per nano-op, those floors made every split pay about 0.1 ms a layer
that it does not pay, and ranked the hand-tuned plan behind Sequential at 1024 tokens (it measures 1.05x).

A measurement is host-bound when it is at most `HOST_BOUND` x its group's floor: the profile's `floor_ms`
({"tokens": ..., "kernels": ...}) where the profiler measured it, else estimated from the profile (kernels: the
least attention time, an empty launch; token ops: the median of the ops' least times). The model reads it as at
most `launch_ms` plus the work scaled from the series' smallest GPU-bound measurement (work: tokens, decode rows,
or the query x key pairs of a causal prefill chunk); a token op host-bound at every size as at most `launch_ms`
plus its bytes read and written at the profiled copy rate. `launch_ms` (default `LAUNCH_MS`) is what a launch
costs inside the step program. Prefill attention over no prefill row (`empty_ms`) is read as at most its least
chunk measurement, then as above: run 7 measured it at 0.191 ms against 0.049 for a 256-row chunk (runs 4-6:
0.043-0.059; run 6's step trace: 0.0024 ms), and every nano-batch and every chunk past the first paid it.
"""
from __future__ import annotations

import copy
import statistics

from nfjax.models.ops import GLOBAL_VALUES

HOST_BOUND = 2.0
LAUNCH_MS = 0.005          # an XLA fusion or an empty Pallas launch in the step program (run 4's trace: 0.003-0.013)


def floors(prof: dict) -> tuple[float, float]:
    """(token ops' floor, attention kernels' floor) in ms per op."""
    f = prof.get("floor_ms") or {}
    tok = f.get("tokens")
    if tok is None:
        mins = [min(t["ms"]) for t in prof["tokens"].values() if t["ms"]]
        tok = statistics.median(mins) if mins else 0.0
    ker = f.get("kernels")
    if ker is None:
        vals = [v for row in (prof.get("decode") or {}).get("ms", []) for v in row]
        vals += [v for row in (prof.get("prefill") or {}).get("ms", []) for v in row]
        if prof.get("prefill"):
            vals.append(prof["prefill"]["empty_ms"])
        ker = min(vals) if vals else 0.0
    return float(tok), float(ker)


def _fix(xs, ys, work, floor: float, launch: float, fallback=None) -> tuple[list[float], list]:
    """The series with each host-bound point replaced; and the points replaced (x, measured, read as)."""
    bound = [y <= HOST_BOUND * floor for y in ys]
    gpu = [(x, y) for x, y, b in zip(xs, ys, bound) if not b and work(x) > 0]
    out, changed = [], []
    for x, y, b in zip(xs, ys, bound):
        if not b:
            out.append(float(y))
            continue
        if gpu:
            x1, y1 = min(gpu, key=lambda p: work(p[0]))
            est = launch + max(0.0, y1 - launch) * work(x) / work(x1)
        elif fallback is not None:
            est = launch + fallback(x)
        else:
            est = y
        v = min(float(y), est)
        out.append(v)
        if v < y:
            changed.append((x, float(y), round(v, 6)))
    return out, changed


def monotone(ys) -> list[float]:
    """Each time at most the time of every larger size (the least from the right): an op on fewer tokens does a
    part of the work of more tokens, so a smaller size measured slower than a larger one measured noise. Run 5
    (H100): attn_norm 0.0378 ms at 1024 tokens against 0.0218 at 1536 and 0.022 at 2048; rope_append 0.0579 at
    384 against 0.0217 at 1536."""
    out, least = [], float("inf")
    for y in reversed(ys):
        least = min(least, float(y))
        out.append(least)
    return out[::-1]


def subadditive(xs, ys) -> list[float]:
    """Each time at most the sum of two profiled smaller sizes that add up to it (the op on n tokens can run as
    the op on a and on n - a tokens). Run 5 (H100): the down projection measured 0.3459 ms at 2048 tokens against
    0.2388 + 0.0839 at 1536 and 512; in a step the merged 2048-token GEMM took 0.293-0.300 ms and the two
    halves 0.228 + 0.079, so the 2048 point was what made splitting the down projection model cheaper than it runs."""
    out = [float(y) for y in ys]
    at = {x: i for i, x in enumerate(xs)}
    for i, n in enumerate(xs):
        for j in range(i):
            k = at.get(n - xs[j])
            if k is not None and k < i:
                out[i] = min(out[i], out[j] + out[k])
    return out


def op_bytes(prof: dict, op: str) -> float:
    """Bytes per token `op` reads and writes (the profile's graph and value sizes; 0 where it has neither)."""
    node = next((n for n in (prof.get("graph") or {}).get("ops", []) if n["name"] == op), None)
    if node is None:
        return 0.0
    vb = prof.get("value_bytes") or {}
    return sum(vb.get(v, 0.0) for v in [*node["ins"], *node["outs"]] if v not in GLOBAL_VALUES)


def corrected(prof: dict) -> tuple[dict, dict]:
    """A copy of the profile with its host-bound times replaced, and what was replaced ({series: [(x, was, now)]})."""
    p = copy.deepcopy(prof)
    tok_f, ker_f = floors(prof)
    launch = float(prof.get("launch_ms", LAUNCH_MS))
    rate = float(prof.get("copy_bytes_per_ms") or 0.0)
    report = {}
    for op, t in p["tokens"].items():
        b = op_bytes(prof, op)
        fb = (lambda n, b=b: b * n / rate) if b and rate else None
        raw = [float(y) for y in t["ms"]]
        t["ms"], _ = _fix(t["tokens"], subadditive(t["tokens"], monotone(raw)), float, tok_f, launch, fb)
        ch = [(x, y, round(v, 6)) for x, y, v in zip(t["tokens"], raw, t["ms"]) if v < y]
        if ch:
            report[op] = ch
    dec = p.get("decode")
    if dec:
        for i, row in enumerate(dec["ms"]):
            dec["ms"][i], ch = _fix(dec["decodes"], row, float, ker_f, launch)
            if ch:
                report[f"{dec['op']}@ctx{dec['ctx'][i]}"] = ch
    pf = p.get("prefill")
    if pf:
        for i, (row, s) in enumerate(zip(pf["ms"], pf.get("starts", [0]))):
            pf["ms"][i], ch = _fix(pf["chunks"], row, lambda n, s=s: n * s + n * n / 2, ker_f, launch)
            if ch:
                report[f"{pf['op']}@start{s}"] = ch
        empty = float(pf["empty_ms"])
        least = min((float(v) for row in prof["prefill"]["ms"] for v in row), default=empty)
        empty = min(empty, least)          # no prefill row does a part of any chunk's work (`monotone`)
        if launch < empty <= HOST_BOUND * ker_f:
            empty = launch
        if empty < pf["empty_ms"]:
            report[f"{pf['op']}@empty"] = [(0, pf["empty_ms"], round(empty, 6))]
            pf["empty_ms"] = empty
    return p, report
