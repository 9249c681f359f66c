"""Random paged-cache inputs for the kernel tests (fresh draws per test, ragged lengths, poisoned outputs
come from the Mosaic GPU interpreter, which fills every buffer it allocates with NaN)."""
import numpy as np
import pytest
import jax.numpy as jnp

from nfjax.config import pages_for


class PagedCase:
    def __init__(self, seed, *, kv_heads, group, head_dim, page_size, seq_lens, layers=2, spare_pages=3,
                 kv_dtype="bfloat16"):
        rng = np.random.default_rng(seed)
        self.rng, self.seed = rng, seed
        self.seq_lens = np.asarray(seq_lens, np.int32)
        need = [pages_for(int(n), page_size) for n in self.seq_lens]
        self.max_pages = max(1, max(need)) + 1                        # one unused column: entries stay 0
        num_pages = sum(need) + spare_pages + 1
        shape = (layers, num_pages, page_size, kv_heads, head_dim)
        self.k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        self.v = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        self.aux = None                     # a quantized cache (kv_quant.py): values as stored + aux rows
        if kv_dtype != "bfloat16":
            from pallas_kernels.kv_quant import quantize_kv
            # K-like rows: a few outlier channels, norms varying by token
            scale = np.exp(rng.standard_normal(shape[:-1] + (1,)) * 0.5)
            k = np.asarray(self.k, np.float32) * scale
            k[..., :2] *= 8.0
            self.k, self.v, self.aux = quantize_kv(kv_dtype, jnp.asarray(k), self.v)
        perm = rng.permutation(np.arange(1, num_pages))                # page 0 is scratch
        table = np.zeros((len(need), self.max_pages), np.int32)
        off = 0
        for i, n in enumerate(need):
            table[i, :n] = perm[off:off + n]
            off += n
        self.page_table = jnp.asarray(table)
        self.heads, self.head_dim = kv_heads * group, head_dim
        self.layer = jnp.int32(layers - 1)
        self.scale = head_dim ** -0.5

    @staticmethod
    def rel_err(out, ref):
        out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
        return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))

    def queries(self, n):
        return jnp.asarray(self.rng.standard_normal((n, self.heads, self.head_dim)), jnp.bfloat16)


@pytest.fixture
def paged_case():
    """Factory of cases with a fresh seed per run (case.seed is in every failure message; set
    NFJAX_TEST_SEED to replay one)."""
    import os
    seed = int(os.environ.get("NFJAX_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 31))
    return lambda **kw: PagedCase(seed, **kw)
