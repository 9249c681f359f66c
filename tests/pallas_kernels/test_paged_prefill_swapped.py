"""The swapped prefill (pallas_kernels/paged_prefill_swapped.py) in Mosaic GPU interpret mode against the prefill
reference on quantized caches: ragged chunks after cached prefixes, first_seq past decode rows, padding tokens,
GQA 1/4/8, head_dim 64/128, pages of 16 and 64, fp8's K read by fp8 wgmmas or dequantized; CUDA lowering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_quant
from pallas_kernels.paged_prefill_attention import paged_prefill_attention_ref
from pallas_kernels.paged_prefill_swapped import paged_prefill_attention_swapped

# (format, page_size, group, head_dim, tile columns, programs, first_seq, extra kernel arguments)
CASES = [("fp8", 16, 4, 128, 32, 3, 1, {}), ("fp8", 64, 8, 64, 64, 2, 0, {"fp8_mma": False}),
         ("int8", 16, 4, 128, 32, 3, 0, {}), ("int4", 64, 1, 64, 16, 2, 1, {"dequant_wgs": 1})]


@pytest.mark.parametrize("fmt,ps,g,d,cols,progs,first,kw", CASES)
def test_swapped_prefill_on_quantized_cache(paged_case, fmt, ps, g, d, cols, progs, first, kw):
    qlens, before = [3, 21, 1, 9], [5, 0, 70, 130]
    c = paged_case(kv_heads=2, group=g, head_dim=d, page_size=ps, seq_lens=np.add(qlens, before), kv_dtype=fmt)
    t = sum(qlens) + 3                                  # 3 padding tokens
    q = c.queries(t)
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    args = (q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens), qs, jnp.int32(first))
    out = paged_prefill_attention_swapped(*args, scale=c.scale, aux_cache=c.aux, num_ctas=progs, tile_cols=cols,
                                          block_kv=64, interpret=True, **kw)
    ref = paged_prefill_attention_ref(*args, c.scale, aux_cache=c.aux)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all() and c.rel_err(out, ref) < 1e-2, f"seed {c.seed}"
    assert np.all(out[:qlens[0] if first else 0] == 0) and np.all(out[sum(qlens):] == 0)


def test_swapped_prefill_refuses_bad_tiles_and_bf16(paged_case):
    c = paged_case(kv_heads=2, group=4, head_dim=64, page_size=16, seq_lens=[9], kv_dtype="fp8")
    args = (c.queries(9), c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens), jnp.asarray([0, 9], jnp.int32),
            jnp.int32(0))
    with pytest.raises(ValueError, match="tile_cols"):
        paged_prefill_attention_swapped(*args, scale=c.scale, aux_cache=c.aux, tile_cols=12, interpret=True)
    with pytest.raises(ValueError, match="quantized"):
        paged_prefill_attention_swapped(*args, scale=c.scale, aux_cache=None, interpret=True)


@pytest.mark.parametrize("fmt,d,kw", [("fp8", 128, {}), ("fp8", 128, {"tile_cols": 64}), ("int8", 128, {}),
                                      ("int4", 64, {})])
def test_swapped_prefill_lowers_for_gpu(fmt, d, kw):
    sds = jax.ShapeDtypeStruct
    lead = (2, 4096, 16, 8)
    cache = sds((*lead, kv_quant.value_width(fmt, d)), kv_quant.value_dtype(fmt, jnp.bfloat16))
    aux = sds((*lead, kv_quant.aux_width(fmt, d)), kv_quant.AUX_DTYPE)
    args = (sds((2048, 32, d), jnp.bfloat16), cache, cache, sds((), jnp.int32), sds((16, 256), jnp.int32),
            sds((16,), jnp.int32), sds((17,), jnp.int32), sds((), jnp.int32))
    paged_prefill_attention_swapped.trace(*args, scale=d ** -0.5, aux_cache=aux, num_ctas=132, **kw).lower(
        lowering_platforms=("cuda",))
