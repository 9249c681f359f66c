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
and at a resource share s < 1 that time times the op's slowdown at s (time alone on the share / whole-GPU time at
the same size), measured at the share profile's size and at each pair row's sizes, interpolated over log size.
Anchoring on the size keeps a pair's parts at what the profile measured them at (run 4: gate/up at 1792 tokens
took 0.542 ms in the share-taking kernel on all SMs and 0.626 in the token profile; run 5: decode attention on a
quarter of the SMs 1.77x its whole-GPU time at 256 decodes, 1.48x at 128). The token series are read through
floor.py (host-bound points, noise against larger sizes, `host_floor`).
Two ops in one horizontal kernel take the longer part at its share plus kappa x the shorter one, kappa the
interference the profile measured ((fused - longer part alone) / shorter part alone, < 0 where the fused kernel
beat its longer part alone) at the nearest profiled sizes, read over the share and over the parts' balance, the
larger of the two; a pair of a shape the profile did not measure gets kappa 1 (the parts in turn). Joining a
value's pieces for a merged reader costs its bytes read and written at the profiled copy rate, unless the reader
is an XLA fusion that reads the pieces in place (the profile's `join_free` ops); a split GEMM reading a merged
value pays the same for its rows (`slice_copy`, XLA copies a GEMM operand's rows).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from nfjax.autosearch.floor import corrected


SHAPE_TOL = 1.25            # a pair whose shape is within this factor of a profiled pair's is read from the rows


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


def interp(xs, ys, x: float, least: float = 0.0) -> float:
    """Piecewise linear through (xs, ys) (xs increasing), linear past either end, never below `least`."""
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(least, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


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
        self.slice_copy = frozenset(profile["slice_copy"] if "slice_copy" in profile else slice_copy_ops(profile))
        self._curves: dict = {}

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

    def slowdown(self, op: str, share: float, size: float | None = None) -> float:
        """Time at `share` over the op's whole-GPU time at the same size (1 for ops without a share profile).
        Measured alone on a share at several sizes: the share profile's size and the sizes of the pair rows (each
        part alone on its share); between them interpolated over log size, clamped to the profiled sizes. Why the
        size: run 5's decode attention on a quarter of the SMs took 1.77x its whole-GPU time at 256 decodes and
        1.48x at 128, and the 256-decode ratio put the 1024-token hand-tuned pair at 0.488 ms against its measured
        0.427. Where no size is readable, over the share profile's own time at 1."""
        if share >= 1.0 or not self.shares.get(op):
            return 1.0
        curves = self._share_curves(op)
        if not curves:
            s = self.shares[op]
            full = interp(s["share"], s["ms"], 1.0)
            return interp(s["share"], s["ms"], share) / full if full > 0 else 1.0
        zs = sorted(curves)
        vals = [interp(*curves[z], share) for z in zs]
        if len(zs) == 1:
            return vals[0]
        size = size if size is not None else (self._share_size(op) or zs[0])
        x = min(max(math.log(max(size, 1.0)), math.log(zs[0])), math.log(zs[-1]))
        return interp([math.log(z) for z in zs], vals, x)

    def _share_size(self, op: str) -> float | None:
        at = (self.shares.get(op) or {}).get("at") or {}
        return at.get("tokens", at.get("size"))

    def _share_curves(self, op: str) -> dict:
        """size -> (shares, slowdowns) of `op` measured alone on a share: the share profile and the pair rows."""
        if op in self._curves:
            return self._curves[op]
        pts: dict = {}
        s = self.shares[op]
        z = self._share_size(op)
        full = self._at_ms(op, s.get("at") or {})
        if z and full:
            for sh, ms in zip(s["share"], s["ms"]):
                pts.setdefault(float(z), {})[float(sh)] = ms / full
        for r in self.pairs:
            for w, (o, size) in enumerate(zip(r["ops"], r["sizes"])):
                if o != op or not size:
                    continue
                sh = float(r["share"]) if w == 0 else round(1.0 - float(r["share"]), 9)
                full = self._at_ms(op, {"tokens": size} if self.kind(op) == "tokens" else
                                   {"size": size, "ctx": (s.get("at") or {}).get("ctx")})
                ms = r["a_ms"] if w == 0 else r["b_ms"]
                if full and ms > 0:
                    pts.setdefault(float(size), {}).setdefault(sh, ms / full)
        out = {}
        for z, d in pts.items():
            d.setdefault(1.0, 1.0)
            xs = sorted(d)
            out[z] = (xs, [d[x] for x in xs])
        self._curves[op] = out
        return out

    def _at_ms(self, op: str, at: dict) -> float | None:
        k = self.kind(op)
        if k == "tokens" and "tokens" in at:
            t = self.tokens[op]
            return interp(t["tokens"], t["ms"], at["tokens"])
        if k == "decode" and "size" in at:
            return self._decode_ms(at["size"], at.get("ctx"))
        return None

    def op_ms(self, op: str, lo: int, hi: int, share: float = 1.0) -> float:
        if share >= 1.0:
            return self.full_ms(op, lo, hi)
        size = self.batch.decodes_in(lo, hi) if self.kind(op) == "decode" else hi - lo
        return self.full_ms(op, lo, hi) * self.slowdown(op, share, size)

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
        """The share of the shorter part that running side by side does not hide: (fused - longer) / shorter
        (< 0 where the fused kernel beat its longer part alone), from the profiled pairs of these ops nearest in
        size (log distance); 0 (a perfect overlap) when none was profiled, 1 (the parts in turn) for a pair of a
        shape the profile did not measure (`measured_shape`). A CPU, where the parts run in turn, measures 1.
        Read twice: over the first op's share, and, with `ratio` (first part's time / second's, as the pair will
        run), over the rows' ratio a_ms / b_ms, each clamped to the profiled range; the larger reading counts.
        Why both: the rows vary the share at one size, so share and balance move together and the rows cannot say
        which sets kappa. Read over the share alone, a 0.2 share balanced by smaller sizes kept the 0 that only
        the unbalanced row measured (run 4); read over the balance alone, moving tokens out of the pair lowered
        kappa: run 4's 320/1728 plan modelled 0.1% ahead of the hand-tuned 256/1792 and measured 1.1% behind, and
        on run 5 the search moved 128 decodes beside 768 tokens to 0.35 of the SMs, where the 128 x 896 row
        measured kappa 0.92 (the balance, just past that row's, read 0.22)."""
        rows = [r for r in self.pairs if tuple(r["ops"]) == tuple(ops)]
        if not rows:
            return 0.0
        if not self.measured_shape(rows, sizes):
            return 1.0

        def dist(r):
            return sum(abs(math.log((max(a, 1)) / max(b, 1))) for a, b in zip(r["sizes"], sizes))

        def k(r):
            lo, hi = sorted((r["a_ms"], r["b_ms"]))
            return max(-1.0, (r["fused_ms"] - hi) / lo) if lo > 0 else 0.0

        def read(pts, x):
            xs = sorted({p for p, _ in pts})
            ys = [sum(v for p, v in pts if p == q) / sum(1 for p, _ in pts if p == q) for q in xs]
            return interp(xs, ys, min(max(x, xs[0]), xs[-1]), -1.0)
        near = min(dist(r) for r in rows)
        rows = [r for r in rows if dist(r) == near]
        out = read([(float(r["share"]), k(r)) for r in rows], share)
        if ratio is not None and ratio > 0 and all(r["a_ms"] > 0 and r["b_ms"] > 0 for r in rows):
            out = max(out, read([(math.log(r["a_ms"] / r["b_ms"]), k(r)) for r in rows], math.log(ratio)))
        return out

    @staticmethod
    def measured_shape(rows, sizes) -> bool:
        """Whether a pair of these sizes has the shape (second size over first) of a profiled pair, within a factor
        SHAPE_TOL. An overlap of another shape is not credited (kappa 1: the parts in turn) until the profile
        measures one. Run 5 measured the pair at 256 decodes beside 1792 tokens and at 128 beside 896 (7 tokens a
        decode both); with kappa read from those rows over the balance alone, the search moved its plans to 256
        decodes beside 896 tokens (3.5) at 2048 and 128 beside 640 (5) at 1024, where nothing was measured. Along a measured shape the rows carry
        over between sizes: run 4's 256 x 1792 rows modelled the 1024-token hand-tuned pair (128 x 896) within
        2% of its measured step."""
        a, b = sizes
        if a <= 0 or b <= 0:
            return False
        shapes = {math.log(max(r["sizes"][1], 1) / max(r["sizes"][0], 1)) for r in rows}
        return any(abs(math.log(b / a) - x) <= math.log(SHAPE_TOL) + 1e-9 for x in shapes)

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

    # ---- merges and slices ---------------------------------------------------------------------------------
    def merge_ms(self, value: str, tokens: int, reader: str | None = None) -> float:
        """Joining `tokens` rows of `value` from pieces for `reader`: its bytes read and written once, or nothing
        when the reader is one of the profile's `join_free` ops (XLA fusions that read the pieces where they
        are: the `_mact` plan's activation did, where the down projection's GEMM needed a copy;
        docs/design.md section 5)."""
        if not self.copy_rate or reader in self.join_free:
            return 0.0
        return 2.0 * self.value_bytes.get(value, 0.0) * tokens / self.copy_rate

    def slice_ms(self, value: str, tokens: int, reader: str) -> float:
        """A nano-batch of `reader` reading its `tokens` rows of a `value` written whole: its bytes read and
        written once when the reader is one of the GEMMs that XLA gives a copy of the rows (`slice_copy`), else
        nothing (XLA fusions and the attention kernels read the rows in place). Run 5's trace of its searched
        plan (down split 512/1536 after the merged activation) shows the two copies, 0.009 and 0.029 ms a layer,
        the act rows at ~3 TB/s; they are what made that plan measure 0.098 ms a layer slower than the
        hand-tuned one, which splits no GEMM after a merged op."""
        if not self.copy_rate or reader not in self.slice_copy:
            return 0.0
        return 2.0 * self.value_bytes.get(value, 0.0) * tokens / self.copy_rate


def slice_copy_ops(profile: dict) -> list[str]:
    """The ops that read a slice of a merged value through a copy, where the profile does not say
    (`slice_copy`): the GEMMs timed against token count (resource "compute" in the profile's graph)."""
    kernels = {(profile.get("decode") or {}).get("op"), (profile.get("prefill") or {}).get("op")}
    return [n["name"] for n in (profile.get("graph") or {}).get("ops", [])
            if n.get("resource") == "compute" and n["name"] in profile.get("tokens", {}) and n["name"] not in kernels]
