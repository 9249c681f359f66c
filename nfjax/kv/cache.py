"""Device KV arrays for all layers, stacked so the layer loop can carry them and update in place.

The cache's format is `CacheConfig.kv_dtype` (pallas_kernels/kv_quant.py): unquantized values, or fp8 / int8 /
int4 values with one bfloat16 `aux` row of scales (and int8 / int4 centers) per token and kv head; kivi64 and fp8r
also keep each sequence's filling group of K in bfloat16 (`k_tail`, nfjax/kv/kivi64.py; fp8r's V too, `v_tail`).
K and V are quantized here, where they enter the cache (`write`); attention dequantizes what it reads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from nfjax.config import CacheConfig, ConfigError, ModelConfig
from nfjax.kv import kivi64
from nfjax.kv.metadata import AttentionMetadata
from pallas_kernels import kv_quant


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: Float[Array, "L N PS KH D"]   # layers x pages x page_size x kv_heads x head_dim
    v: Float[Array, "L N PS KH D"]
    aux: Float[Array, "L N PS KH W"] | None = None      # quantized formats: scales (and centers), bfloat16
    kv_dtype: str = field(default="bfloat16", metadata=dict(static=True))
    # kivi64, fp8r: the K group each sequence is filling, bfloat16, by tail row (AttentionMetadata.kv_tail); not a
    # page array, so not in `arrays()` (swapping moves a sequence's row beside its pages: nfjax/kv/tail_slots.py)
    k_tail: Float[Array, "L R G KH D"] | None = None
    v_tail: Float[Array, "L R G KH D"] | None = None        # fp8r: V of the same positions, bfloat16 (kivi64: none)

    @staticmethod
    def create(model: ModelConfig, cache: CacheConfig, dtype=None, sharding=None, tail_rows: int = 0) -> "KVCache":
        """`tail_rows`: the K tail rows of a format with a tail (kv_quant.TAIL_FORMATS: sequences that may hold a
        filling group at once; >= 1 for it)."""
        fmt = cache.kv_dtype
        check_format(model, fmt)
        lead = (model.num_layers, cache.num_pages, cache.page_size, model.num_kv_heads)
        width = kv_quant.value_width(fmt, model.head_dim)          # int4: two values a byte
        dt = kv_quant.value_dtype(fmt, dtype or model.dtype)
        mk = jax.jit(lambda: jnp.zeros(lead + (width,), dt), out_shardings=sharding)
        aux = None
        if kv_quant.is_quantized(fmt):
            w = kv_quant.aux_width(fmt, model.head_dim)
            aux = jax.jit(lambda: jnp.zeros(lead + (w,), kv_quant.AUX_DTYPE), out_shardings=sharding)()
        tail = v_tail = None
        if kv_quant.has_tail(fmt):
            if tail_rows < 1:
                raise ValueError(f"a {fmt} cache needs tail_rows >= 1 (its sequences' filling K groups)")
            shape = (model.num_layers, tail_rows, kivi64.GROUP, model.num_kv_heads, model.head_dim)
            mk_tail = jax.jit(lambda: jnp.zeros(shape, jnp.bfloat16), out_shardings=sharding)
            tail = mk_tail()
            v_tail = mk_tail() if fmt in kv_quant.V_TAIL_FORMATS else None
        return KVCache(mk(), mk(), aux, fmt, tail, v_tail)

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def arrays(self) -> tuple:
        """The device arrays (values, then aux when quantized): what swapping moves, as they are."""
        return (self.k, self.v) if self.aux is None else (self.k, self.v, self.aux)

    def with_arrays(self, arrays) -> "KVCache":
        arrays = tuple(arrays)
        return KVCache(arrays[0], arrays[1], arrays[2] if len(arrays) > 2 else None, self.kv_dtype, self.k_tail,
                       self.v_tail)

    def like(self, leaf) -> "KVCache":
        """This cache's structure with `leaf` (a sharding, a PartitionSpec) in place of every array."""
        out = self.with_arrays([leaf] * len(self.arrays()))
        if self.k_tail is None:
            return out
        return dataclasses.replace(out, k_tail=leaf, v_tail=None if self.v_tail is None else leaf)

    def take_pages(self, pages: Int[Array, "P"]) -> tuple:
        """Every array's rows of `pages` (all layers), as stored: swapping moves compressed pages and their
        aux rows as they are."""
        return tuple(a[:, pages] for a in self.arrays())

    def put_pages(self, pages: Int[Array, "P"], blocks) -> "KVCache":
        """`take_pages`'s blocks written back at `pages` (page ids past the cache are dropped)."""
        return self.with_arrays(a.at[:, pages].set(b, mode="drop")
                                for a, b in zip(self.arrays(), blocks))

    def write(self, layer: Int[Array, ""], slots: Int[Array, "T"], k: Float[Array, "T KH D"],
              v: Float[Array, "T KH D"], meta: AttentionMetadata | None = None) -> "KVCache":
        """Slots past the cache (padding tokens, see `build_metadata`) are dropped; all slots are distinct.
        `meta`: the step's (or nano-batch's) metadata, which a format with a tail needs (its K groups follow the
        sequences)."""
        if kv_quant.has_tail(self.kv_dtype) and meta is None:
            raise ValueError(f"a {self.kv_dtype} cache write needs the step's AttentionMetadata")
        if self.kv_dtype == "kivi64":
            return kivi64.write(self, layer, slots, k, v, meta)
        ps = self.page_size
        page, off = slots // ps, slots % ps
        put = dict(mode="drop", unique_indices=True)
        if self.aux is None:
            return KVCache(self.k.at[layer, page, off].set(k.astype(self.k.dtype), **put),
                           self.v.at[layer, page, off].set(v.astype(self.v.dtype), **put))
        if self.kv_dtype == "fp8_page":
            return self._write_page_scaled(layer, page, off, k, v)
        kq, vq, aux = kv_quant.quantize_kv(self.kv_dtype, k, v)
        tails = (self.k_tail, self.v_tail) if self.k_tail is None else kivi64.write_tail(self, layer, slots, k, meta, v)
        return KVCache(self.k.at[layer, page, off].set(kq, **put), self.v.at[layer, page, off].set(vq, **put),
                       self.aux.at[layer, page, off].set(aux, **put), self.kv_dtype, *tails)

    def _write_page_scaled(self, layer, page, off, k, v) -> "KVCache":
        """fp8 with one scale per page and kv head (accuracy comparison only): the layer is dequantized, the
        new rows set, and every page requantized, with its scale unchanged while it still holds the page's amax
        (the same codes back), else with the amax's (the earlier rows are rounded again). Costs the whole layer."""
        put = dict(mode="drop", unique_indices=True)
        aux = self.aux[layer]
        outs = []
        for vals, new, col in ((self.k[layer], k, 0), (self.v[layer], v, 1)):
            x = kv_quant.dequantize_fp8(vals, aux[..., col])                      # [N, PS, KH, D]
            x = x.at[page, off].set(new.astype(jnp.float32), **put)
            amax = jnp.abs(x).max(axis=(1, 3))                                      # [N, KH]
            old = aux[..., col].astype(jnp.float32).max(axis=1)                     # the page's scale (0: fresh)
            # keep a scale that still holds the page: requantizing with it gives the same codes back (a scale
            # recomputed from dequantized values would shrink, and re-round every page at every write)
            scale = jnp.where((old > 0) & (amax <= kv_quant.FP8_MAX * old), old, kv_quant.fp8_scale(amax))
            scale = jnp.broadcast_to(scale[:, None, :], x.shape[:3])
            q, _ = kv_quant.quantize_fp8(x, scale)
            outs.append((q, scale))
        (kq, ks), (vq, vs) = outs
        aux = aux.at[..., 0].set(ks.astype(aux.dtype)).at[..., 1].set(vs.astype(aux.dtype))
        return KVCache(self.k.at[layer].set(kq), self.v.at[layer].set(vq), self.aux.at[layer].set(aux),
                       self.kv_dtype)

    def layer_pages(self, layer) -> tuple:
        """(k, v, aux) of one layer: [N, PS, KH, D] values as stored, aux [N, PS, KH, W] or None."""
        return self.k[layer], self.v[layer], None if self.aux is None else self.aux[layer]

    def tail_rows(self, layer, rows: Int[Array, "S"]) -> Float[Array, "S G KH D"] | None:
        """A format with a tail: its K tail rows `rows` of one layer (None for the other formats)."""
        return None if self.k_tail is None else self.k_tail[layer][rows]

    def v_tail_rows(self, layer, rows: Int[Array, "S"]) -> Float[Array, "S G KH D"] | None:
        """fp8r: its V tail rows `rows` of one layer (None for the other formats)."""
        return None if self.v_tail is None else self.v_tail[layer][rows]


def check_format(model: ModelConfig, kv_dtype: str) -> None:
    """A ConfigError naming the flag and the choices for a format this model cannot hold."""
    if kv_dtype not in kv_quant.ALL_KV_DTYPES:
        raise ConfigError(f"cache.kv_dtype (--kv-dtype) {kv_dtype!r} is not a KV format; choices: "
                          f"{', '.join(kv_quant.KV_DTYPES)}")
    if kv_dtype in kv_quant.GROUPED and model.head_dim % kv_quant.GROUP:
        raise ConfigError(f"--kv-dtype {kv_dtype} needs head_dim a multiple of {kv_quant.GROUP} (its groups); this "
                          f"model's is {model.head_dim}; choices: {', '.join(kv_quant.KV_DTYPES)}")


def bytes_per_token(model: ModelConfig, dtype=None, kv_dtype: str = "bfloat16") -> float:
    """KV bytes one token holds across all layers (K and V, scales included)."""
    return model.num_layers * model.num_kv_heads * kv_quant.token_head_bytes(kv_dtype, model.head_dim,
                                                                             dtype or model.dtype)


def device_memory(device=None) -> dict | None:
    """The allocator's figures that size the cache (bytes in use and limit, the largest free block where the
    runtime reports it); None where the device keeps no statistics."""
    stats = (device or jax.devices()[0]).memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    keys = ("bytes_in_use", "bytes_limit", "largest_free_block_bytes", "num_allocs", "peak_bytes_in_use")
    return {k: int(stats[k]) for k in keys if k in stats}


def free_device_bytes(device=None) -> int | None:
    """Device memory not yet in use (None: the device keeps no statistics, as a CPU)."""
    dev = device or jax.devices()[0]
    stats = dev.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
