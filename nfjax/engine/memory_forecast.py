"""The KV pages the running requests will hold, step by step until the last one finishes, and their peak.

Admission (nfjax/engine/batcher.py) lets a request in when the peak of this forecast, with the request added, fits
the pool. Every running request grows by one position a step until its predicted end and then frees all its pages;
so the pages in use rise between two finishes and fall at each, and the peak is at one of the steps just before a
finish. Counting every request at its predicted end at once (NanoFlow's prediction as first built here) is the
same bound only when all requests end together: with ShareGPT-like lengths it kept ~40% of the pool idle.
Pages are counted exactly with prefix sums over the requests sorted by remaining steps: ceil((a + L) / ps) splits
into a's and L's quotients plus a carry that is 1 where a's remainder reaches ps - L's, and the carries are counted
from a cumulative table of remainders, O(n * page_size) a check. (A bound of a page a request, as first built, is
~1% of a pool of 1,536-token requests: enough to leave the last few of a 1024/512 run to a second wave.)
"""
from __future__ import annotations

import numpy as np
from jaxtyping import Int


class MemoryForecast:
    """Running requests as (positions now, steps left); `peak_with` asks whether one more fits."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._now: list[int] = []      # positions each request holds (or will once its prompt is in)
        self._left: list[int] = []     # steps until its predicted end (>= 1)

    def add(self, positions: int, final: int) -> None:
        """A request holding `positions` now that is predicted to end at `final` positions."""
        self._now.append(positions)
        self._left.append(max(final - positions, 1))

    def peak(self) -> float:
        return self._peak(np.asarray(self._now, np.int64), np.asarray(self._left, np.int64))

    def peak_with(self, positions: int, final: int) -> float:
        """The peak if one more request (`positions` now, ending at `final`) joined."""
        return self._peak(np.asarray(self._now + [positions], np.int64),
                          np.asarray(self._left + [max(final - positions, 1)], np.int64))

    def _peak(self, now: Int[np.ndarray, "R"], left: Int[np.ndarray, "R"]) -> float:
        if now.size == 0:
            return 0.0
        order = np.argsort(-left, kind="stable")
        return float(np.max(self._pages(now[order], left[order])))

    def _pages(self, now: Int[np.ndarray, "R"], left: Int[np.ndarray, "R"]) -> Int[np.ndarray, "R"]:
        """Pages held just before each request finishes, the requests sorted by steps left (most first): just
        before request k finishes (left[k] - 1 steps from now), request r <= k holds now[r] + left[k] positions,
        ceil((now[r] + left[k]) / ps) pages = q[r] + left[k] // ps + (rem[r] >= ps - left[k] % ps)."""
        ps = self.page_size
        alive = np.arange(1, now.size + 1)               # requests alive just before the k-th finishes
        q, rem = np.divmod(now + ps - 1, ps)
        reach = np.cumsum(rem[:, None] >= np.arange(ps + 1)[None, :], axis=0)    # [R, ps+1]: r <= k, rem >= j
        carries = reach[np.arange(now.size), ps - left % ps]
        return np.cumsum(q) + alive * (left // ps) + carries
