"""Shared pytest setup: 8 host CPU devices, so tensor-parallel tests run without accelerators; CPU computations
run inline instead of dispatched asynchronously."""
import os

# The Mosaic GPU interpreter runs each kernel's warpgroups as host callbacks that dispatch JAX ops of their own.
# With asynchronous dispatch the test thread goes on dispatching (its next op queued behind the kernel) while
# the callbacks' ops queue behind it: a deadlock, seen once in about ten runs on a 2-core machine (every thread's
# stack in test_attention_dispatch). Inline dispatch finishes each kernel before the next op is issued.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# XLA:CPU's LLVM backend at -O0: most of the suite's time is compiling tiny programs (an 8-variant engine: 46 ->
# 28 s), and the programs compute the same (no fast-math at either level; the HLO passes, whose output the HLO tests
# read, still run; dots are library calls either way). Running is not slower where it counts: the interpret-mode
# kernels 38 -> 30 s, the 70B-shape TP test (0.84 GB of f32 weights) 57 -> 36 s. Set the flag to choose a level.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# XLA:CPU's classic emitters instead of its MLIR fusion emitters: about half the compile time (the tiny engine of
# tests/engine/conftest.py, cold cache: 18 -> 10 s, backend compile 25 -> 12 s). No fast-math either way, but not
# bit-identical to the default: reductions may be grouped differently (ulp-level differences) and XLA fuses a
# little differently (the optimized HLO the tests read differs in its fusions, not in its ops). The suite's
# comparisons are within one run or to a tolerance, and all pass with it (bench/NOTES.md 32.9). Set the flag
# yourself to choose.
if "--xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()

# One persistent XLA compilation cache per pytest run, shared by the xdist workers (they inherit the controller's
# environment, set here before they start) and by the subprocesses tests start (bench scripts, the CLI): many tests
# build engines whose programs are identical, and a cached program loads in milliseconds instead of compiling for
# seconds. Every program is cached however short its compile (JAX's default skips those under 1 s, which is most
# of a tiny model's). Set JAX_COMPILATION_CACHE_DIR yourself to keep a cache across runs; the folder made here is
# removed at the end of the run. A test that needs a cold cache removes these variables from its subprocess's
# environment (tests/engine/test_builder.py); compile counters count cache loads too (tests/engine/test_batching.py).
_OWN_COMPILE_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    import tempfile
    _OWN_COMPILE_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="nfjax-test-xla-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402  (after XLA_FLAGS; the CPU client is created later, on first use)

jax.config.update("jax_cpu_enable_async_dispatch", False)


def _atomic_cache_writes():
    """JAX's file cache (jax/_src/lru_cache.py, eviction off as here) writes an entry in place: the other worker
    could read it half-written (a warning and a recompile). Write it to a private file and rename it into place, so
    a reader finds the whole entry or none. (Subprocesses write in place: at worst that warning and a recompile.)"""
    import threading
    try:                            # a private module: a JAX that moved it keeps its own in-place writes
        from jax._src import lru_cache
        put, suffix = lru_cache.LRUCache.put, lru_cache._CACHE_SUFFIX
    except (ImportError, AttributeError):
        return

    def atomic_put(self, key, value):
        if getattr(self, "eviction_enabled", True) or not key:
            return put(self, key, value)
        path = self.path / f"{key}{suffix}"
        if path.exists():
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(value)
        os.replace(tmp, path)
    lru_cache.LRUCache.put = atomic_put


_atomic_cache_writes()


def _interpreter_compiles_a_thread_once():
    """The Mosaic GPU interpreter (jax/_src/pallas/mosaic/interpret/thread_map.py, 0.10.2) runs a grid point's
    warpgroups as threads, and each thread traces, lowers and compiles the same per-thread program (the thread id
    is an argument) afresh at every grid point: a kernel of 10 grid points x 3 warpgroups compiles one program 30
    times, and host callbacks keep those compiles out of the persistent cache. Compile it once (per program and
    argument types) and run that executable in every thread: the same program runs, with the same arguments.
    A JAX whose `_run_jaxpr` reads differently keeps its own."""
    import inspect
    import threading
    import weakref
    try:                            # a private module, patched only where its code is the one described above
        from jax._src.pallas.mosaic.interpret import thread_map
        src = inspect.getsource(thread_map._run_jaxpr)
    except (ImportError, AttributeError, OSError, TypeError):
        return
    if "traced.lower().compile()(consts, *args)" not in src:
        return
    lock, compiled = threading.Lock(), weakref.WeakKeyDictionary()

    def _run(jaxpr, consts, *args):
        jax.core.eval_jaxpr(jaxpr, consts, *args)

    def run_jaxpr(jaxpr, consts, *args):
        flat, tree = jax.tree.flatten((consts, args))
        key = (tree, tuple((jax.numpy.shape(a), jax.numpy.result_type(a), getattr(a, "weak_type", False))
                           for a in flat))
        with lock:                  # one compile when a grid point's threads all start at once
            per_jaxpr = compiled.setdefault(jaxpr, {})
            exe = per_jaxpr.get(key)
            if exe is None:
                exe = per_jaxpr[key] = jax.jit(_run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
        exe(consts, *args)
    thread_map._run_jaxpr = run_jaxpr


_interpreter_compiles_a_thread_once()


def pytest_unconfigure(config):
    if _OWN_COMPILE_CACHE and not hasattr(config, "workerinput"):    # the controller made it: the run is over
        import shutil
        shutil.rmtree(_OWN_COMPILE_CACHE, ignore_errors=True)


import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)     # before xdist's own hook, which reads the marks (`--dist loadgroup`)
def pytest_collection_modifyitems(config, items):
    """A test that uses a module-scoped fixture (an engine, a server, a loaded model) joins its module's xdist
    group, so under `--dist loadgroup` (README's command) one worker builds that fixture once instead of each
    worker that draws one of the module's tests building it again; every other test is distributed on its own.
    The kernel tests (tests/pallas_kernels) have no such fixture and stay spread. Without xdist the marks do
    nothing."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(fd[-1].scope == "module" for fd in defs.values() if fd):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture
def before_jax_starts(monkeypatch):
    """JAX's backends taken as not started yet (settings read at the GPU client's start: nfjax/pinned_pool.py,
    nfjax/device_memory.py)."""
    import nfjax.compat
    monkeypatch.setattr(nfjax.compat, "backends_started", lambda: False)
    return monkeypatch
