"""bench/kernels/kv_prefill.py: the dequantize-first way gives the prefill reference's attention."""
import jax
import jax.numpy as jnp
import numpy as np

from bench.kernels.kv_decode import make_cache, page_table, relerr
from bench.kernels.kv_prefill import parse_shapes, parse_variants, prefill_predequantized
from pallas_kernels.paged_prefill_attention import paged_prefill_attention_ref


def test_prefill_over_a_dequantized_copy_of_the_pages_matches_the_reference():
    """int8 pages named out of order by the table: copied, dequantized to bf16 and renumbered, the bf16 kernel's
    causal attention over them equals the reference that dequantizes the whole cache."""
    qlens, ctx, ps = [16, 8], [16, 5], 16
    lens = np.add(qlens, ctx)
    kc, vc, aux = make_cache(jax.random.key(0), "int8", 6, ps, 64, kvh=1)
    pt = jnp.asarray(page_table(lens, 6, ps, np.random.default_rng(1)))
    q = jax.random.normal(jax.random.key(1), (sum(qlens), 2, 64), jnp.bfloat16)
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    args = (q, kc, vc, jnp.int32(0), pt, jnp.asarray(lens, jnp.int32), qs, jnp.int32(0))
    out = prefill_predequantized(*args, scale=0.125, aux_cache=aux, interpret=True)
    assert relerr(out, paged_prefill_attention_ref(*args, 0.125, aux_cache=aux)) < 1e-2
    assert parse_shapes("2x1024@0,1x64@48") == [(2, 1024, 0), (1, 64, 48)]
    assert parse_variants("nw1=num_warpgroups=1;b64=block_kv=64+num_stages=3") == {
        "nw1": {"num_warpgroups": 1}, "b64": {"block_kv": 64, "num_stages": 3}}
