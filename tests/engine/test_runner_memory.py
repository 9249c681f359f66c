"""No compiled program of a step copies the KV cache (issue #26: Mixtral-8x7B on an H200 ran out of memory on
its first step allocating exactly one K array of the stacked cache).

The KV arrays are donated to every layer-group program and must come back aliased (updated in place); no
program (embed, layer groups, the decode-only variant, the heads, the swap and prefix programs) may need scratch
or an unaliased output the size of one K array. XLA's memory analysis of each compiled program is checked for a
tiny dense Llama and a tiny Mixtral of the same size, with a cache large enough that one K array (64 MiB) dwarfs
everything else a step holds. `check_no_cache_copy` itself is checked on a program that does copy the cache (the
layer program compiled without donation), so a pass means something. A guard: no program did copy the cache,
here or compiled by XLA:GPU for an H200 (deviceless, the GPU kernels and layout); the H200 failure was not
reproduced on the CPU.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import pytest

from nfjax.config import BatcherConfig, CacheConfig, EngineConfig, ExecutionConfig
from nfjax.engine.runner import Runner
from nfjax.engine.step_programs import layers_step
from nfjax.models.llama import sequential_layer_fn
from nfjax.models.random_init import MIXTRAL_SMOKE, SMOKE, random_model
from nfjax.parallel import make_mesh, shard_model

# 4 layers in groups of 2 (two programs a step, as the 32-layer models' groups of 4), f32 (the CPU's bf16
# scatter is widened to f32 for dense and MoE alike: not the property under test), 4096 pages of 16:
# one K array = 4 layers x 4096 x 16 x 2 heads x 32 x 4 bytes = 64 MiB; the largest program scratch is ~12 MiB
# (the MoE layer group at 64 tokens: XLA's CPU ragged_dot runs every expert).
_DIMS = dict(num_layers=4, dtype="float32")


def _runner(cfg, layers_per_program: int = 2, token_buckets: tuple[int, ...] = (16, 64)) -> Runner:
    mesh = make_mesh(1)
    model = random_model(cfg, host=True)
    shard_model(model, mesh)
    ec = EngineConfig(cfg, CacheConfig(page_size=16, num_pages=4096, max_pages_per_seq=8),
                      BatcherConfig(token_buckets=token_buckets, max_seqs=16),
                      execution=ExecutionConfig(layers_per_program=layers_per_program))
    r = Runner(model, ec, mesh, take_weights=True)
    r.compile_all()
    return r


def compiled_programs(r: Runner) -> dict[str, object]:
    """Every compiled program the runner launches, by a readable name."""
    tables = {"embed": r._embed, "head": r._head, "full_head": r._full_head, "layers": r._steps,
              "decode_layers": r._decode_steps, "stage": r._stage, "unpack": r._unpack}
    out = {f"{name}{key}": prog for name, table in tables.items() for key, prog in table.items()}
    out.update({name: p for name in ("_swap_out", "_swap_in", "_seed") if (p := getattr(r, name)) is not None})
    return out


def check_no_cache_copy(name: str, prog, k_bytes: int) -> list[str]:
    """Why `prog` may hold a second copy of a K array ([] when it cannot): scratch or unaliased output of at
    least half a K array."""
    m = prog.memory_analysis()
    bad = []
    if m.temp_size_in_bytes >= k_bytes // 2:
        bad.append(f"{name}: scratch {m.temp_size_in_bytes} bytes, one K array is {k_bytes}")
    if m.output_size_in_bytes - m.alias_size_in_bytes >= k_bytes // 2:
        bad.append(f"{name}: {m.output_size_in_bytes - m.alias_size_in_bytes} bytes of output not aliased to an "
                   f"input, one K array is {k_bytes}")
    return bad


@pytest.fixture(scope="module", params=["dense", "mixtral", "mixtral-gpu-layout"])
def runner(request):
    if request.param == "dense":
        yield _runner(SMOKE.replace(**_DIMS))
        return
    if request.param == "mixtral":
        yield _runner(MIXTRAL_SMOKE.replace(**_DIMS))
        return
    # The GPU path's routing on the CPU: groups padded to 128-row tiles, and the grouped kernel's tile table
    # (computed by XLA before each launch) in the program.
    import nfjax.models.moe as moe
    from pallas_kernels.grouped_gemm import tile_table
    mp = pytest.MonkeyPatch()
    orig = moe.grouped_matmul

    def with_table(x, w, group_sizes, num_ctas=None):
        table = tile_table(group_sizes, x.shape[0], 128, 2)
        return orig(x, w, group_sizes, num_ctas) * (table[0] >= 0).astype(x.dtype)
    mp.setattr(moe, "group_alignment", lambda dtype: 128)
    mp.setattr(moe, "grouped_matmul", with_table)
    try:
        yield _runner(MIXTRAL_SMOKE.replace(**_DIMS))
    finally:
        mp.undo()


def test_no_program_copies_a_k_array(runner):
    k_bytes = runner.kv.k.nbytes
    assert k_bytes == 64 << 20
    progs = compiled_programs(runner)
    assert {"layers(16, 'sequential')", "decode_layers(16, 'sequential')", "head(64, 'limits')", "full_head64",
            "_swap_in"} <= set(progs)
    bad = [why for name, prog in progs.items() for why in check_no_cache_copy(name, prog, k_bytes)]
    assert not bad, bad
    for name, prog in progs.items():
        if "layers" in name:         # the donated K and V come back aliased, whole
            assert prog.memory_analysis().alias_size_in_bytes >= 2 * k_bytes, name


def test_largest_temps_stay_below_a_k_array(runner):
    """`Runner.largest_temps` (what bench/offline prints) sees every step program and none near a K array."""
    temps = runner.largest_temps(n=100)
    assert len(temps) == sum(len(t) for t in (runner._embed, runner._head, runner._full_head, runner._steps,
                                              runner._decode_steps))
    assert temps[0][1] < runner.kv.k.nbytes // 2, temps[:3]


def test_the_check_sees_a_copied_cache(runner):
    """Control: the same layer program compiled without donating the cache returns a new K and V, which the
    check reports."""
    r = runner
    inp = r._example_input(16)
    x = jax.ShapeDtypeStruct((16, r.cfg.hidden_size), jnp.dtype(r.cfg.dtype), sharding=r.replicated)
    n = r.groups[0][1]
    prog = jax.jit(partial(layers_step, r.layer_gd, r.layer_specs, r.mesh, sequential_layer_fn, r.opts, r.inv_freq),
                   out_shardings=(r.replicated, r.kv_sharding)).lower(
        tuple(r.layer_states[:n]), r.kv, x, inp.meta, r._layer_ids[0]).compile()
    assert check_no_cache_copy("undonated", prog, r.kv.k.nbytes)


def test_an_automatic_kv_size_that_does_not_fit_is_retried_smaller(monkeypatch):
    """Free memory in holes (issue #26: no block held Mixtral's V on an H200): an automatic size whose cache
    fails to allocate is retried at 85% of the memory, with a warning; a size given by --num-pages is not."""
    import nfjax.engine.runner as runner_mod
    from nfjax.errors import UserError
    from nfjax.kv.cache import KVCache
    real = KVCache.create
    tried = []

    def create(model, cache, **kw):
        tried.append(cache.num_pages)
        if cache.num_pages > 1400:                    # as the device would: too large to allocate
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return real(model, cache, **kw)
    monkeypatch.setattr(KVCache, "create", staticmethod(create))
    monkeypatch.setattr(runner_mod, "free_device_bytes", lambda: 64 << 20)
    mesh = make_mesh(1)
    model = random_model(SMOKE.replace(**_DIMS), host=True)
    shard_model(model, mesh)
    ec = EngineConfig(model.cfg, CacheConfig(page_size=16, max_pages_per_seq=8),
                      BatcherConfig(token_buckets=(16,), max_seqs=4))
    with pytest.warns(RuntimeWarning, match="not the"):
        r = Runner(model, ec, mesh)
    assert len(tried) == 3 and tried[0] > 1400 >= r.cache_cfg.num_pages == tried[-1]
    assert r.kv.k.shape[1] == r.cache_cfg.num_pages and tried == sorted(tried, reverse=True)
    tried.clear()
    fixed = EngineConfig(model.cfg, CacheConfig(page_size=16, num_pages=1500, max_pages_per_seq=8),
                         BatcherConfig(token_buckets=(16,), max_seqs=4))
    with pytest.raises(UserError, match="--num-pages"):
        Runner(model, fixed, mesh)
    assert tried == [1500]


def test_scratch_beyond_the_free_memory_is_a_warning_at_start(monkeypatch):
    """Where a compiled program's scratch exceeds the device memory left beside the weights and the cache, the
    engine says so at start, naming the program and the flags; with room (or no statistics, as on the CPU) it is
    silent."""
    import warnings

    import nfjax.engine.runner as runner_mod
    for free, warns in ((None, False), (1 << 40, False), (1024, True)):
        monkeypatch.setattr(runner_mod, "free_device_bytes", lambda f=free: f)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            # one token bucket: the check at start reads every compiled program's scratch whatever their number
            # (three starts here, each compiling its programs)
            r = _runner(SMOKE.replace(**_DIMS), token_buckets=(16,))
        msgs = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning) and "scratch" in str(w.message)]
        assert bool(msgs) == warns, (free, msgs)
        if warns:
            name = r.largest_temps(1)[0][0]
            assert name in msgs[0] and "--kv-memory-fraction" in msgs[0]
