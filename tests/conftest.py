"""Shared pytest setup: 8 host CPU devices, so tensor-parallel tests run without accelerators; CPU computations
run inline instead of dispatched asynchronously."""
import os

# The Mosaic GPU interpreter runs each kernel's warpgroups as host callbacks that dispatch JAX ops of their own.
# With asynchronous dispatch the test thread goes on dispatching (its next op queued behind the kernel) while
# the callbacks' ops queue behind it: a deadlock, seen once in about ten runs on a 2-core machine (every thread's
# stack in test_attention_dispatch). Inline dispatch finishes each kernel before the next op is issued.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (after XLA_FLAGS; the CPU client is created later, on first use)

jax.config.update("jax_cpu_enable_async_dispatch", False)


import pytest  # noqa: E402


@pytest.fixture
def before_jax_starts(monkeypatch):
    """JAX's backends taken as not started yet (settings read at the GPU client's start: nfjax/pinned_pool.py,
    nfjax/device_memory.py)."""
    import nfjax.compat
    monkeypatch.setattr(nfjax.compat, "backends_started", lambda: False)
    return monkeypatch
