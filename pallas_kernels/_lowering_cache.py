"""A process-wide cache of Pallas kernels' Mosaic GPU lowering across programs (opt-in:
`ExecutionConfig.kernel_lowering_cache`, `--kernel-lowering-cache`).

The engine lowers one layer program per token bucket (and per decode-only variant), each calling the same
attention kernels, and JAX caches a kernel's lowering within one module only, so every program lowers the kernels
afresh: ~1.7 s a program for int4's decode and prefill kernels on the host, against 59 s of lowering for an
int4 engine. Here JAX's `lower_pipelined_jaxpr_to_module` (90% of a kernel's lowering; jax 0.11's
`lower_unpipelined_jaxpr_to_module`) is wrapped with a cache
keyed by the kernel's printed jaxpr, grid mapping, meshes and compiler and cost parameters; it holds the Mosaic
module as MLIR bytecode, which each later program parses into its own context. On the CPU host, cross-lowering
for CUDA: 8 programs with the decode and prefill kernels in 8.5 -> 3.3 s (bf16) and 13.9 -> 7.0 s (int4), each
program's lowered text the same as without the cache (`python -m bench.probes.lowering_cache --formats
bfloat16,int4 --programs 8 --prefill`). On the H200 (jax 0.11.2) an engine's build is mostly the compilation after
lowering, and the cache saved less than the builds' spread (docs/design.md section 1), hence opt-in. Where this
JAX lacks the functions or their result type, `enable` leaves lowering as it is and says why (`why_not`).
"""
from __future__ import annotations

import dataclasses
import io

_STATE: dict = {"orig": None, "store": {}, "hits": 0, "misses": 0, "why_not": None}


# JAX's entry points into a kernel's Mosaic GPU lowering: pallas_call's pipelined one (jax 0.10) and the one
# that 0.11 lowers pallas_call and plgpu.kernel through (both via mpmd_map); the jaxpr is printed, the rest repr'd.
_ENTRY_POINTS = ("lower_pipelined_jaxpr_to_module", "lower_unpipelined_jaxpr_to_module")


def enable() -> bool:
    """Wrap the lowering (once a process); False where this JAX's Mosaic GPU lowering does not have the shape
    the cache needs (`why_not` says how)."""
    if _STATE["orig"] is not None:
        return True
    try:
        from jax._src import core as jax_core
        from jax._src.lib.mlir import ir
        from jax._src.pallas.mosaic_gpu import lowering as lowering_mod
    except ImportError as e:
        return _refuse(f"cannot import Mosaic GPU's lowering ({e})")
    origs = {name: getattr(lowering_mod, name) for name in _ENTRY_POINTS if hasattr(lowering_mod, name)}
    result_type = getattr(lowering_mod, "LoweringResult", None)
    if not origs:
        return _refuse(f"jax._src.pallas.mosaic_gpu.lowering has none of {', '.join(_ENTRY_POINTS)}")
    if not dataclasses.is_dataclass(result_type) or "module" not in {f.name for f in dataclasses.fields(result_type)}:
        return _refuse("its LoweringResult is not a dataclass with a module field")
    store = _STATE["store"]

    def cached(name, orig):
        def lower(*args, **kwargs):
            kw = {k: v for k, v in kwargs.items() if k != "outer_traceback"}     # where the call came from only
            key = (name,) + tuple(str(a) if isinstance(a, jax_core.Jaxpr) else repr(a) for a in args) + tuple(
                sorted((k, repr(v)) for k, v in kw.items()))
            hit = store.get(key)
            if hit is not None:
                _STATE["hits"] += 1
                code, res = hit
                return dataclasses.replace(res, module=ir.Module.parse(code))
            _STATE["misses"] += 1
            res = orig(*args, **kwargs)
            buf = io.BytesIO()
            res.module.operation.write_bytecode(buf)
            store[key] = (buf.getvalue(), res)
            return res
        return lower

    for name, orig in origs.items():
        setattr(lowering_mod, name, cached(name, orig))
    _STATE.update(orig=(lowering_mod, origs), why_not=None)
    return True


def _refuse(why: str) -> bool:
    _STATE["why_not"] = why
    return False


def why_not() -> str | None:
    """Why the last `enable` left lowering as it was (None where it did not refuse)."""
    return _STATE["why_not"]


def disable() -> None:
    """JAX's own lowering back, the cache emptied."""
    if _STATE["orig"] is not None:
        mod, origs = _STATE["orig"]
        for name, orig in origs.items():
            setattr(mod, name, orig)
    _STATE.update(orig=None, store={}, hits=0, misses=0, why_not=None)


def stats() -> dict:
    return {"enabled": _STATE["orig"] is not None, "hits": _STATE["hits"], "misses": _STATE["misses"]}
