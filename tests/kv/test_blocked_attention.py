"""The kernel-less attention path (blocked online softmax, trip count bounded by the longest sequence) against
the pure-jnp reference, on mixed batches whose sequences span several blocks and whose page tables are much
wider than the sequences (the context of a real model)."""
import jax.numpy as jnp
import numpy as np
import pytest

from nfjax.config import pages_for
from nfjax.kv.blocked_attention import BLOCK_POSITIONS, blocked_paged_attention
from nfjax.kv.metadata import build_metadata
from pallas_kernels.ragged_paged_attention_ref import ragged_paged_attention_ref


def _case(rng, specs, num_tokens, max_seqs, max_pages, ps, kvh, g, d):
    need = [pages_for(a + n, ps) for a, n in specs]
    n_pages = sum(need) + 2
    k = jnp.asarray(rng.standard_normal((n_pages, ps, kvh, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n_pages, ps, kvh, d)), jnp.float32)
    perm = rng.permutation(np.arange(1, n_pages))
    seqs, off = [], 0
    for (a, n), c in zip(specs, need):
        seqs.append((perm[off:off + c].tolist(), a, n))
        off += c
    nd = next((i for i, (_, n) in enumerate(specs) if n != 1), len(specs))
    meta = build_metadata(seqs, num_tokens, max_seqs, max_pages, ps, num_decode=nd).to_device()
    q = jnp.asarray(rng.standard_normal((num_tokens, kvh * g, d)), jnp.float32)
    args = (q, k, v, meta.positions, meta.token_seq, meta.page_table, meta.seq_lens, d ** -0.5)
    return args, sum(n for _, n in specs)


@pytest.mark.parametrize("ps,kvh,g,d", [(16, 1, 4, 64), (64, 2, 1, 32), (16, 3, 3, 64)])
def test_blocked_matches_reference_on_mixed_batch(ps, kvh, g, d):
    rng = np.random.default_rng(ps * 7 + kvh * 3 + g)
    # Decodes past one and two blocks, a fresh chunk, a chunk after a long cache, padding tokens and rows
    # (padding tokens belong to row 0: don't-care, as in the reference).
    specs = [(2 * BLOCK_POSITIONS + 37, 1), (5, 1), (BLOCK_POSITIONS - 1, 1), (0, 11), (BLOCK_POSITIONS + 3, 20)]
    max_pages = pages_for(4 * BLOCK_POSITIONS, ps)       # wider than any sequence here
    args, live = _case(rng, specs, num_tokens=40, max_seqs=7, max_pages=max_pages, ps=ps, kvh=kvh, g=g, d=d)
    out = np.asarray(blocked_paged_attention(*args))
    ref = np.asarray(ragged_paged_attention_ref(*args))
    np.testing.assert_allclose(out[:live], ref[:live], rtol=2e-5, atol=2e-5)


def test_blocked_with_no_sequences_is_zero():
    rng = np.random.default_rng(1)
    args, _ = _case(rng, [], num_tokens=4, max_seqs=2, max_pages=3, ps=16, kvh=1, g=2, d=16)
    assert np.all(np.asarray(blocked_paged_attention(*args)) == 0)
