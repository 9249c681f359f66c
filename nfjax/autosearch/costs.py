"""The cost model the search optimizes: a profile read for one batch class.

A batch class is a dense step of `tokens` tokens laid out as the engine lays out a step: `decodes` decode tokens
first (each a sequence at context `ctx`), then the prefill tokens as `chunks` equal first chunks (positions from
0). A nano-op on the tokens [lo, hi) costs
  * an op timed against token count: its time at hi - lo tokens (piecewise linear between profiled counts,
    linear past the last two);
  * decode attention: its time at the decode rows inside [lo, hi), at the class's context;
  * prefill attention: for each prefill chunk's piece inside [lo, hi) (n rows continuing a sequence at position
    s), the profiled time of an n-row chunk at start s (bilinear between the profiled chunk lengths and starts);
    the pieces share one launch, so all but one drop the no-prefill-row time (`empty_ms`);
and at a resource share s < 1 the time the op measured alone at s on the share profile's size, scaled by the
op's whole-GPU time at the nano-op's size over its whole-GPU time at that size (ops without a share profile run only
at 1). Anchoring on the size, not on the share-taking kernel's own time at share 1, keeps a pair's parts at what
the profile measured them at: run 4's gate/up took 0.542 ms at 1792 tokens in the share-taking kernel on all SMs
and 0.626 in the token profile, so the ratio to share 1 put the part at 0.75 of the SMs at 0.751 ms against 0.650
measured, and the search shrank the prefill nano-batch to balance a pair that was not unbalanced (320/1728 tokens,
0.99x the hand-tuned 256/1792). Host-bound measurements are read as floor.py says (`host_floor`).
Two ops in one horizontal kernel take the longer part at its share plus kappa x the shorter one, kappa the
interference the profile measured ((fused - longer part alone) / shorter part alone, at the nearest profiled
sizes, interpolated over the share): 0 is a perfect overlap, 1 the parts in turn. Joining a value's pieces for a
merged reader costs its bytes read and written at the profiled copy rate, unless the reader is an XLA fusion
that reads the pieces in place (the profile's `join_free` ops).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from nfjax.autosearch.floor import corrected


@dataclass(frozen=True)
class BatchClass:
    tokens: int
    decodes: int
    ctx: int
    chunks: int = 2

    def __post_init__(self):
        if not 0 <= self.decodes <= self.tokens or self.tokens <= 0 or self.chunks < 1:
            raise ValueError(f"batch class {self}: need 0 <= decodes <= tokens, tokens > 0, chunks >= 1")

    def prefill_chunks(self) -> list[tuple[int, int]]:
        """The prefill chunks as token ranges [a, b) of the step (each starting at position 0)."""
        p = self.tokens - self.decodes
        if p <= 0:
            return []
        n = min(self.chunks, p)
        cuts = [self.decodes + p * i // n for i in range(n + 1)]
        return list(zip(cuts, cuts[1:]))

    def decodes_in(self, lo: int, hi: int) -> int:
        return max(0, min(hi, self.decodes) - lo)

    def prefill_pieces(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(rows, start position) of every prefill chunk's piece inside the tokens [lo, hi)."""
        out = []
        for a, b in self.prefill_chunks():
            x, y = max(a, lo) - a, min(b, hi) - a           # positions inside the chunk
            if x < y:
                out.append((y - x, x))
        return out


def interp(xs, ys, x: float) -> float:
    """Piecewise linear through (xs, ys) (xs increasing), linear past either end, never below 0."""
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class CostModel:
    def __init__(self, profile: dict, batch: BatchClass, host_floor: bool = True):
        """`host_floor`: read the profile's host-bound measurements as floor.py says (False: as measured)."""
        self.batch = batch
        self.p = profile = corrected(profile)[0] if host_floor else profile
        self.tokens = profile["tokens"]
        self.decode = profile.get("decode") or {}
        self.prefill = profile.get("prefill") or {}
        self.shares = profile.get("shares") or {}
        self.pairs = profile.get("pairs") or []
        self.value_bytes = profile.get("value_bytes") or {}
        self.copy_rate = float(profile.get("copy_bytes_per_ms") or 0.0)
        self.join_free = frozenset(profile.get("join_free") or ())

    # ---- one op -----------------------------------------------------------------------------------------
    def kind(self, op: str) -> str:
        if op == self.decode.get("op"):
            return "decode"
        if op == self.prefill.get("op"):
            return "prefill"
        if op in self.tokens:
            return "tokens"
        raise KeyError(f"the profile has no times for op {op!r}")

    def full_ms(self, op: str, lo: int, hi: int) -> float:
        """`op` on the tokens [lo, hi) of the class, on the whole GPU."""
        k = self.kind(op)
        if k == "decode":
            return self._decode_ms(self.batch.decodes_in(lo, hi))
        if k == "prefill":
            return self._prefill_ms(self.batch.prefill_pieces(lo, hi))
        t = self.tokens[op]
        return interp(t["tokens"], t["ms"], hi - lo)

    def _decode_ms(self, d: int, ctx: int | None = None) -> float:
        dec = self.decode
        rows = [interp(dec["decodes"], row, d) for row in dec["ms"]]
        return interp(dec["ctx"], rows, self.batch.ctx if ctx is None else ctx)

    def _prefill_ms(self, pieces) -> float:
        pf = self.prefill
        empty = float(pf["empty_ms"])
        if not pieces:
            return empty
        starts = pf.get("starts", [0])
        t = 0.0
        for n, s in pieces:
            rows = [interp(pf["chunks"], row, n) for row in pf["ms"]]
            t += interp(starts, rows, s)
        return max(empty, t - empty * (len(pieces) - 1))

    def share_grid(self, op: str) -> tuple[float, ...]:
        s = self.shares.get(op)
        return tuple(sorted(float(x) for x in s["share"])) if s else (1.0,)

    def slowdown(self, op: str, share: float) -> float:
        """Time at `share` over the op's whole-GPU time at the share profile's size (1 for ops without a share
        profile; where the size is not readable, over the share profile's own time at 1)."""
        s = self.shares.get(op)
        if not s or share >= 1.0:
            return 1.0
        full = self._at_ms(op, s.get("at") or {})
        if full is None:
            full = interp(s["share"], s["ms"], 1.0)
        return interp(s["share"], s["ms"], share) / full if full > 0 else 1.0

    def _at_ms(self, op: str, at: dict) -> float | None:
        k = self.kind(op)
        if k == "tokens" and "tokens" in at:
            t = self.tokens[op]
            return interp(t["tokens"], t["ms"], at["tokens"])
        if k == "decode" and "size" in at:
            return self._decode_ms(at["size"], at.get("ctx"))
        return None

    def op_ms(self, op: str, lo: int, hi: int, share: float = 1.0) -> float:
        return self.full_ms(op, lo, hi) * self.slowdown(op, share)

    def measured_sequential_ms(self) -> float | None:
        """The whole layer as Sequential runs it, measured (the profile's `layer` table, bilinear over step tokens
        x decodes) where the class is inside the table, at its context and chunk count; else None. Why: Sequential
        compiles with XLA's dot merger on and fuses across ops, which no op alone measures; run 4 summed its ops
        to 2.14 ms a 2048-token layer (1.16 at 1024) against 1.97 (1.06) a measured step / 32, while the split
        plans, which compile with the merger off, modelled within 2% of theirs."""
        lay, b = self.p.get("layer"), self.batch
        if not lay or lay.get("ctx") != b.ctx or lay.get("chunks", 2) != b.chunks:
            return None
        ts, ds = lay["tokens"], lay["decodes"]
        if not (ts[0] <= b.tokens <= ts[-1] and ds[0] <= b.decodes <= ds[-1]):
            return None
        rows = [interp(ds, row, b.decodes) for row in lay["ms"]]
        return interp(ts, rows, b.tokens)

    # ---- horizontal kernels -------------------------------------------------------------------------------
    def kappa(self, ops: tuple[str, ...], sizes: tuple[float, ...], share: float, ratio: float | None = None) -> float:
        """The share of the shorter part that running side by side does not hide: (fused - longer) / shorter, from
        the profiled pairs of these ops nearest in size (log distance); 0 (a perfect overlap) when none was
        profiled. A CPU, where the parts run in turn, measures 1. With `ratio` (first part's time / second's, as
        the pair will run), interpolated over the rows' ratio a_ms / b_ms (clamped to the profiled range), else
        over the first op's share. Why the ratio: the rows vary the share at one size, so share and balance move
        together, and it is the balance that sets kappa (run 4: 0 with the decode part 1.37x the gate/up part,
        0.18 at 1.11x, 0.36 at 0.78x, 0.48 at 0.65x; the longer decode part hides the GEMM, the GEMM does not hide
        the decodes' memory traffic); read over the share, a 0.2 share balanced by smaller sizes kept the 0 that
        only the unbalanced row measured."""
        rows = [r for r in self.pairs if tuple(r["ops"]) == tuple(ops)]
        if not rows:
            return 0.0

        def dist(r):
            return sum(abs(math.log((max(a, 1)) / max(b, 1))) for a, b in zip(r["sizes"], sizes))

        def k(r):
            lo, hi = sorted((r["a_ms"], r["b_ms"]))
            return max(0.0, (r["fused_ms"] - hi) / lo) if lo > 0 else 0.0
        near = min(dist(r) for r in rows)
        rows = [r for r in rows if dist(r) == near]
        if ratio is not None and ratio > 0 and all(r["a_ms"] > 0 and r["b_ms"] > 0 for r in rows):
            pts = sorted((math.log(r["a_ms"] / r["b_ms"]), k(r)) for r in rows)
            x = min(max(math.log(ratio), pts[0][0]), pts[-1][0])
        else:
            pts = sorted((r["share"], k(r)) for r in rows)
            x = share
        return interp([s for s, _ in pts], [v for _, v in pts], x) if len(pts) > 1 else pts[0][1]

    def pair_sizes(self, a: str, ra: tuple[int, int], b: str, rb: tuple[int, int]) -> tuple[float, float]:
        """The sizes a pair row is matched on: decode rows for decode attention, else tokens."""
        def size(op, r):
            return self.batch.decodes_in(*r) if self.kind(op) == "decode" else r[1] - r[0]
        return size(a, ra), size(b, rb)

    def pair_ms(self, a: str, ra, b: str, rb, shares: tuple[float, float] | None) -> float:
        """Ops `a` on ra and `b` on rb side by side in one kernel; `shares` None: stage I's view, both on the
        whole GPU without interference."""
        if shares is None:
            return max(self.full_ms(a, *ra), self.full_ms(b, *rb))
        sa, sb = shares
        ta, tb = self.op_ms(a, *ra, sa), self.op_ms(b, *rb, sb)
        kap = self.kappa((a, b), self.pair_sizes(a, ra, b, rb), sa, ta / tb if tb > 0 else None)
        return max(ta, tb) + kap * min(ta, tb)

    # ---- merges -------------------------------------------------------------------------------------------
    def merge_ms(self, value: str, tokens: int, reader: str | None = None) -> float:
        """Joining `tokens` rows of `value` from pieces for `reader`: its bytes read and written once, or nothing
        when the reader is one of the profile's `join_free` ops (XLA fusions that read the pieces where they
        are: the `_mact` plan's activation did, where the down projection's GEMM needed a copy; NOTES s. 6)."""
        if not self.copy_rate or reader in self.join_free:
            return 0.0
        return 2.0 * self.value_bytes.get(value, 0.0) * tokens / self.copy_rate
