"""The op profiler: times every op of a layer's graph on its own, at the sizes and resource shares of a grid,
and the horizontal kernels' pairs (the interference table); returns a profile (nfjax/autosearch/profile.py).

Every measurement is one jitted program running an op (or fused kernel) on `copies` distinct sets of random
inputs of its real shapes (so the host's dispatch cost, more than a small op's kernel time on the H100's host, is
paid once per `copies` ops: with one op a program every small op measured 0.09 ms), lowered in turn and compiled
on a thread pool (XLA compiles outside the GIL), then timed one after another. On a GPU (`timing="device"`) a
call's time is its kernels' busy time in a profiler trace, median of `reps` calls (nfjax/device_trace.py; each
span beside it in `device_spans_ms`): the wall clock measured the H200 host's dispatch for every small op and for
the whole layer, and spans still held the host's launch gaps (docs/design.md section 12).
Elsewhere (`timing="wall"`): the median per op of `reps` batches of back-to-back calls (one sync per batch). An op that writes the KV cache donates it, chains it through
its copies and gets it back for the next call, so no call copies the cache. A share s runs the op's kernel on round(s x
SMs) CTAs (`LayerContext.num_ctas`); on a CPU shares change nothing and are not measured. The whole layer is
also timed as Sequential compiles it at the grid's step sizes (`layer_job`): the baseline the search compares with.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import datetime
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from nfjax.device_trace import device_times
from nfjax.models.ops import GLOBAL_VALUES, run_ops


TIMINGS = ("device", "wall")


@dataclass(frozen=True)
class Grid:
    tokens: tuple[int, ...]                 # token counts of the token-count ops
    decodes: tuple[int, ...] = ()           # decode attention: sequences ...
    ctxs: tuple[int, ...] = ()              # ... x contexts
    chunks: tuple[int, ...] = ()            # prefill attention: chunk lengths ...
    starts: tuple[int, ...] = (0,)          # ... x the position each chunk starts at
    shares: tuple[float, ...] = (1.0,)      # the first op of a pair (decode attention); the other gets the rest
    share_decodes: int = 0                  # the sizes the share and pair rows are measured at
    share_ctx: int = 0
    share_tokens: int = 0                   # the second op's tokens
    min_pair_tokens: int = 0                # smallest nano-batch the fused kernel's GEMM takes (its tile)
    pair_sizes: tuple[tuple[int, int], ...] = ()   # more (decodes, tokens) the pair rows are measured at
    layer_tokens: tuple[int, ...] = ()     # the whole layer as Sequential runs it, at these step sizes ...
    layer_decodes: tuple[int, ...] = ()    # ... x decode counts (at ctxs[0], prefill in 2 chunks)
    reps: int = 5
    target_ms: float = 20.0                 # per timed batch of calls
    copies: int = 1                         # ops per timed program: token-count ops (XLA fusions, GEMMs) ...
    kernel_copies: int = 1                  # ... and attention / share / pair measurements (Pallas kernels)


# token counts between the powers of two too: the search cuts nano-batches on 64-token multiples, where a GEMM's
# tiles and waves may make its time step (run 4's gate/up split 256/448/320 measured 0.955x Sequential, which the
# interpolation between powers of two modelled even); 1792 is the hand-tuned plan's prefill nano-batch
GPU_GRID = Grid(tokens=(64, 128, 256, 384, 512, 768, 1024, 1536, 1792, 2048), decodes=(0, 128, 256, 512),
                ctxs=(1280,), chunks=(256, 1024, 2048), starts=(0, 1024), shares=(0.2, 0.25, 0.3, 0.35, 1.0),
                share_decodes=256, share_ctx=1280, share_tokens=1792, min_pair_tokens=128, copies=8, kernel_copies=3,
                layer_tokens=(1024, 2048), layer_decodes=(128, 256), pair_sizes=((128, 896),))
CPU_GRID = Grid(tokens=(16, 32, 64, 128), decodes=(0, 4, 8, 16), ctxs=(64,), chunks=(16, 64, 128), starts=(0, 64),
                share_decodes=8, share_ctx=64, share_tokens=56, reps=3, target_ms=5.0)


def quick(grid: Grid) -> Grid:
    """A smaller grid of the same ranges (smoke runs)."""
    return dataclasses.replace(grid, tokens=tuple(sorted({*grid.tokens[::2], grid.tokens[-1]})),
                               decodes=grid.decodes[::2], chunks=grid.chunks[-2:], shares=grid.shares[1:2] + (1.0,),
                               reps=3)


def pages_needed(grid: Grid, page_size: int) -> int:
    """KV pages the largest case takes (every case lays its sequences out from page 1)."""
    per = lambda n: -(-n // page_size)                                   # noqa: E731
    return 2 + max(max(grid.decodes or (0,)) * per(max(grid.ctxs or (0,)) + 1),
                   per(max(grid.starts) + max(grid.chunks or (0,))), per(max(grid.tokens)))


class _Job:
    """One measurement: `fn(state, ctx_args, ins_list, glob)` runs the op once per entry of `ins_list` (`copies`
    distinct input sets, made just before timing so that only one job's copies live at a time)."""

    def __init__(self, key, fn, state, ctx_args, ins, glob=(), copies: int = 1, writes=False, merger=False):
        self.key, self.fn, self.copies, self.writes, self.merger = key, fn, copies, writes, merger
        self.state, self.ctx_args, self.ins, self.glob = state, ctx_args, ins, glob
        self.compiled = None
        self.error = None

    def lower(self):
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if x is not None else None, self.ins)
        return self.fn.lower(self.state, self.ctx_args, (spec,) * self.copies, self.glob)

    def args(self) -> list:
        """The inputs of a timed call: `copies` distinct copies of the op's inputs (XLA would merge identical
        computations on identical inputs: an optimization barrier did not stop it; the first device runs timed 8
        copies of a GEMM as one), the cache shared or, when the op writes it, its own copy."""
        ins = tuple(jax.tree.map(jnp.copy, self.ins) for _ in range(self.copies))
        glob = jax.tree.map(jnp.copy, self.glob) if self.writes else self.glob
        return [self.state, self.ctx_args, ins, glob]


def _op_fn(subject, spec, num_ctas):
    gd = nnx.graphdef(subject.layer)
    globs = [i for i, v in enumerate(spec.ins) if v in GLOBAL_VALUES]
    writes = [k for k, v in enumerate(spec.outs) if v in GLOBAL_VALUES and v in spec.ins]

    def f(state, ctx_args, ins_list, glob):
        """Every copy's outputs are returned (no DCE); a written global (the cache) is chained from copy to copy
        and returned once; one only read is not returned (the third device run returned it: a copy of the 2.8 GB
        cache in every attention measurement, 0.8 ms)."""
        layer, ctx = nnx.merge(gd, state), subject.make_ctx(ctx_args, num_ctas)
        outs = []
        for ins in ins_list:
            ins = list(ins)
            for i, g in zip(globs, glob):
                ins.insert(i, g)
            res = spec.fn(layer, ctx, *ins)
            res = tuple(res) if len(spec.outs) > 1 else (res,)
            if writes:
                glob = tuple(res[k] for k in writes)
            outs.append(tuple(r for k, r in enumerate(res) if k not in writes))
        return outs, (glob if writes else ())
    return f, bool(writes)


def op_job(subject, key, op: str, case, num_ctas=None, copies: int = 1) -> _Job:
    spec = subject.graph[op].spec
    f, writes = _op_fn(subject, spec, num_ctas)
    ins = tuple(case.env[v] for v in spec.ins if v not in GLOBAL_VALUES)
    glob = tuple(case.env[v] for v in spec.ins if v in GLOBAL_VALUES)
    return _Job(key, jax.jit(f, donate_argnums=(3,) if writes else ()), nnx.state(subject.layer), case.ctx_args,
                ins, glob, copies, writes)


def layer_job(subject, key, case) -> _Job:
    """The whole layer, every op once in order, compiled as the Sequential step compiles it (the dot merger on,
    XLA free to fuse across ops): the baseline a plan must beat. One copy a program: a layer is GPU-bound, and
    copies sharing the weights would have their GEMMs merged into one."""
    g = subject.graph
    gd, specs = nnx.graphdef(subject.layer), [n.spec for n in g]
    names = [v for v in g.inputs if v not in GLOBAL_VALUES]
    gnames = [v for v in g.inputs if v in GLOBAL_VALUES]

    def f(state, ctx_args, ins_list, glob):
        layer, ctx = nnx.merge(gd, state), subject.make_ctx(ctx_args, None)
        outs = []
        for ins in ins_list:
            env = run_ops(specs, layer, ctx, {**dict(zip(names, ins)), **dict(zip(gnames, glob))})
            glob = tuple(env[v] for v in gnames)
            outs.append(env[g.output])
        return outs, glob
    return _Job(key, jax.jit(f, donate_argnums=(3,)), nnx.state(subject.layer), case.ctx_args,
                tuple(case.env[v] for v in names), tuple(case.env[v] for v in gnames), 1, True, merger=True)


def pair_job(subject, key, kernel, case_a, case_b, ctas_a, copies: int = 1) -> _Job:
    from nfjax.schedule.api import Step
    gd = nnx.graphdef(subject.layer)
    specs = [subject.graph[op].spec for op in kernel.replaces]
    cases = [case_a, case_b]
    parts = tuple(Step((s.name,), (0,), 0, c.tokens, s.ins, s.outs, s.fn, s.resource) for s, c in zip(specs, cases))
    glob_at = [[i for i, v in enumerate(s.ins) if v in GLOBAL_VALUES] for s in specs]

    def f(state, ctx_args, ins_list, glob):
        layer = nnx.merge(gd, state)
        ctxs = [subject.make_ctx(ctx_args[0], ctas_a), subject.make_ctx(ctx_args[1], None)]
        outs = []
        for ins in ins_list:
            full = []
            for part, at, g in zip(ins, glob_at, glob):
                part = list(part)
                for i, x in zip(at, g):
                    part.insert(i, x)
                full.append(tuple(part))
            outs.append(kernel.fn(layer, ctxs, full, parts))
        return outs, ()
    ins = tuple(tuple(c.env[v] for v in s.ins if v not in GLOBAL_VALUES) for s, c in zip(specs, cases))
    glob = tuple(tuple(c.env[v] for v in s.ins if v in GLOBAL_VALUES) for s, c in zip(specs, cases))
    return _Job(key, jax.jit(f), nnx.state(subject.layer), (case_a.ctx_args, case_b.ctx_args), ins, glob, copies)


def floor_job(key, like: _Job) -> _Job:
    """`like`'s arguments into a program that computes nothing: its time per copy is the host's dispatch floor
    under `like`'s measurements (floor.py reads the times near it as host-bound)."""
    def f(state, ctx_args, ins_list, glob):
        return [jnp.zeros((), jnp.float32) for _ in ins_list], ()
    return _Job(key, jax.jit(f, keep_unused=True), like.state, like.ctx_args, like.ins, like.glob, like.copies)


def compiler_options(j: _Job) -> dict | None:
    """XLA's dot merger off, as the split variants compile (nfjax/schedule/variants.py), except for the whole
    Sequential layer. Why: with it on, the `copies` of an op, which share the weights, had their GEMMs merged into
    one (run 4: gate/up at 64 tokens 0.028 ms, under the 0.07 its 235 MB of weights take to read; every GEMM
    size n measured as n x copies / copies)."""
    from nfjax.compat import NO_DOT_MERGER
    return None if j.merger else dict(NO_DOT_MERGER)


def compile_jobs(jobs, threads: int | None = None, log=print) -> None:
    """Lower every job in turn, compile them on a thread pool; a job that fails keeps its error."""
    lowered = []
    t0 = time.perf_counter()
    for j in jobs:
        try:
            lowered.append((j, j.lower()))
        except Exception as e:  # noqa: BLE001 - one op that does not lower must not lose the others
            j.error = f"lower: {e!r}"[:300]
    log(f"[profile] lowered in {time.perf_counter() - t0:.1f} s")
    # a GPU host compiles on its cores; XLA:CPU compiled 55 small programs 3.5x slower on 2 threads than in turn
    threads = threads or (max(1, min(16, os.cpu_count() or 1)) if jax.default_backend() == "gpu" else 1)
    with cf.ThreadPoolExecutor(threads) as pool:
        futs = {pool.submit(lw.compile, compiler_options=compiler_options(j)): j for j, lw in lowered}
        for fut in cf.as_completed(futs):
            j = futs[fut]
            try:
                j.compiled = fut.result()
            except Exception as e:  # noqa: BLE001
                j.error = f"compile: {e!r}"[:300]
    for j in jobs:
        if j.error:
            log(f"[profile] {j.key}: {j.error}")


def _caller(j: _Job):
    """One call of `j` on its own inputs (a job that writes the cache gets its donated cache back each call)."""
    args = j.args()

    def call():
        out, glob = j.compiled(*args)
        if j.writes:                           # the donated cache comes back for the next call
            args[3] = glob
        return out
    return call


def time_job(j: _Job, reps: int, target_ms: float) -> float:
    """Median ms per op by the wall clock (a call runs `j.copies` of them): `reps` batches of back-to-back calls."""
    call = _caller(j)
    jax.block_until_ready(call())
    t = time.perf_counter()
    jax.block_until_ready(call())
    one = max((time.perf_counter() - t) * 1e3, 1e-3)
    iters = max(1, min(200, math.ceil(target_ms / one)))
    per = []
    for _ in range(reps):
        t = time.perf_counter()
        out = None
        for _ in range(iters):
            out = call()
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t) * 1e3 / iters / j.copies)
    return statistics.median(per)


def traces_device() -> bool:
    """Whether a profiler trace here shows the GPU's kernels (the device timing's premise), tried on a small
    program; False: the profile takes the wall clock (with its floor jobs), never a mix of the two clocks."""
    x = jnp.ones((1024,), jnp.float32)
    f = jax.jit(lambda a: a * 2.0)
    try:
        device_times(lambda: f(x), calls=2)
        return True
    except RuntimeError:
        return False


def device_time_job(j: _Job, reps: int) -> tuple[float, float]:
    """(busy, span) ms per op on the GPU: a call's (nfjax/device_trace.py) over its `j.copies` ops."""
    busy, span = device_times(_caller(j), calls=reps)
    return busy / j.copies, span / j.copies


def copy_rate(nbytes: int) -> float:
    """Bytes per ms a device copy moves, counting bytes read and written."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            y = f(x)
        y.block_until_ready()
        ts.append((time.perf_counter() - t) * 1e3 / 10)
    return 2 * nbytes / statistics.median(ts)


def profile(subject, grid: Grid, *, device: str, device_name: str, num_sms: int, command: str | None = None,
            tp: int = 1, align: int | None = None, timing: str | None = None, log=print) -> dict:
    """Measure `subject` on `grid`; returns the profile dict. `num_sms` 0: shares are not measured. `timing`:
    "device" (busy times from a trace; the default on a GPU whose traces show its kernels) or "wall" (elsewhere)."""
    if timing is not None and timing not in TIMINGS:
        raise ValueError(f"timing={timing!r}: one of {TIMINGS}")
    timing = timing or ("device" if jax.default_backend() == "gpu" and traces_device() else "wall")
    from nfjax.autosearch.profile import FORMAT, KIND
    from nfjax.autosearch.subjects import value_bytes
    from nfjax.schedule.beside import HORIZONTAL_KERNELS
    t0 = time.perf_counter()
    g = subject.graph
    jobs, cases = [], {}
    token_ops = [n.name for n in g if subject.kind(n.name) == "tokens"]
    for n in grid.tokens:
        cases["tokens", n] = c = subject.token_case(n)
        jobs += [op_job(subject, ("tokens", op, n), op, c, copies=grid.copies) for op in token_ops]
    dec = [op for op in g.names if subject.kind(op) == "decode"]
    pre = [op for op in g.names if subject.kind(op) == "prefill"]
    for op in dec:
        for ctx in grid.ctxs:
            for d in grid.decodes:
                c = subject.decode_case(d, ctx, max(d, 8))
                jobs.append(op_job(subject, ("decode", op, ctx, d), op, c, copies=grid.kernel_copies))
    for op in pre:
        for st in grid.starts:
            for ch in grid.chunks:
                jobs.append(op_job(subject, ("prefill", op, st, ch), op, subject.prefill_case(ch, st),
                                   copies=grid.kernel_copies))
        jobs.append(op_job(subject, ("prefill", op, 0), op, subject.decode_case(8, grid.ctxs[0], 8),
                           copies=grid.kernel_copies))
    shares = [s for s in grid.shares if s < 1] if num_sms else []
    pairs = [k for k in HORIZONTAL_KERNELS.values() if all(op in g for op in k.replaces)]
    pair_cases = {}
    for k in pairs:
        a, b = k.replaces
        ca = subject.decode_case(grid.share_decodes, grid.share_ctx, grid.share_decodes) \
            if subject.kind(a) == "decode" else subject.token_case(grid.share_decodes)
        cb = subject.token_case(grid.share_tokens)
        pair_cases[k.name] = (ca, cb)
        for s in (shares or [0.25]):
            na = max(1, round(s * num_sms)) if num_sms else None
            kc = grid.kernel_copies
            jobs.append(pair_job(subject, ("pair", k.name, s), k, ca, cb, na, kc))
            jobs.append(op_job(subject, ("alone_a", k.name, s), a, ca, na, kc))
            jobs.append(op_job(subject, ("alone_b", k.name, s), b, cb, (num_sms - na) if num_sms else None, kc))
        for s in ([1.0] if num_sms else []):           # each op on all SMs through its share-taking kernel
            jobs.append(op_job(subject, ("alone_a", k.name, s), a, ca, num_sms, grid.kernel_copies))
            jobs.append(op_job(subject, ("alone_b", k.name, s), b, cb, num_sms, grid.kernel_copies))
        # the interference at other sizes (the rows at one size vary balance and share together; kappa follows
        # the balance, and a class's sizes may be far from the main rows': 1024 tokens with 128 decodes)
        for d, t in (grid.pair_sizes if subject.kind(a) == "decode" else ()):
            ca2, cb2 = subject.decode_case(d, grid.share_ctx, d), subject.token_case(t)
            for s in (shares or [0.25]):
                na, kc = (max(1, round(s * num_sms)) if num_sms else None), grid.kernel_copies
                jobs.append(pair_job(subject, ("pair", k.name, s, d, t), k, ca2, cb2, na, kc))
                jobs.append(op_job(subject, ("alone_a", k.name, s, d, t), a, ca2, na, kc))
                jobs.append(op_job(subject, ("alone_b", k.name, s, d, t), b, cb2,
                                   (num_sms - na) if num_sms else None, kc))
    layer_cases = [(t, d) for t in grid.layer_tokens for d in grid.layer_decodes if d < t] \
        if hasattr(subject, "mixed_case") and grid.ctxs else []
    for t, d in layer_cases:
        jobs.append(layer_job(subject, ("layer", t, d), subject.mixed_case(t, d, grid.ctxs[0])))
    if timing == "wall":            # a device time holds no dispatch: nothing to read as host-bound
        first = {k[0]: j for j in jobs[::-1] for k in [j.key] if k[0] in ("tokens", "decode")}
        jobs += [floor_job(("floor", k), j) for k, j in first.items()]
    log(f"[profile] {len(jobs)} measurements: lowering and compiling ...")
    compile_jobs(jobs, log=log)
    log(f"[profile] compiled in {time.perf_counter() - t0:.1f} s; timing ...")
    ms, spans = {}, {}
    for j in jobs:
        if j.compiled is not None:
            try:            # one clock for the whole profile: a job that fails is left out, as any failure is
                if timing == "device":
                    ms[j.key], spans[str(j.key)] = device_time_job(j, grid.reps)
                else:
                    ms[j.key] = time_job(j, grid.reps, grid.target_ms)
            except Exception as e:  # noqa: BLE001
                log(f"[profile] {j.key}: run: {e!r}"[:300])
        j.compiled = None
    prof = {"format": FORMAT, "kind": KIND, "command": command or " ".join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device, "device_name": device_name, "num_sms": num_sms, "model": subject.model,
            "shape": subject.shape, "tp": tp, "align": align or grid.tokens[0], "grid": asdict(grid),
            "graph": {"inputs": list(g.inputs), "output": g.output,
                      "ops": [{"name": n.name, "resource": n.resource.value, "ins": list(n.spec.ins),
                               "outs": list(n.spec.outs)} for n in g]},
            "tokens": {}, "join_free": subject.join_free(), "errors": [f"{j.key}: {j.error}" for j in jobs if j.error]}
    if getattr(subject, "projections", None):
        prof["projections"] = subject.projections
    if hasattr(subject, "swiglu_epilogue"):
        prof["swiglu_epilogue"] = subject.swiglu_epilogue
    for op in token_ops:
        pts = [(n, ms[("tokens", op, n)]) for n in grid.tokens if ("tokens", op, n) in ms]
        if pts:
            prof["tokens"][op] = {"tokens": [n for n, _ in pts], "ms": [round(t, 6) for _, t in pts]}
    for op in dec:
        ds = [d for d in grid.decodes if all(("decode", op, c, d) in ms for c in grid.ctxs)]
        prof["decode"] = {"op": op, "ctx": list(grid.ctxs), "decodes": ds,
                          "ms": [[round(ms["decode", op, c, d], 6) for d in ds] for c in grid.ctxs]}
    for op in pre:
        chs = [c for c in grid.chunks if all(("prefill", op, st, c) in ms for st in grid.starts)]
        prof["prefill"] = {"op": op, "chunks": chs, "starts": list(grid.starts),
                           "ms": [[round(ms["prefill", op, st, c], 6) for c in chs] for st in grid.starts],
                           "empty_ms": round(ms.get(("prefill", op, 0), 0.0), 6)}
    prof["shares"], prof["pairs"] = {}, []
    for k in pairs:
        a, b = k.replaces
        ss = [s for s in shares + ([1.0] if num_sms else []) if ("alone_a", k.name, s) in ms]
        if num_sms and ss:
            prof["shares"][a] = {"at": {"size": grid.share_decodes, "ctx": grid.share_ctx}, "share": ss,
                                 "ms": [round(ms["alone_a", k.name, s], 6) for s in ss]}
            sb = sorted({round(1 - s, 6) for s in ss if s < 1} | {1.0})
            src = {round(1 - s, 6): ms.get(("alone_b", k.name, s)) for s in ss if s < 1}
            src[1.0] = ms.get(("alone_b", k.name, 1.0))
            sb = [s for s in sb if src.get(s) is not None]
            prof["shares"][b] = {"at": {"tokens": grid.share_tokens}, "share": sb,
                                 "ms": [round(src[s], 6) for s in sb]}
        for s in (shares or [0.25]):
            if all(key in ms for key in (("pair", k.name, s), ("alone_a", k.name, s), ("alone_b", k.name, s))):
                prof["pairs"].append({"kernel": k.name, "ops": [a, b], "share": s,
                                      "sizes": [grid.share_decodes, grid.share_tokens],
                                      "fused_ms": round(ms["pair", k.name, s], 6),
                                      "a_ms": round(ms["alone_a", k.name, s], 6),
                                      "b_ms": round(ms["alone_b", k.name, s], 6)})
        for d, t in grid.pair_sizes:
            for s in (shares or [0.25]):
                keys = [(w, k.name, s, d, t) for w in ("pair", "alone_a", "alone_b")]
                if all(key in ms for key in keys):
                    f, x, y = (round(ms[key], 6) for key in keys)
                    prof["pairs"].append({"kernel": k.name, "ops": [a, b], "share": s, "sizes": [d, t],
                                          "fused_ms": f, "a_ms": x, "b_ms": y})
    ts = [t for t in grid.layer_tokens if all(("layer", t, d) in ms for d in grid.layer_decodes)]
    if ts and layer_cases:
        prof["layer"] = {"tokens": ts, "decodes": list(grid.layer_decodes), "ctx": grid.ctxs[0], "chunks": 2,
                         "ms": [[round(ms["layer", t, d], 6) for d in grid.layer_decodes] for t in ts]}
    prof["timing"] = timing
    if spans:       # the times are busy times; each measurement's span beside them, for reading the gaps
        prof["device_spans_ms"] = {k: round(v, 6) for k, v in spans.items()}
    fl = ({"tokens": 0.0, "kernels": 0.0} if timing == "device" else
          {"tokens": ms.get(("floor", "tokens")), "kernels": ms.get(("floor", "decode"))})
    if all(v is not None for v in fl.values()):
        prof["floor_ms"] = {k: round(v, 6) for k, v in fl.items()}
    prof["pair_min_tokens"] = {k.name: grid.min_pair_tokens for k in pairs}
    prof["value_bytes"] = value_bytes(cases["tokens", grid.tokens[-1]])
    prof["copy_bytes_per_ms"] = copy_rate(64 << 20 if num_sms else 8 << 20)
    prof["seconds"] = round(time.perf_counter() - t0, 1)
    log(f"[profile] done in {prof['seconds']} s ({len(prof['errors'])} measurements failed)")
    return prof
