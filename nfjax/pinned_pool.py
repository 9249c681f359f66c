"""XLA's pinned host memory pool: its size limit, set before JAX's GPU client starts.

Pinned (`pinned_host`) arrays come from one pool per GPU client, capped at 64 GB unless the environment variable
`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` says otherwise; an allocation past the cap fails with RESOURCE_EXHAUSTED (an
OPT-30B offload policy's pinned weights and KV blocks did at 64 GB). Only the client's start reads the variable,
so `nfjax` sets it from the flags before running a command (`for_args`), and the benches before they touch a
device. A value the user set is kept; the cap is never lowered below XLA's default. The pool grows in regions it
does not give back (docs/design.md section 11)."""
from __future__ import annotations

import math
import os

ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_GB = 64                  # XLA's cap without the variable
MARGIN = 1.1                     # over the planned pinned bytes: transient pinned buffers (a prefill's KV rows) and
EXTRA_GB = 2                     # the allocator's rounding


def size_for(pinned_gb: float, log=None) -> str | None:
    """Raise the pool's cap to hold `pinned_gb` GB of pinned arrays (x MARGIN + EXTRA_GB) where XLA's default is
    smaller and the user set none. Returns the value in effect (None: XLA's default). After JAX has started it
    changes nothing and says so through `log`."""
    from nfjax.compat import backends_started
    if ENV in os.environ:
        return os.environ[ENV]
    limit = math.ceil(pinned_gb * MARGIN + EXTRA_GB)
    if limit <= DEFAULT_GB:
        return None
    if backends_started():
        if log:
            log(f"{ENV} not set: JAX has started (XLA's {DEFAULT_GB} GB default holds, less than the {limit} GB "
                "planned); set it before the run")
        return None
    os.environ[ENV] = str(limit)
    return os.environ[ENV]


def for_args(args, log=None) -> str | None:
    """The cap for a command's flags: an offload run's host tier (`--cpu-memory-gb`, else the budget's share of
    the machine), or the prefix cache's host tier (`--host-cache-gb`, GiB)."""
    if getattr(args, "offload", None):
        from nfjax.offload.budget import host_cap_gb
        return size_for(host_cap_gb(getattr(args, "cpu_memory_gb", None)), log)
    if getattr(args, "host_cache_gb", None):
        return size_for(args.host_cache_gb * 2 ** 30 / 1e9, log)
    return None
