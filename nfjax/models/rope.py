"""Rotary position embedding (HF "rotate_half" layout) with Llama-3 / linear frequency scaling."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from nfjax.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[head_dim // 2] inverse frequencies, float64 on the host (computed once per model)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "linear":
        return inv / rs.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    wl = 2 * math.pi / inv
    smooth = (rs.original_max_position_embeddings / wl - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * inv / rs.factor + smooth * inv
    return np.where(wl > low_wl, inv / rs.factor, np.where(wl < high_wl, inv, blended))


def apply_rope(x: Float[Array, "T H D"], positions: Int[Array, "T"],
               inv_freq: Float[Array, "D2"]) -> Float[Array, "T H D"]:
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]          # [T, D/2]
    cos = jnp.cos(ang)[:, None, :]
    sin = jnp.sin(ang)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
