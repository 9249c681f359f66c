"""Device time of jitted calls, read from a profiler trace (`jax.profiler.ProfileData`).

A wall clock around back-to-back calls measures the host's dispatch whenever that is longer than the GPU's work:
on the H200 machines' host a call costs ~0.3 ms, so a profile timed by the wall clock read every norm at ~0.02 ms
and the whole Sequential layer at 1.29 ms against 0.95 in a step (docs/design.md section 12). Here a call is read
two ways on the GPU: its busy time (the union of its kernels' intervals) and its span (first start to last end,
which also holds the idle gaps where the GPU waited for the host's next launch inside the call).
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


def split_calls(events: list[tuple[float, float]], calls: int) -> list[list[tuple[float, float]]]:
    """The events of `calls` calls run one after another, told apart at the `calls - 1` largest idle gaps."""
    if not events:
        return []
    calls = max(1, min(calls, len(events)))
    end, idle = events[0][1], []
    for i in range(1, len(events)):
        idle.append((events[i][0] - end, i))
        end = max(end, events[i][1])
    cuts = sorted(i for _, i in sorted(idle, reverse=True)[:calls - 1])
    return [events[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, len(events)])]


def call_spans_ns(events: list[tuple[float, float]], calls: int) -> list[float]:
    """Each call's span: its first kernel's start to its last one's end (idle gaps inside the call included)."""
    return [max(e for _, e in c) - c[0][0] for c in split_calls(events, calls)]


def call_busy_ns(events: list[tuple[float, float]], calls: int) -> list[float]:
    """Each call's busy time: the length of the union of its kernels' intervals (idle gaps left out, overlapping
    kernels counted once)."""
    out = []
    for c in split_calls(events, calls):
        busy, lo, hi = 0.0, c[0][0], c[0][1]
        for s, e in c[1:]:
            if s > hi:
                busy, lo, hi = busy + hi - lo, s, e
            else:
                hi = max(hi, e)
        out.append(busy + hi - lo)
    return out


def device_times(fn, calls: int = 5) -> tuple[float, float]:
    """(busy, span) of a call of `fn` on the GPU in ms, medians over `calls` calls, each awaited before the next
    (`call_busy_ns`, `call_spans_ns`). RuntimeError where the trace holds no GPU events (a CPU backend, a
    profiler failure)."""
    with tempfile.TemporaryDirectory(prefix="nfjax-device-time-") as root:    # a profile traces ~150 jobs
        pd = trace(fn, root, "t", calls=calls, sync_each=True)
    if isinstance(pd, str):
        raise RuntimeError(f"no device trace: {pd}")
    ev = stream_events(pd)
    if not ev:
        raise RuntimeError("no GPU events in the trace")
    return (statistics.median(call_busy_ns(ev, calls)) / 1e6, statistics.median(call_spans_ns(ev, calls)) / 1e6)
