"""How JAX takes the GPU's memory, chosen for the model before JAX's GPU client starts: the allocator, the share of
device memory JAX may use, and the share of what the weights leave that the KV pages take.

- **Allocator.** JAX's default (XLA's BFC pool) carves every array out of one preallocated region, and the arrays
  freed while a Runner splits the stacked weights into per-layer arrays and joins projections leave holes. For
  Mixtral-8x7B on an H200 that left 44.5 GB free after the weights but no block over 24.4 GB: the KV cache got
  25,866 pages where 35,835 fit. CUDA's stream-ordered allocator (`cuda_async`) backs each allocation with pages
  of its own, so free memory is usable whatever its holes: 36,017 pages in the same run. MoE models get it; dense
  models keep JAX's default (their cache fits in it, and their headline figures were measured with it).
- **JAX's share** (`XLA_PYTHON_CLIENT_MEM_FRACTION`; JAX's own default is 0.75): 0.92 for dense models, the share
  every dense headline was measured at. MoE models 0.99 and the KV 0.97 of what the weights leave (0.9 for dense):
  Mixtral's 93 GB of weights leave an H200 a thin slice, and its 1024/512 run fits one wave of requests only from
  ~45,100 pages (~47,000 with the MoE's 3,072-token steps, nfjax/engine/builder.py; docs/design.md section 15):
  47,974 pages, 1.6 GB beside them for programs' scratch (0.66 GiB the largest) and 1.5 GB outside JAX.
Only the client's start reads the variables, so `nfjax` and the benches call `for_model` before touching a device;
a value the user set is kept (docs/design.md section 15).
"""
from __future__ import annotations

import os

ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"
MOE_ALLOCATOR = "cuda_async"
MEM_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
MEM_FRACTION = {"dense": "0.92", "moe": "0.99"}
KV_MEMORY_FRACTION = {"dense": 0.9, "moe": 0.97}


def is_moe(cfg) -> bool:
    """A model with experts (the defaults here and the MoE step buckets in nfjax/engine/builder.py follow it)."""
    return bool(getattr(cfg, "num_experts", 0))


def _kind(cfg) -> str:
    return "moe" if is_moe(cfg) else "dense"


def kv_memory_fraction(cfg) -> float:
    """The share of device memory left after the weights that the KV pages take by default."""
    return KV_MEMORY_FRACTION[_kind(cfg)]


def for_model(cfg, log=None) -> dict[str, str]:
    """Set the allocator and JAX's memory share `cfg` runs best with, each unless the user chose it. Returns the
    values in effect ({variable: value}; a variable absent: JAX's default). After JAX has started it changes
    nothing and, on a GPU, says so through `log`."""
    from nfjax.compat import backends_started
    want = {MEM_ENV: MEM_FRACTION[_kind(cfg)]}
    if is_moe(cfg):
        want[ALLOCATOR_ENV] = MOE_ALLOCATOR
    missing = {k: v for k, v in want.items() if k not in os.environ}
    if missing and backends_started():
        from nfjax.compat import on_gpu
        if log and on_gpu():                      # a CPU has no such settings to miss
            log(f"{', '.join(missing)} not set: JAX has started, so its defaults hold (the KV cache may get fewer "
                f"pages than this model runs best with); set {' '.join(f'{k}={v}' for k, v in missing.items())} "
                f"before the run")
    else:
        os.environ.update(missing)
    return {k: os.environ[k] for k in (MEM_ENV, ALLOCATOR_ENV) if k in os.environ}
