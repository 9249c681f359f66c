"""Device KV arrays for all layers, stacked so the layer loop can carry them and update in place."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from nfjax.config import CacheConfig, ModelConfig


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: Float[Array, "L N PS KH D"]   # layers x pages x page_size x kv_heads x head_dim
    v: Float[Array, "L N PS KH D"]

    @staticmethod
    def create(model: ModelConfig, cache: CacheConfig, dtype=None, sharding=None) -> "KVCache":
        shape = (model.num_layers, cache.num_pages, cache.page_size, model.num_kv_heads, model.head_dim)
        dt = dtype or jnp.dtype(model.dtype)
        mk = jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=sharding)
        return KVCache(mk(), mk())

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def write(self, layer: Int[Array, ""], slots: Int[Array, "T"], k: Float[Array, "T KH D"],
              v: Float[Array, "T KH D"]) -> "KVCache":
        """Slots past the cache (padding tokens, see `build_metadata`) are dropped; all slots are distinct."""
        ps = self.page_size
        page, off = slots // ps, slots % ps
        put = dict(mode="drop", unique_indices=True)
        return KVCache(self.k.at[layer, page, off].set(k.astype(self.k.dtype), **put),
                       self.v.at[layer, page, off].set(v.astype(self.v.dtype), **put))


def bytes_per_token(model: ModelConfig, dtype=None) -> int:
    """KV bytes one token holds across all layers (K and V)."""
    dt = jnp.dtype(dtype or model.dtype)
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dt.itemsize


def free_device_bytes(device=None) -> int | None:
    """Device memory not yet in use (None: the device keeps no statistics, as a CPU)."""
    dev = device or jax.devices()[0]
    stats = dev.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
