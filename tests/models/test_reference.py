"""The reference forward (`nfjax.models.reference`) against the paged forward of the same weights: a prefill of
two sequences, then decode steps that read their K/V back from the cache pages."""
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nfjax import train_tiny as tt
from nfjax.config import CacheConfig
from nfjax.kv.cache import KVCache
from nfjax.kv.metadata import build_metadata
from nfjax.models import reference
from nfjax.models.llama import LlamaModel

MICRO = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


def test_reference_forward_matches_paged_forward():
    cfg = tt.tiny_model_config(**MICRO)
    model = LlamaModel(cfg, nnx.Rngs(1))
    rows = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 40)).astype(np.int32)
    dense = np.asarray(reference.logits(model, jnp.asarray(rows)))
    ps, n = 16, 3
    kv = KVCache.create(cfg, CacheConfig(page_size=ps, num_pages=1 + 2 * n, max_pages_per_seq=n))
    meta = build_metadata([([1, 2, 3], 0, 40), ([4, 5, 6], 0, 40)], 96, 2, n, ps).to_device()
    tokens = np.zeros(96, np.int32)
    tokens[:80] = rows.reshape(-1)
    h, _ = model(jnp.asarray(tokens), kv, meta)
    paged = np.asarray(model.logits(h))[:80].reshape(2, 40, -1)
    np.testing.assert_allclose(dense, paged, atol=2e-5, rtol=1e-4)


def test_reference_forward_matches_paged_decode_steps():
    """Prefill 30 tokens of each sequence, then one token per step for both: every step's logits are the
    reference's at that position (the decode rows read the prefill's K/V across a page boundary)."""
    cfg = tt.tiny_model_config(**MICRO)
    model = LlamaModel(cfg, nnx.Rngs(2))
    rows = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 40)).astype(np.int32)
    dense = np.asarray(reference.logits(model, jnp.asarray(rows)))
    ps, n, prompt = 16, 3, 30
    pages = [[1, 2, 3], [4, 5, 6]]
    kv = KVCache.create(cfg, CacheConfig(page_size=ps, num_pages=1 + 2 * n, max_pages_per_seq=n))

    @nnx.jit
    def step(model, tokens, kv, meta):
        h, kv = model(tokens, kv, meta)
        return model.logits(h), kv

    tokens = np.zeros(64, np.int32)
    tokens[:2 * prompt] = rows[:, :prompt].reshape(-1)
    meta = build_metadata([(pages[0], 0, prompt), (pages[1], 0, prompt)], 64, 2, n, ps).to_device()
    out, kv = step(model, jnp.asarray(tokens), kv, meta)
    got = [np.asarray(out)[:2 * prompt].reshape(2, prompt, -1)]
    for pos in range(prompt, 40):
        tokens = np.zeros(64, np.int32)
        tokens[:2] = rows[:, pos]
        meta = build_metadata([(pages[0], pos, 1), (pages[1], pos, 1)], 64, 2, n, ps, num_decode=2).to_device()
        out, kv = step(model, jnp.asarray(tokens), kv, meta)
        got.append(np.asarray(out)[:2, None])
    np.testing.assert_allclose(dense, np.concatenate(got, axis=1), atol=2e-5, rtol=1e-4)


def test_greedy_stops_and_pads():
    """`generate` stops before a stop token; the padding width does not change the tokens (causal)."""
    cfg = tt.tiny_model_config(**MICRO)
    model = LlamaModel(cfg, nnx.Rngs(3))
    a = reference.greedy(model, [256, 5, 6, 7], 10, width=16)
    assert reference.greedy(model, [256, 5, 6, 7], 10, width=128) == a
    assert reference.generate(model, [256, 5, 6, 7], 10, stop_ids=(a[3],)) == a[:a.index(a[3])]
