"""The nano-batch metadata drives the GPU attention kernels right: for nano-batches that cut a decode run and a
prefill chunk, the kernel path (Mosaic GPU interpret mode) on the rebased metadata gives the rows that the
reference gives for the whole batch."""
import jax.numpy as jnp
import numpy as np
import pytest

from nfjax.config import pages_for
from nfjax.kv.attention import paged_attention
from nfjax.kv.cache import KVCache
from nfjax.kv.metadata import build_metadata
from nfjax.schedule.meta import nano_metadata


@pytest.mark.parametrize("lo,hi", [(1, 14), (14, 32)], ids=["cuts-decodes-and-a-chunk", "starts-mid-chunk"])
def test_kernels_on_nano_metadata_match_the_full_batch(lo, hi):
    rng = np.random.default_rng(0)
    ps, kvh, g, d = 16, 1, 4, 64
    specs = [(40, 1), (3, 1), (17, 1), (0, 9), (20, 14)]          # 3 decodes, then 2 prefill chunks
    need = [pages_for(a + n, ps) for a, n in specs]
    shape = (1, sum(need) + 2, ps, kvh, d)
    kv = KVCache(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
                 jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
    seqs, page = [], 1
    for (a, n), k in zip(specs, need):
        seqs.append((list(range(page, page + k)), a, n))
        page += k
    meta = build_metadata(seqs, 32, 6, 3, ps, num_decode=3).to_device()
    q = jnp.asarray(rng.standard_normal((32, kvh * g, d)), jnp.bfloat16)
    layer = jnp.int32(0)
    live = min(hi, 3 + 9 + 14) - lo                                 # padding rows are don't-care
    ref = np.asarray(paged_attention(q, kv, layer, meta, 0.125, use_kernels=False)[lo:lo + live], np.float64)
    out = paged_attention(q[lo:hi], kv, layer, nano_metadata(meta, lo, hi), 0.125, use_kernels=True,
                          interpret=True, num_ctas=2)
    o = np.asarray(out[:live], np.float64)
    assert np.isfinite(o).all()
    assert np.linalg.norm(o - ref) / np.linalg.norm(ref) < 1e-2
