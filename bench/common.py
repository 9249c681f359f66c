"""Shared bench helpers: timing, the two device ceilings (copy bandwidth, bf16 GEMM rate), tables, plots and
the result JSON every bench script writes.

Each bench writes `<dir>/<name>-<YYYYMMDD>.json` holding the command, device, date, a flat `summary` of
headline figures and the full numbers. <dir> is bench/results unless `out_dir` (or the BENCH_RESULTS_DIR
variable) names another (a device call writes under its own output folder; copy the files back here).
Imports only jax, numpy and (for plots) matplotlib, all on the GPU image.
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def module_command(module: str, *args: str) -> list[str]:
    """`python -m <module> <args>` with this interpreter: a bench's child process (itself again, a peer). It
    inherits the working directory, the repository root that the parent was run from."""
    return [sys.executable, "-m", module, *args]


def parse_choices(spec: str, allowed: Sequence[str], flag: str) -> list[str]:
    """A comma-separated flag value as its entries, each one of `allowed` (else a SystemExit naming the flag)."""
    picked = [x for x in spec.split(",") if x]
    for x in picked:
        if x not in allowed:
            raise SystemExit(f"{flag}: unknown {x!r}; choose from {', '.join(allowed)}")
    return picked


def device_name() -> str:
    import jax
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def device_info() -> dict:
    import jax
    d = jax.devices()[0]
    return {"name": device_name(), "count": jax.device_count(), "backend": jax.default_backend(),
            "num_sms": getattr(d, "core_count", None), "jax": jax.__version__, "python": sys.version.split()[0]}


def block(x):
    import jax
    return jax.block_until_ready(x)


def time_fn(fn: Callable, *args, iters: int = 20, reps: int = 5, warmup: int = 2,
            arg_sets: Sequence[tuple] | None = None) -> dict:
    """Median seconds per call of `fn`, from `reps` batches of `iters` back-to-back asynchronous calls
    (one sync per batch, so host dispatch overlaps device work). `arg_sets` rotates inputs between calls
    (defeats L2 reuse); otherwise every call gets `args`. Returns median/min/max seconds per call."""
    sets = list(arg_sets) if arg_sets else [args]
    for i in range(warmup):
        block(fn(*sets[i % len(sets)]))
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for i in range(iters):
            out = fn(*sets[i % len(sets)])
        block(out)
        per.append((time.perf_counter() - t0) / iters)
    return {"median_s": statistics.median(per), "min_s": min(per), "max_s": max(per), "iters": iters,
            "reps": reps}


def median_run(runs: list[dict]) -> dict:
    """Repeats of one light-load measurement: the median run by `tpot_ms`, with the median of the runs' `ttft_ms`
    (those that have one) and every run's TPOT and TTFT kept. bench/latency.py and its vLLM peer report this."""
    mid = sorted(runs, key=lambda r: r["tpot_ms"])[len(runs) // 2]
    ttfts = [r["ttft_ms"] for r in runs if r["ttft_ms"] is not None]
    return {**mid, "ttft_ms": statistics.median(ttfts) if ttfts else None,
            "tpot_ms_repeats": [r["tpot_ms"] for r in runs], "ttft_ms_repeats": [r["ttft_ms"] for r in runs]}


def best_seconds(fn: Callable, reps: int = 5) -> float:
    """The fastest of `reps` single calls of `fn` after one warm-up call (`time_fn` one call a sample), seconds:
    for probes whose calls synchronize themselves (a transfer waited for, a host copy)."""
    return time_fn(fn, iters=1, reps=reps, warmup=1)["min_s"]


def measure_copy_bandwidth(nbytes: int = 2 << 30, **kw) -> dict:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written (random uint32 data,
    two buffers rotated)."""
    import jax
    import jax.numpy as jnp
    n = nbytes // 4
    xs = [jax.random.bits(jax.random.key(i), (n,), jnp.uint32) for i in range(2)]
    f = jax.jit(lambda x: x ^ jnp.uint32(0x9E3779B9))     # one read + one write per element; not elidable
    t = time_fn(f, arg_sets=[(x,) for x in xs], **kw)
    del xs
    return {"bytes_per_s": 2 * nbytes / t["median_s"], "bytes": nbytes, **t}


def measure_gemm_tflops(n: int = 8192, dtype: str = "bfloat16", **kw) -> float:
    """Measured n x n x n matmul rate (TFLOP/s) on random data, f32 accumulation."""
    return measure_gemm(n, dtype, **kw)["tflops"]


def measure_gemm(n: int = 8192, dtype: str = "bfloat16", **kw) -> dict:
    import jax
    import jax.numpy as jnp
    dt = jnp.dtype(dtype)
    a = [jax.random.normal(jax.random.key(i), (n, n), dt) for i in range(2)]
    b = [jax.random.normal(jax.random.key(10 + i), (n, n), dt) for i in range(2)]
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dt))
    kw.setdefault("iters", 10)
    t = time_fn(f, arg_sets=[(a[0], b[0]), (a[1], b[1])], **kw)
    return {"tflops": 2 * n ** 3 / t["median_s"] / 1e12, "n": n, "dtype": dtype, **t}


class GcLog:
    """Wall-clock spans of the collections Python runs, by generation."""

    def __init__(self):
        self.spans: list[tuple[float, float, int]] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.spans.append((self._t0, time.perf_counter(), info.get("generation", -1)))

    def within(self, a: float, b: float) -> list[dict]:
        return [{"gen": g, "ms": (e - s) * 1e3} for s, e, g in self.spans if s >= a and e <= b]


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def print_table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    """Plain fixed-width table (also returned as a string)."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [title] if title else []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def result_path(name: str, out_dir: str | None = None, date: datetime.date | None = None) -> str:
    d = out_dir or os.environ.get("BENCH_RESULTS_DIR") or RESULTS_DIR
    date = date or datetime.datetime.now(datetime.timezone.utc).date()
    return os.path.join(d, f"{name}-{date:%Y%m%d}.json")


def write_results(name: str, summary: dict, data: dict, out_dir: str | None = None) -> str:
    """Write the result JSON (command, device, date, flat summary, full data); returns its path."""
    bad = [k for k, v in summary.items() if isinstance(v, (dict, list))]
    if bad:
        raise ValueError(f"summary must be flat; nested values under {bad}")
    now = datetime.datetime.now(datetime.timezone.utc)
    path = result_path(name, out_dir, now.date())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        dev = device_info()
    except Exception as e:  # noqa: BLE001 - results still get written
        dev = {"error": repr(e)}
    env = {k: os.environ[k] for k in ("XLA_FLAGS",) if os.environ.get(k)}     # part of the command when set
    doc = {"name": name, "command": " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()),
                                              *(shlex.quote(a) for a in [sys.executable, *sys.argv])]),
           "device": dev, "date": now.isoformat(timespec="seconds"), "summary": summary, "data": data}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=_json_default)
    print(f"wrote {path}", flush=True)
    return path


def merged_parts(paths: str, bench: str) -> list[tuple[str, dict]]:
    """(path, data) of each result JSON in the comma-separated `paths` (a `--merge` flag: earlier parts of a
    run split over device commands); a file that is not one exits naming it and `bench`."""
    out = []
    for path in [p.strip() for p in paths.split(",") if p.strip()]:
        try:
            out.append((path, json.load(open(path))["data"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--merge {path}: not a {bench} result ({e!r})") from None
    return out


def _json_default(o):
    try:
        import numpy as np
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    return repr(o)


def save_plot(path: str, panels: Sequence[dict]) -> str | None:
    """One PNG with a subplot per panel: {"title", "xlabel", "ylabel", "series": {label: (xs, ys)},
    optional "hlines": {label: y}, "logx": bool}. Returns the path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, p in zip(axes[0], panels):
        for label, (xs, ys) in p["series"].items():
            ax.plot(xs, ys, marker="o", label=label)
        for label, y in p.get("hlines", {}).items():
            ax.axhline(y, linestyle="--", color="gray")
            ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
        if p.get("logx"):
            ax.set_xscale("log", base=2)
        ax.set_title(p.get("title", ""))
        ax.set_xlabel(p.get("xlabel", ""))
        ax.set_ylabel(p.get("ylabel", ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return path
