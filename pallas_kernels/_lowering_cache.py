"""A process-wide cache of Pallas kernels' Mosaic GPU lowering across programs (opt-in:
`ExecutionConfig.kernel_lowering_cache`, `--kernel-lowering-cache`).

The engine lowers one layer program per token bucket (and per decode-only variant), each calling the same
attention kernels, and JAX caches a kernel's lowering within one module only, so every program lowers the kernels
afresh: ~1.7 s a program for int4's decode and prefill kernels on the host, against 59 s of lowering for an
int4 engine. Here JAX's `lower_pipelined_jaxpr_to_module` (90% of a kernel's lowering) is wrapped with a cache
keyed by the kernel's printed jaxpr, grid mapping, meshes and compiler and cost parameters; it holds the Mosaic
module as MLIR bytecode, which each later program parses into its own context. On the CPU host, cross-lowering
for CUDA: 8 programs with the decode and prefill kernels in 8.5 -> 3.3 s (bf16) and 13.9 -> 7.0 s (int4), each
program's lowered text the same as without the cache (`python -m bench.probes.lowering_cache --formats
bfloat16,int4 --programs 8 --prefill`). Not yet run on a GPU, hence opt-in. Where this JAX lacks the function or
its result type, `enable` leaves lowering as it is and says so.
"""
from __future__ import annotations

import dataclasses
import io

_STATE: dict = {"orig": None, "store": {}, "hits": 0, "misses": 0}


def enable() -> bool:
    """Wrap the lowering (once a process); False where this JAX's Mosaic GPU lowering does not have the shape
    the cache needs."""
    if _STATE["orig"] is not None:
        return True
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.mosaic_gpu import lowering as lowering_mod
    except ImportError:
        return False
    orig = getattr(lowering_mod, "lower_pipelined_jaxpr_to_module", None)
    result_type = getattr(lowering_mod, "LoweringResult", None)
    if orig is None or not dataclasses.is_dataclass(result_type) or \
            "module" not in {f.name for f in dataclasses.fields(result_type)}:
        return False
    store = _STATE["store"]

    def lower(*args, **kwargs):
        kw = {k: v for k, v in kwargs.items() if k != "outer_traceback"}     # where the call came from only
        key = tuple(str(a) if i == 3 else repr(a) for i, a in enumerate(args)) + tuple(sorted(
            (k, repr(v)) for k, v in kw.items()))
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

    lowering_mod.lower_pipelined_jaxpr_to_module = lower
    _STATE["orig"] = (lowering_mod, orig)
    return True


def disable() -> None:
    """JAX's own lowering back, the cache emptied."""
    if _STATE["orig"] is not None:
        mod, orig = _STATE["orig"]
        mod.lower_pipelined_jaxpr_to_module = orig
    _STATE.update(orig=None, store={}, hits=0, misses=0)


def stats() -> dict:
    return {"enabled": _STATE["orig"] is not None, "hits": _STATE["hits"], "misses": _STATE["misses"]}
