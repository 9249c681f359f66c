"""Which GPU allocator JAX uses, chosen for the model before JAX's GPU client starts.

JAX's default allocator (XLA's BFC pool) carves every array out of one preallocated region, and the arrays freed
while a Runner splits the stacked weights into per-layer arrays and joins projections leave holes. For
Mixtral-8x7B on an H200 that left 44.5 GB free after the weights but no block over 24.4 GB: the KV cache (two
arrays of ~19 GB at fp8) got 25,866 pages where 35,835 fit. CUDA's stream-ordered allocator (`cuda_async`) backs
each allocation with pages of its own, so the free memory is usable whatever its holes: 36,017 pages in the same
run (docs/design.md section 15). MoE models get it; dense models keep JAX's default (their cache fits in it, and
the headline figures were measured with it). Only the client's start reads the variable, so `nfjax` and the
benches call `for_model` before touching a device; a value the user set is kept.
"""
from __future__ import annotations

import os

ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"
MOE_ALLOCATOR = "cuda_async"


def for_model(cfg, log=None) -> str | None:
    """Set the allocator `cfg` runs best with (MoE: `MOE_ALLOCATOR`) unless the user chose one. Returns the value in
    effect (None: JAX's default). After JAX has started it changes nothing and, on a GPU, says so through `log`."""
    from nfjax.compat import backends_started
    if ENV in os.environ:
        return os.environ[ENV]
    if not getattr(cfg, "num_experts", 0):
        return None
    if backends_started():
        from nfjax.compat import on_gpu
        if log and on_gpu():                      # a CPU has no such allocator to miss
            log(f"{ENV} not set: JAX has started, so its default allocator holds (a MoE model's KV cache may get "
                f"fewer pages than free memory allows); set {ENV}={MOE_ALLOCATOR} before the run")
        return None
    os.environ[ENV] = MOE_ALLOCATOR
    return MOE_ALLOCATOR
