"""A timeline of offloaded generation, measured: when each transfer and each layer computation really ended.

Transfers are timed in the I/O thread that runs them, from its start to the moment the data has landed (the
loads wait until their device arrays are ready; the stores until the host copy is written). Computations are
timed by a watcher thread that waits on each dispatched program's outputs in dispatch order: a computation ends
when its outputs are ready and starts when it was dispatched or when the previous one ended, whichever is later
(one device stream runs them in order). So the picture shows what overlapped on the machine, not what the host
queued.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import jax

LANES = ("compute", "load weights", "load cache", "store cache", "load act", "store act", "cpu attention")


@dataclass(frozen=True)
class Event:
    lane: str
    label: str
    start: float
    end: float


class Trace:
    def __init__(self):
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._last_end = 0.0
        self.error: Exception | None = None      # the first program the watcher failed to wait on
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="nfjax-offload-trace")
        self._watcher.start()
        self.t0 = time.perf_counter()

    def add(self, lane: str, label: str, start: float, end: float) -> None:
        with self._lock:
            self.events.append(Event(lane, label, start - self.t0, end - self.t0))

    def timed(self, lane: str, label: str, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        self.add(lane, label, t, time.perf_counter())
        return out

    def computed(self, label: str, outputs) -> None:
        """A program was just dispatched with these outputs."""
        self._q.put((label, outputs, time.perf_counter()))

    def _watch(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            label, outputs, dispatched = item
            try:
                _wait(outputs)
            except Exception as e:   # noqa: BLE001 - raised by flush(); the watcher goes on, so flush returns
                self.error = self.error or e
            end = time.perf_counter()
            self.add("compute", label, max(dispatched, self._last_end), end)
            self._last_end = end
            self._q.task_done()

    def flush(self) -> None:
        """Wait until every dispatched computation has been timed; raise what a program raised."""
        self._q.join()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._q.put(None)

    def busy(self, lane: str) -> float:
        return sum(e.end - e.start for e in self.events if e.lane == lane)

    def to_json(self) -> list[dict]:
        return [dict(lane=e.lane, label=e.label, start_ms=e.start * 1e3, end_ms=e.end * 1e3)
                for e in sorted(self.events, key=lambda e: e.start)]


def _wait(outputs) -> None:
    """Wait for each output. An output a later program consumed (a donated cache) has been deleted: its
    program ran before that consumer, so it counts as ended when the watcher reaches it."""
    for leaf in jax.tree_util.tree_leaves(outputs):
        if not hasattr(leaf, "block_until_ready"):
            continue
        deleted = getattr(leaf, "is_deleted", lambda: False)
        if not deleted():
            try:
                leaf.block_until_ready()
            except Exception:        # noqa: BLE001 - deleted between the check and the wait
                if not deleted():
                    raise


def plot(events: list[dict], path, title: str = "", window: tuple[float, float] | None = None) -> str | None:
    """A Gantt chart of `Trace.to_json()` events (ms), one row per lane, written to `path`; None (nothing written)
    without matplotlib (the `bench` extra), as bench/common.py's plots."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None

    lanes = [ln for ln in LANES if any(e["lane"] == ln for e in events)]
    colors = dict(zip(LANES, ("tab:green", "tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:brown",
                                "tab:olive")))
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(lanes) + 1.5))
    for i, ln in enumerate(lanes):
        spans = [(e["start_ms"], e["end_ms"] - e["start_ms"]) for e in events if e["lane"] == ln
                 and (window is None or (e["end_ms"] >= window[0] and e["start_ms"] <= window[1]))]
        ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=colors[ln])
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes)
    ax.invert_yaxis()
    if window:
        ax.set_xlim(*window)
    ax.set_xlabel("ms")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
