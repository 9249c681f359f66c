"""The engine's attention entry point: kernel path (Mosaic GPU interpret mode) vs reference path on a mixed
step batch (decodes first, prefill chunks, padding), built with the engine's own metadata builder."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nfjax.config import pages_for
from nfjax.kv.attention import paged_attention
from nfjax.kv.cache import KVCache
from nfjax.kv.metadata import build_metadata


def _batch(rng, specs, num_tokens, max_seqs, max_pages, ps=16, kvh=1, g=4, d=64):
    need = [pages_for(a + n, ps) for a, n in specs]
    n_pages = sum(need) + 2
    shape = (2, n_pages, ps, kvh, d)
    kv = KVCache(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
                 jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
    perm = rng.permutation(np.arange(1, n_pages))
    seqs, off = [], 0
    for (a, n), k in zip(specs, need):
        seqs.append((perm[off:off + k].tolist(), a, n))
        off += k
    nd = next((i for i, (_, n) in enumerate(specs) if n != 1), len(specs))
    meta = build_metadata(seqs, num_tokens, max_seqs, max_pages, ps, num_decode=nd).to_device()
    q = jnp.asarray(rng.standard_normal((num_tokens, kvh * g, d)), jnp.bfloat16)
    return q, kv, meta, sum(n for _, n in specs)


@pytest.mark.parametrize("max_prefill_seqs", [None, 2])
def test_kernel_path_matches_reference_on_mixed_batch(max_prefill_seqs):
    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    rng = np.random.default_rng(seed)
    specs = [(40, 1), (3, 1), (0, 9), (20, 14)]          # (cached before, new tokens): 2 decodes, 2 chunks
    q, kv, meta, live = _batch(rng, specs, num_tokens=28, max_seqs=5, max_pages=5)
    layer = jnp.int32(1)
    ref = paged_attention(q, kv, layer, meta, 0.125, use_kernels=False)
    out = paged_attention(q, kv, layer, meta, 0.125, use_kernels=True, interpret=True, num_ctas=3,
                          max_prefill_seqs=max_prefill_seqs)
    o, r = np.asarray(out[:live], np.float64), np.asarray(ref[:live], np.float64)
    assert np.isfinite(o).all(), f"seed {seed}"
    assert np.linalg.norm(o - r) / np.linalg.norm(r) < 1e-2, f"seed {seed}"


def test_default_is_reference_on_cpu():
    rng = np.random.default_rng(0)
    q, kv, meta, _ = _batch(rng, [(5, 1), (0, 4)], num_tokens=8, max_seqs=2, max_pages=2)
    a = paged_attention(q, kv, jnp.int32(0), meta, 0.125)
    b = paged_attention(q, kv, jnp.int32(0), meta, 0.125, use_kernels=False)
    assert jax.default_backend() != "gpu" and np.array_equal(np.asarray(a), np.asarray(b))
