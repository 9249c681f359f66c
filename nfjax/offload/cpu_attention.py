"""Decode attention on the CPU (FlexGen section 4.2, policy `cpu_attention`).

When a (layer, GPU batch) KV block lives in host memory or on disk, a decode step moving the whole block to the
device to attend one query a sequence moves far more than the attention computes. Instead the layer runs as two
device programs around a CPU computation (nfjax/offload/compute.py `pre_attention` / `post_attention`): the first
gives q and the step's new K/V rows, which cross to the host (the rows are stored there anyway); the CPU writes
the rows into the block and attends over it; the attention output crosses back for the second program. Only q,
the new rows and the attention output cross the bus (per sequence and layer: H x D values each way), not the
block.

The CPU work is split into pieces run on a thread pool of one thread a core: each sequence's live positions in
chunks of about 4 MB of K (`chunk_positions`; the last one shorter; flash-decoding: each piece gives its softmax
max, sum and weighted values, combined here), so that the cores share a block. Chunks past a sequence's last
query are not read. An unquantized block's pieces are numpy (BLAS matmuls, casts and exponentials run outside the
GIL); an int4 block's are one XLA CPU program each, the same dequantization and rotation the device runs. Top-K
sparse attention needs each row's scores whole, so it splits by sequence only, through `dense_attention` (the
device's function).

Measured (bench/probes/cpu_attention_rate.py, GB/s of KV): on the H100 host's 16 cores, OPT-30B blocks of 8
sequences ran at 9.0 in 256-position pieces, 7.5 in 128, 3.6 in 64, against 0.7-1.1 for one XLA program over the
block (which uses one core; XLA CPU programs from several threads do not run at once either: 2.6 in pieces). A
piece's Python part holds the GIL, hence large pieces; on a 2-core machine, where cache matters more, 128-position
pieces ran at 7.2 and 256 at 3.7.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from nfjax.offload.compute import BatchKV, dense_attention
from pallas_kernels import MASK_VALUE, kv_quant

PIECE_BYTES = 4 * 2 ** 20    # a piece's K bytes (H100 host, 16 cores: 4 MB pieces ran 1.3-5x faster than 0.5 MB)


@partial(jax.jit, static_argnums=(3, 4))
def _attend(q, arrays, positions, scale: float, topk: float):
    return dense_attention(q, BatchKV(tuple(arrays)), positions, scale, topk)


def _partial_softmax(xp, q, k, v, positions, start, scale: float) -> tuple:
    """q [T, H, D], k / v [C, KH, D] (float32) at positions [start, start + C), with numpy or jax.numpy as `xp` ->
    (max, sum) [T, KH, G] and the unnormalized output [T, KH, G, D] (a chunk with none of a row's positions gives
    that row max = MASK_VALUE, which the combination weighs by exp(MASK_VALUE - max) = 0). The matmuls take K and V
    in their stored layout, so numpy hands them to BLAS without a copy."""
    c, kh, d = k.shape
    t, h = q.shape[:2]
    g = h // kh
    qg = q.reshape(t, kh, g, d).transpose(1, 0, 2, 3).reshape(kh, t * g, d)
    scores = xp.matmul(qg, k.transpose(1, 2, 0)).reshape(kh, t, g, c) * xp.float32(scale)
    ok = start + xp.arange(c)[None, :] <= positions[:, None]                           # [T, C]
    scores = xp.where(ok[None, :, None], scores, xp.float32(MASK_VALUE))
    m = scores.max(-1)
    p = xp.exp(scores - m[..., None])
    out = xp.matmul(p.reshape(kh, t * g, c), v.transpose(1, 0, 2)).reshape(kh, t, g, d)
    return m.transpose(1, 0, 2), p.sum(-1).transpose(1, 0, 2), out.transpose(1, 0, 2, 3)


@partial(jax.jit, static_argnums=(4,))
def _piece(q: Float[Array, "T H D"], arrays: tuple, positions: Int[Array, "T"], start: Int[Array, ""],
           scale: float) -> tuple:
    """One sequence's queries over positions [start, start + C) of its block (arrays [1, C, KH, ...], any format
    `BatchKV` reads: dequantized and, where stored rotated, the queries rotated) -> `_partial_softmax`'s."""
    kv = BatchKV(tuple(arrays))
    k, v = kv.dense()
    if kv_quant.rotates(kv.kv_dtype):
        q = kv_quant.rotate(q)
    return _partial_softmax(jnp, q.astype(jnp.float32), k[0], v[0], positions, start, scale)


THREADS = max(1, os.cpu_count() or 1)


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(THREADS, thread_name_prefix="nfjax-cpu-attn")


def cpu_device():
    return jax.devices("cpu")[0]


def _sequence(q, arrays, positions, i: int, scale: float, topk: float) -> np.ndarray:
    """Row i's queries over its whole block (the Top-K path): [T, H*D]."""
    cpu = cpu_device()
    args = jax.device_put((q, tuple(a[i:i + 1] for a in arrays), positions[i:i + 1]), cpu)
    return np.asarray(_attend(*args, scale, topk))


def _numpy_piece(q: np.ndarray, arrays: tuple, positions: np.ndarray, i: int, start: int, size: int,
                 scale: float) -> tuple:
    """`_piece` in numpy for an unquantized block (K, V [B, S, KH, D]): its matmuls run in BLAS and its casts and
    exponentials outside the GIL, so the pieces of a pool run at once (one XLA CPU program at a time did not)."""
    k, v = (a[i, start:start + size].astype(np.float32) for a in arrays[:2])        # [C, KH, D]
    return _partial_softmax(np, q.astype(np.float32), k, v, positions[i], start, scale)


def _chunk(q, arrays, positions, i: int, start: int, size: int, scale: float) -> tuple:
    if len(arrays) == 2:
        return _numpy_piece(q, arrays, positions, i, start, size, scale)
    cpu = cpu_device()
    args = jax.device_put((q, tuple(a[i:i + 1, start:start + size] for a in arrays), positions[i],
                           np.int32(start)), cpu)
    return tuple(np.asarray(x) for x in _piece(*args, scale))


def _combine(parts: list, rotated: bool) -> np.ndarray:
    """Pieces of one sequence -> its output [T, H*D] (float32)."""
    m = np.stack([p[0] for p in parts])                       # [P, T, KH, G]
    top = m.max(0)
    w = np.exp(m - top)
    total = (w * np.stack([p[1] for p in parts])).sum(0)
    out = (w[..., None] * np.stack([p[2] for p in parts])).sum(0) / total[..., None]    # [T, KH, G, D]
    t = out.shape[0]
    out = out.reshape(t, -1, out.shape[-1])
    if rotated:           # the rotation is linear: applied once to the combined output
        out = np.asarray(kv_quant.rotate(jax.device_put(out, cpu_device())))
    return out.reshape(t, -1)


def chunk_positions(k: np.ndarray) -> int:
    """Positions a piece attends over: the power of two (>= 64) nearest below `PIECE_BYTES` of K. Python's part of
    a piece holds the GIL, so pieces must be large; on the H100 host this beat pieces sized to keep every core
    busy (OPT-30B, 2 sequences: 6 pieces of 256 positions 6.0 GB/s, 18 of 64 3.6 GB/s)."""
    return piece_positions(k.nbytes // (k.shape[0] * k.shape[1]))


def piece_positions(row_bytes: int) -> int:
    """`chunk_positions` for K of `row_bytes` a position."""
    return max(64, 2 ** int(np.log2(max(1, PIECE_BYTES // row_bytes))))


def piece_count(batch: int, live: int, row_bytes: int) -> int:
    """Pieces `cpu_attention` splits a block of `batch` sequences of `live` positions into (K of `row_bytes` a
    position): the number of threads it can keep busy."""
    return batch * -(-live // piece_positions(row_bytes))


def cpu_attention(q: Float[Array, "BT H D"] | np.ndarray, arrays: tuple, positions: Int[Array, "B T"] | np.ndarray,
                  scale: float, topk: float = 1.0) -> np.ndarray:
    """q [B*T, H, D] (any device, or numpy) and a KV block's host arrays (numpy or memory-mapped: K, V [B, S, KH,
    D], or int4 codes and their scale rows) -> the attention output [B*T, H*D] as numpy, computed on the CPU."""
    q = np.asarray(q)
    arrays = tuple(np.asarray(a) for a in arrays)
    positions = np.asarray(positions, np.int32)
    b, t = positions.shape
    qs = q.reshape(b, t, *q.shape[1:])
    scale, topk = float(scale), float(topk)
    pool = _pool()
    if topk < 1.0:
        rows = list(pool.map(lambda i: _sequence(qs[i], arrays, positions, i, scale, topk), range(b)))
        return np.concatenate(rows).astype(q.dtype)
    live = [int(positions[i].max()) + 1 for i in range(b)]
    size = chunk_positions(arrays[0])
    jobs = [(i, start) for i in range(b) for start in range(0, live[i], size)]
    parts = list(pool.map(lambda job: _chunk(qs[job[0]], arrays, positions, job[0], job[1], size, scale), jobs))
    rotated = kv_quant.rotates(BatchKV(arrays).kv_dtype)
    rows = [_combine([p for (i, _), p in zip(jobs, parts) if i == row], rotated) for row in range(b)]
    return np.concatenate(rows).astype(q.dtype)


BENCH_BLOCK = (8, 1024, 16, 128)          # cpu_attention_bench's K and V: sequences, positions, KV heads, head_dim


def cpu_attention_bench(rate, dtype="bfloat16", sequences: int | None = None) -> float:
    """KV bytes a second `cpu_attention` reads, on a decode-shaped block `BENCH_BLOCK` of 8 sequences (or
    `sequences`) at their last position (64 MB in bfloat16: larger than a CPU's last-level cache, as the
    runtime's blocks are)."""
    dt = np.dtype(jax.numpy.dtype(dtype))
    (b, s, kh, d), h = BENCH_BLOCK, 32
    b = sequences or b
    rng = np.random.default_rng(0)
    k = rng.standard_normal((b, s, kh, d), np.float32).astype(dt)
    v = rng.standard_normal((b, s, kh, d), np.float32).astype(dt)
    q = rng.standard_normal((b, h, d), np.float32).astype(dt)
    pos = np.full((b, 1), s - 1, np.int32)
    return rate(k.nbytes + v.nbytes, lambda: cpu_attention(q, (k, v), pos, d ** -0.5), max_reps=10)
