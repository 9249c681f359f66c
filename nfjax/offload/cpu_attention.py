"""Decode attention on the CPU (FlexGen section 4.2, policy `cpu_attention`).

When a (layer, GPU batch) KV block lives in host memory or on disk, a decode step moving the whole block to the
device to attend one query a sequence moves far more than the attention computes. Instead the layer runs as two
device programs around a CPU computation (nfjax/offload/compute.py `pre_attention` / `post_attention`): the first
gives q and the step's new K/V rows, which cross to the host (the rows are stored there anyway); the CPU writes
the rows into the block and attends over it; the attention output crosses back for the second program. Only q,
the new rows and the attention output cross the bus (per sequence and layer: H x D values each way), not the
block.

The CPU computation is the same function the device runs (`dense_attention`: f32 softmax, the int4 format
dequantized, Top-K when set), compiled for JAX's CPU backend, whose thread pool spreads it over the cores.
"""
from __future__ import annotations

from functools import partial

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from nfjax.offload.compute import BatchKV, dense_attention


@partial(jax.jit, static_argnums=(3, 4))
def _attend(q, arrays, positions, scale: float, topk: float):
    return dense_attention(q, BatchKV(tuple(arrays)), positions, scale, topk)


def cpu_device():
    return jax.devices("cpu")[0]


def cpu_attention(q: Float[Array, "BT H D"] | np.ndarray, arrays: tuple, positions: Int[Array, "B T"] | np.ndarray,
                  scale: float, topk: float = 1.0) -> np.ndarray:
    """q [B*T, H, D] (any device, or numpy) and a KV block's host arrays (numpy or memory-mapped: K, V [B, S, KH,
    D], or int4 codes and their scale rows) -> the attention output [B*T, H*D] as numpy, computed on the CPU."""
    cpu = cpu_device()
    q, arrays, positions = jax.device_put((np.asarray(q), tuple(np.asarray(a) for a in arrays),
                                           np.asarray(positions, np.int32)), cpu)
    return np.asarray(_attend(q, arrays, positions, float(scale), float(topk)))


def cpu_attention_bench(rate, dtype="bfloat16") -> float:
    """KV bytes a second `cpu_attention` reads, on a decode-shaped block [4, 512, 8, 64] (32 query heads)."""
    dt = np.dtype(jax.numpy.dtype(dtype))
    b, s, kh, h, d = 4, 512, 8, 32, 64
    rng = np.random.default_rng(0)
    k = rng.standard_normal((b, s, kh, d), np.float32).astype(dt)
    v = rng.standard_normal((b, s, kh, d), np.float32).astype(dt)
    q = rng.standard_normal((b, h, d), np.float32).astype(dt)
    pos = np.full((b, 1), s - 1, np.int32)
    return rate(k.nbytes + v.nbytes, lambda: cpu_attention(q, (k, v), pos, d ** -0.5), max_reps=10)
