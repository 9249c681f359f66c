"""The scheduling API (DynaFlow style): a schedule is Python code over nano-ops, recorded into a `LayerSchedule`.

A strategy subclasses `Strategy` and implements `schedule(ctx)`, which calls
  * `split(sizes)`         once, to cut the step's T tokens into contiguous nano-batches (token order);
  * `get_ready_ops(i)`     the ops not yet run on nano-batch i whose inputs are ready (see `graph.py`);
  * `execute(ops, stream=None, kernel=None, share=None)`
        - one op on one nano-batch:           execute(nano_op)
        - one op on adjacent nano-batches:    execute([op@i, op@i+1])      (merged: one call on their tokens)
        - several ops by a fused kernel:      execute([a@i, b@i], kernel=k)
        - ops of different nano-batches side by side in one kernel (horizontal fusion, `k.horizontal`):
                                              execute([a@i, b@j], kernel=k)
      `stream` k >= 1 records the op on NanoFlow stream k (0 / None: stream 0), an order interleaved with the
      others; the engine issues everything on one GPU stream (GPU streams: nfjax/experimental/streams.py).
      `share` is the fraction of the GPU the op's kernel may take (its CTA count), read by kernels that
      support it.

Nothing runs while `schedule` runs: `record(ctx)` records the calls into a `LayerSchedule` (validated: every op on
every token exactly once, in dependency order), and the executor traces that layer schedule into the layer
programs. Recording is pure Python on static sizes, so it is cheap and testable without compiling anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from nfjax.errors import UserError
from nfjax.models.ops import GLOBAL_VALUES, Resource
from nfjax.schedule.graph import MAIN_STREAM_ONLY, OpGraph, OpNode


class ScheduleError(UserError):
    """A schedule that cannot run: names the op, nano-batch or argument at fault."""


@dataclass(frozen=True)
class ScheduleContext:
    """What a schedule may look at: static facts of the layer programs being built."""
    num_tokens: int               # the token bucket T
    graph: OpGraph
    tp: int = 1                   # tensor-parallel degree (network ops are identities at 1)


@dataclass(frozen=True)
class NanoBatch:
    index: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class NanoOp:
    """One op bound to one nano-batch."""
    node: OpNode
    nb: int

    @property
    def name(self) -> str:
        return self.node.name

    def __repr__(self) -> str:
        return f"{self.name}@{self.nb}"


@dataclass(frozen=True)
class Kernel:
    """A fused kernel standing in for several ops: `fn(layer, ctx, *ins) -> outs` (a tuple if several).
    `horizontal`: the ops run side by side, each on its own nano-batches with its own ins/outs (ins/outs here
    unused); then `fn(layer, ctxs, ins_per_op, parts) -> outs_per_op`, one entry per op of `replaces` in order
    (`parts`: the ops' own steps, whose `fn` a kernel may fall back to)."""
    name: str
    replaces: tuple[str, ...]
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    fn: Callable
    horizontal: bool = False


@dataclass(frozen=True)
class Step:
    """One recorded `execute`: ops (one unless fused) on the merged tokens [start, stop) of nano-batches nbs."""
    ops: tuple[str, ...]
    nbs: tuple[int, ...]
    start: int
    stop: int
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    fn: Callable                  # fn(layer, ctx, *ins) -> outs
    resource: Resource
    stream: int | None = None
    kernel: str | None = None
    share: float | None = None
    parts: tuple["Step", ...] = ()   # a horizontal kernel: one step per op (its tokens, ins, outs, share)

    def __repr__(self) -> str:
        if self.parts:
            return f"{self.kernel}(" + " + ".join(map(repr, self.parts)) + ")"
        what = self.kernel or self.ops[0]
        nbs = ",".join(map(str, self.nbs))
        extra = "" if not self.stream else f" stream={self.stream}"
        extra += "" if self.share is None else f" share={self.share:g}"
        return f"{what}@{nbs}[{self.start}:{self.stop}]{extra}"

    @property
    def pieces(self) -> tuple["Step", ...]:
        """The steps whose token ranges, ins and outs are real: the parts of a horizontal kernel, else itself."""
        return self.parts or (self,)


@dataclass(frozen=True)
class LayerSchedule:
    """A validated schedule for one token bucket: what the executor traces."""
    strategy: str
    num_tokens: int
    nano_batches: tuple[NanoBatch, ...]
    steps: tuple[Step, ...]
    buffered: frozenset[str] = field(default_factory=frozenset)   # values some step reads joined from pieces
    carry_ranges: tuple[tuple[int, int], ...] = ()    # the token ranges the layer output is written in

    @property
    def order(self) -> list[str]:
        return [repr(s) for s in self.steps]


class _Trace:
    def __init__(self, ctx: ScheduleContext):
        self.ctx = ctx
        self.nbs: tuple[NanoBatch, ...] | None = None
        self.done: set[tuple[str, int]] = set()
        self.steps: list[Step] = []


class Strategy:
    """Base class of every strategy. Subclasses set `kind` (their `StrategyConfig.kind`) and `name` (a default
    label), implement `schedule(ctx)` and, to be built from a config, `from_config(sc)`."""
    kind = ""
    name = "strategy"
    splits = False        # does it cut the batch (then XLA's dot merger is turned off for it ...)
    dot_merger = False    # ... unless this is set

    def eligible(self, ctx: ScheduleContext) -> str | None:
        """None if the strategy can run on this bucket, else why not (then the bucket compiles without it)."""
        return None

    def schedule(self, ctx: ScheduleContext) -> None:
        raise NotImplementedError

    @classmethod
    def from_config(cls, sc) -> "Strategy":
        """The strategy a `nfjax.config.StrategyConfig` describes, labelled `sc.label`."""
        raise NotImplementedError(f"{cls.__name__} is not built from a StrategyConfig")

    # ---- recording ------------------------------------------------------------------------------------
    def record(self, ctx: ScheduleContext) -> LayerSchedule:
        why = self.eligible(ctx)
        if why:
            raise ScheduleError(f"{self.name}: cannot run on a {ctx.num_tokens}-token bucket: {why}")
        self._trace = _Trace(ctx)
        try:
            self.schedule(ctx)
            tr = self._trace
            if tr.nbs is None:
                raise ScheduleError(f"{self.name}: schedule() executed nothing")
            missing = [f"{n.name}@{b.index}" for b in tr.nbs for n in ctx.graph if (n.name, b.index) not in tr.done]
            if missing:
                raise ScheduleError(f"{self.name}: schedule() ended with ops never executed: "
                                    f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
            return LayerSchedule(self.name, ctx.num_tokens, tr.nbs, tuple(tr.steps), _buffered(ctx, tr.steps),
                           _carry_ranges(ctx, tr.steps))
        finally:
            self._trace = None

    @property
    def _tr(self) -> _Trace:
        tr = getattr(self, "_trace", None)
        if tr is None:
            raise ScheduleError("split/get_ready_ops/execute are only valid inside schedule(), run by record()")
        return tr

    # ---- the API schedules call -----------------------------------------------------------------------
    def split(self, sizes: Sequence[int]) -> tuple[NanoBatch, ...]:
        tr = self._tr
        if tr.nbs is not None:
            raise ScheduleError(f"{self.name}: split() was already called (merge nano-batches instead)")
        sizes = [int(s) for s in sizes]
        t = tr.ctx.num_tokens
        if not sizes or any(s <= 0 for s in sizes) or sum(sizes) != t:
            raise ScheduleError(f"{self.name}: split sizes {sizes} must be positive and sum to the bucket's {t} "
                                "tokens")
        out, lo = [], 0
        for i, s in enumerate(sizes):
            out.append(NanoBatch(i, lo, lo + s))
            lo += s
        tr.nbs = tuple(out)
        return tr.nbs

    @property
    def nano_batches(self) -> tuple[NanoBatch, ...]:
        tr = self._tr
        if tr.nbs is None:
            self.split([tr.ctx.num_tokens])
        return tr.nbs

    def nano_op(self, name: str, i: int) -> NanoOp:
        """Op `name` bound to nano-batch i, ready or not (for fused kernels and plans)."""
        if not 0 <= i < len(self.nano_batches):
            raise ScheduleError(f"{self.name}: no nano-batch {i} (there are {len(self.nano_batches)})")
        try:
            return NanoOp(self._tr.ctx.graph[name], i)
        except KeyError as e:
            raise ScheduleError(f"{self.name}: {e.args[0]}") from None

    def _deps_met(self, nop: NanoOp, done: set[tuple[str, int]]) -> str | None:
        for v, prod in nop.node.deps:
            if prod is None:
                continue
            need = range(len(self._tr.nbs)) if v in GLOBAL_VALUES else (nop.nb,)
            for j in need:
                if (prod, j) not in done:
                    return f"{prod}@{j}"
        return None

    def get_ready_ops(self, i: int) -> list[NanoOp]:
        self.nano_batches                       # no split() yet: one nano-batch
        tr = self._tr
        out = []
        for node in tr.ctx.graph:
            nop = NanoOp(node, i)
            if (node.name, i) not in tr.done and self._deps_met(nop, tr.done) is None:
                out.append(nop)
        return out

    def is_done(self, name: str, i: int) -> bool:
        return (name, i) in self._tr.done

    def is_ready(self, ops: NanoOp | Iterable[NanoOp]) -> bool:
        """Could `execute(ops)` run now (as a merge or a fused group)?"""
        ops = [ops] if isinstance(ops, NanoOp) else list(ops)
        done = self._tr.done | {(o.name, o.nb) for o in ops}
        return all((o.name, o.nb) not in self._tr.done and self._deps_met(o, done) is None for o in ops)

    def execute(self, ops: NanoOp | Iterable[NanoOp], stream: int | None = None, kernel: Kernel | None = None,
                share: float | None = None, shares: Sequence[float | None] | None = None) -> None:
        """`shares`: per op of a horizontal kernel (in `kernel.replaces` order), instead of `share`."""
        tr = self._tr
        ops = [ops] if isinstance(ops, NanoOp) else list(ops)
        if not ops:
            raise ScheduleError(f"{self.name}: execute() got no ops")
        if kernel is not None and kernel.horizontal:
            self._execute_horizontal(ops, kernel, stream, shares or [share] * len(kernel.replaces))
            return
        nbs = sorted({o.nb for o in ops})
        names = sorted({o.name for o in ops}, key=lambda n: tr.ctx.graph[n].index)
        where = f"{self.name}: execute({ops})"
        if nbs != list(range(nbs[0], nbs[-1] + 1)):
            raise ScheduleError(f"{where}: merged nano-batches must be adjacent, got {nbs}")
        if len(ops) != len(nbs) * len(names) or len({(o.name, o.nb) for o in ops}) != len(ops):
            raise ScheduleError(f"{where}: every op must run on every merged nano-batch exactly once")
        if kernel is None and len(names) > 1:
            raise ScheduleError(f"{where}: several different ops need kernel= (a fused kernel replacing them)")
        if kernel is not None and set(kernel.replaces) != set(names):
            raise ScheduleError(f"{where}: kernel {kernel.name!r} replaces {list(kernel.replaces)}, not {names}")
        for o in ops:
            if (o.name, o.nb) in tr.done:
                raise ScheduleError(f"{where}: {o!r} was already executed")
        done = tr.done | {(o.name, o.nb) for o in ops}
        for o in ops:
            waits = self._deps_met(o, done)
            if waits:
                raise ScheduleError(f"{where}: {o!r} is not ready: it waits for {waits}")
        nodes = [tr.ctx.graph[n] for n in names]
        if stream not in (None, 0):
            if not isinstance(stream, int) or stream < 0:
                raise ScheduleError(f"{where}: stream must be an int >= 0, got {stream!r}")
            bad = [n.name for n in nodes if n.main_stream_only]
            if bad:
                raise ScheduleError(f"{where}: {bad[0]} must stay on the main stream ({MAIN_STREAM_ONLY})")
        if share is not None and not 0 < share <= 1:
            raise ScheduleError(f"{where}: share must be in (0, 1], got {share}")
        b = self.nano_batches
        lo, hi = b[nbs[0]].start, b[nbs[-1]].stop
        if kernel is None:
            spec = nodes[0].spec
            step = Step((spec.name,), tuple(nbs), lo, hi, spec.ins, spec.outs, spec.fn, spec.resource,
                        stream or None, None, share)
        else:
            res = max((n.resource for n in nodes), key=lambda r: r is Resource.NETWORK)
            step = Step(tuple(names), tuple(nbs), lo, hi, tuple(kernel.ins), tuple(kernel.outs), kernel.fn, res,
                        stream or None, kernel.name, share)
        tr.done |= {(o.name, o.nb) for o in ops}
        tr.steps.append(step)


    def _execute_horizontal(self, ops: list[NanoOp], kernel: Kernel, stream, shares) -> None:
        """Record the side-by-side ops as one step with a part per op (each part checked like execute())."""
        tr = self._tr
        where = f"{self.name}: execute({ops}, kernel={kernel.name})"
        names = [o.name for o in ops]
        if set(names) != set(kernel.replaces):
            raise ScheduleError(f"{where}: kernel {kernel.name!r} runs {list(kernel.replaces)} side by side")
        if stream not in (None, 0):
            raise ScheduleError(f"{where}: a horizontal kernel shares out the SMs itself; it runs on stream 0")
        if len(shares) != len(kernel.replaces):
            raise ScheduleError(f"{where}: shares needs one entry per op of the kernel")
        for name in kernel.replaces:         # side by side: each must be ready without the others
            mine = [o for o in ops if o.name == name]
            if not self.is_ready(mine):
                raise ScheduleError(f"{where}: {mine} is not ready before the kernel runs (the ops of a "
                                    "horizontal kernel run at the same time)")
        parts = []
        for name, share in zip(kernel.replaces, shares):
            mine = [o for o in ops if o.name == name]
            before = len(tr.steps)
            self.execute(mine, share=share)      # validates and records the part as a plain step ...
            parts.append(tr.steps.pop())         # ... which the combined step then holds
            assert len(tr.steps) == before
        res = max((p.resource for p in parts), key=lambda r: r is Resource.NETWORK)
        tr.steps.append(Step(tuple(kernel.replaces), tuple(sorted({b for p in parts for b in p.nbs})),
                             min(p.start for p in parts), max(p.stop for p in parts),
                             tuple(dict.fromkeys(v for p in parts for v in p.ins)),
                             tuple(dict.fromkeys(v for p in parts for v in p.outs)), kernel.fn, res, None,
                             kernel.name, None, tuple(parts)))


def _carry_ranges(ctx: ScheduleContext, steps: Sequence[Step]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted((p.start, p.stop) for s in steps for p in s.pieces if ctx.graph.output in p.outs))


def _buffered(ctx: ScheduleContext, steps: Sequence[Step]) -> frozenset[str]:
    """Values some step reads across the boundary of pieces written by different steps (a merge: the
    executor joins those pieces into one array)."""
    t = ctx.num_tokens
    pieces: dict[str, list[tuple[int, int]]] = {v: [(0, t)] for v in ctx.graph.inputs}
    pieces[ctx.graph.inputs[0]] = list(_carry_ranges(ctx, steps))   # the residual stream, carried in pieces
    out: set[str] = set()

    def covered(v, lo, hi):
        return any(a <= lo and hi <= b for a, b in pieces.get(v, ()))

    for s in (p for st in steps for p in st.pieces):
        for v in s.ins:
            if v not in GLOBAL_VALUES and not covered(v, s.start, s.stop):
                out.add(v)
        for v in s.outs:
            if v not in GLOBAL_VALUES:
                pieces.setdefault(v, []).append((s.start, s.stop))
    return frozenset(out)
