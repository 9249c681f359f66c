"""Chunked-prefill kernel (Mosaic GPU interpret mode on CPU) against its jnp reference; GPU lowering checked
by cross-lowering for CUDA."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from pallas_kernels.ragged_paged_attention_ref import ragged_paged_attention_ref

# (page_size, group, head_dim, warpgroups, ping-pong, programs, first_seq). Two-warpgroup cases are slow to
# interpret (one with ping-pong, the default; one with the `consumed` barriers), the rest use one.
CASES = [(16, 4, 64, 2, True, None, 1), (64, 8, 128, 2, False, None, 0), (64, 8, 128, 1, False, 3, 0),
         (16, 1, 128, 1, False, None, 0), (64, 4, 64, 1, False, 4, 1)]


@pytest.mark.parametrize("ps,g,d,nw,pp,progs,first", CASES)
def test_prefill_kernel_matches_reference(paged_case, ps, g, d, nw, pp, progs, first):
    qlens = [3, 21, 1, 9]                    # ragged chunks; tiles are 64 * nw // g tokens
    before = [5, 0, 70, 130]                 # earlier cached positions, none a multiple of the block
    c = paged_case(kv_heads=1 if nw > 1 else 2, group=g, head_dim=d, page_size=ps,
                   seq_lens=np.add(qlens, before))
    t = sum(qlens) + 3                       # padding tokens at the end
    q = c.queries(t)
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    args = (q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens), qs, jnp.int32(first))
    out = paged_prefill_attention(*args, scale=c.scale, num_ctas=progs, num_warpgroups=nw, pingpong=pp,
                                  block_kv=64, num_stages=2, interpret=True)
    ref = paged_prefill_attention_ref(*args, c.scale)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), f"seed {c.seed}"
    assert c.rel_err(out, ref) < 1e-2, f"seed {c.seed}"
    assert np.all(out[:qlens[0] if first else 0] == 0) and np.all(out[sum(qlens):] == 0)


def test_prefill_reference_matches_mixed_reference(paged_case):
    qlens, before = [4, 9], [3, 20]
    c = paged_case(kv_heads=2, group=4, head_dim=64, page_size=16, seq_lens=np.add(qlens, before))
    q = c.queries(sum(qlens))
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    a = paged_prefill_attention_ref(q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens), qs,
                                    jnp.int32(0), c.scale)
    pos = np.concatenate([np.arange(b, b + n) for b, n in zip(before, qlens)])
    seq = np.repeat(np.arange(len(qlens)), qlens)
    b = ragged_paged_attention_ref(q, c.k[c.layer], c.v[c.layer], jnp.asarray(pos), jnp.asarray(seq),
                                   c.page_table, jnp.asarray(c.seq_lens), c.scale)
    assert c.rel_err(a, b) < 1e-2


@pytest.mark.parametrize("ps,h,kvh,d,kw", [(16, 32, 8, 128, {}), (64, 32, 8, 128, {"block_kv": 64, "num_stages": 3}),
                                           (16, 8, 8, 64, {"num_ctas": 132, "num_warpgroups": 1})])
def test_prefill_kernel_lowers_for_gpu(ps, h, kvh, d, kw):
    sds = jax.ShapeDtypeStruct
    cache = sds((2, 4096, ps, kvh, d), jnp.bfloat16)
    args = (sds((2048, h, d), jnp.bfloat16), cache, cache, sds((), jnp.int32), sds((4, 256), jnp.int32),
            sds((4,), jnp.int32), sds((5,), jnp.int32), sds((), jnp.int32))
    paged_prefill_attention.trace(*args, scale=d ** -0.5, **kw).lower(lowering_platforms=("cuda",))
