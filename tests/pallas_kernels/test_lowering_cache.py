"""The kernel lowering cache (pallas_kernels/_lowering_cache.py): programs that call the same kernel the same way
lower to the same text with it as without it, the later ones from the cache; a kernel called another way is
lowered afresh."""
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import _lowering_cache, kv_quant
from pallas_kernels.paged_decode_swapped import paged_decode_attention_swapped


def _program_text(j: int, batch: int = 64, fmt: str = "int8") -> str:
    sds = jax.ShapeDtypeStruct
    lead = (2, 512, 16, 8)
    cache = sds((*lead, kv_quant.value_width(fmt, 128)), kv_quant.value_dtype(fmt, jnp.bfloat16))
    aux = sds((*lead, kv_quant.aux_width(fmt, 128)), kv_quant.AUX_DTYPE)

    def prog(q, k, v, a, pt, lens):     # a program of its own each time (j in its body): a module of its own
        return paged_decode_attention_swapped(q * (j + 1), k, v, jnp.int32(j % 2), pt, lens, scale=0.1,
                                              aux_cache=a)
    args = (sds((batch, 32, 128), jnp.bfloat16), cache, cache, aux, sds((batch, 16), jnp.int32),
            sds((batch,), jnp.int32))
    text = jax.jit(prog).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.sub(r"loc\([^)]*\)", "", text)


@pytest.fixture
def lowering_cache():
    _lowering_cache.disable()
    yield _lowering_cache
    _lowering_cache.disable()


def test_cached_lowering_gives_each_program_the_same_text(lowering_cache):
    plain = [_program_text(j) for j in range(3)]
    assert lowering_cache.enable() and lowering_cache.enable()           # once a process
    cached = [_program_text(j) for j in range(3)]
    assert cached == plain
    st = lowering_cache.stats()
    assert st["enabled"] and st["misses"] == 1 and st["hits"] == 2
    assert _program_text(0, batch=32) != plain[0]                        # another shape: lowered afresh
    assert lowering_cache.stats()["misses"] == 2
    lowering_cache.disable()
    assert lowering_cache.stats() == {"enabled": False, "hits": 0, "misses": 0}
    assert _program_text(1) == plain[1]


def test_a_jax_without_the_entry_points_is_refused_with_the_reason(lowering_cache, monkeypatch):
    from jax._src.pallas.mosaic_gpu import lowering as lowering_mod
    for name in lowering_cache._ENTRY_POINTS:
        monkeypatch.delattr(lowering_mod, name, raising=False)
    assert lowering_cache.enable() is False
    assert "lower_unpipelined_jaxpr_to_module" in lowering_cache.why_not()
    assert lowering_cache.stats()["enabled"] is False
