"""Device time of jitted calls, read from a profiler trace (`jax.profiler.ProfileData`).

A wall clock around back-to-back calls measures the host's dispatch whenever that is longer than the GPU's work:
on the H200 machines' host a call costs ~0.3 ms, so a profile timed by the wall clock read every norm at ~0.02 ms
and the whole Sequential layer at 1.29 ms against 0.95 in a step (bench/NOTES.md section 36). Here a call's time is
the span of its kernels on the GPU, first start to last end, gaps between its own launches included, the host's
waits before it not.
"""
from __future__ import annotations

import glob
import os
import shutil
import statistics
import tempfile


def trace(fn, root: str, name: str, calls: int = 3, sync_each: bool = False):
    """Run `fn` once, then `calls` times under the profiler (`sync_each`: waiting for each call's result before
    the next, so calls do not overlap on the GPU); returns the parsed ProfileData, or an error string."""
    import jax
    d = os.path.join(root, name)
    shutil.rmtree(d, ignore_errors=True)
    jax.block_until_ready(fn())
    try:
        with jax.profiler.trace(d):
            for _ in range(calls):
                r = fn()
                if sync_each:
                    jax.block_until_ready(r)
            jax.block_until_ready(r)
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return "no xplane.pb written"
        from jax.profiler import ProfileData
        return ProfileData.from_file(max(files, key=os.path.getmtime))
    except Exception as e:  # noqa: BLE001 - a profiler failure must not lose the caller's timings
        return repr(e)[:300]


def gpu_lines(pd):
    """(line name, [(name, start_ns, duration_ns, stats)]) for every non-empty line of every GPU plane."""
    out = []
    for plane in pd.planes:
        if "gpu" not in plane.name.lower():
            continue
        for line in plane.lines:
            evs = []
            for ev in line.events:
                try:
                    stats = {k: v for k, v in ev.stats}
                except Exception:  # noqa: BLE001 - stats are optional
                    stats = {}
                evs.append((ev.name, ev.start_ns, ev.duration_ns, stats))
            if evs:
                out.append((f"{plane.name}/{line.name}", evs))
    return out


def stream_events(pd) -> list[tuple[float, float]]:
    """(start_ns, end_ns) of every event on the GPU's stream lines (every GPU line where none is named a stream),
    in start order."""
    lines = gpu_lines(pd)
    streams = [evs for ln, evs in lines if "stream" in ln.lower()] or [evs for _, evs in lines]
    return sorted((float(s), float(s) + float(d)) for evs in streams for _, s, d, _ in evs)


def call_spans_ns(events: list[tuple[float, float]], calls: int) -> list[float]:
    """Each call's span (first start to last end) from the events of `calls` calls run one after another: the
    calls are told apart at the `calls - 1` largest idle gaps between events."""
    if not events:
        return []
    calls = max(1, min(calls, len(events)))
    end, idle = events[0][1], []
    for i in range(1, len(events)):
        idle.append((events[i][0] - end, i))
        end = max(end, events[i][1])
    cuts = sorted(i for _, i in sorted(idle, reverse=True)[:calls - 1])
    spans = []
    for lo, hi in zip([0, *cuts], [*cuts, len(events)]):
        spans.append(max(e for _, e in events[lo:hi]) - events[lo][0])
    return spans


def device_ms(fn, calls: int = 5) -> float:
    """The median over `calls` calls of `fn` (each awaited before the next) of its kernels' span on the GPU, in
    ms. RuntimeError where the trace holds no GPU events (a CPU backend, a profiler failure)."""
    pd = trace(fn, tempfile.mkdtemp(prefix="nfjax-device-ms-"), "t", calls=calls, sync_each=True)
    if isinstance(pd, str):
        raise RuntimeError(f"no device trace: {pd}")
    spans = call_spans_ns(stream_events(pd), calls)
    if not spans:
        raise RuntimeError("no GPU events in the trace")
    return statistics.median(spans) / 1e6
