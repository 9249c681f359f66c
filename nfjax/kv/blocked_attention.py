"""Ragged paged attention without kernels (CPU, and GPU shapes the kernels do not take): an online softmax over
blocks of cache positions, looping only as far as the longest sequence of the step.

Why not the reference (pallas_kernels/ragged_paged_attention_ref.py) itself: it gathers every token's whole
page-table row, [T, P x page_size, KH, D] a layer, so its cost follows the page-table width (the model's
context), not the sequences' lengths. SmolLM2 at context 8192 spent 30-40 s on a short chat that way on a 2-core
CPU against 4.3 s at --max-model-len 1024. Here the trip count is a traced value (ceil(max length / block)):
on the CPU a while loop costs nothing to bound at run time; on the GPU this path is the fallback only.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from pallas_kernels.kv_kivi64 import read_pages
from pallas_kernels.kv_quant import dequantize_kv

BLOCK_POSITIONS = 256     # cache positions a loop iteration reads per sequence


def blocked_paged_attention(q: Float[Array, "T H D"], k_pages: Float[Array, "N PS KH D"],
                            v_pages: Float[Array, "N PS KH D"], positions: Int[Array, "T"],
                            token_seq: Int[Array, "T"], page_table: Int[Array, "S P"],
                            seq_lens: Int[Array, "S"], scale: float, aux_pages=None,
                            read_block=None, k_tail=None, v_tail=None) -> Float[Array, "T H D"]:
    """Same contract as `ragged_paged_attention_ref` (quantized pages with their `aux_pages` are dequantized
    block by block); rows whose sequence is empty come back 0. `read_block(pages [S, bp], start)`: the block's K
    and V [S, bp x PS, KH, D] in f32, `start` its first position (default: the pages as stored, dequantized; the
    KV probes read them through other formats). `k_tail` (and `v_tail`) [S, 64, KH, D]: pages of a format with a
    tail (kv_kivi64.read_pages)."""
    t, h, d = q.shape
    _, ps, kh, _ = k_pages.shape
    s, p = page_table.shape
    g = h // kh
    bp = max(1, min(p, BLOCK_POSITIONS // ps))            # pages per block
    nb_static = -(-p // bp)
    table = jnp.pad(page_table, ((0, 0), (0, nb_static * bp - p)))
    width = bp * ps
    qg = q.reshape(t, kh, g, d).astype(jnp.float32) * scale
    tok_len = seq_lens[token_seq]

    def stored(pages, start):
        if k_tail is not None:
            return read_pages(k_pages[pages], v_pages[pages], aux_pages[pages], k_tail, seq_lens, start, v_tail)
        ab = None if aux_pages is None else aux_pages[pages].reshape(s, width, kh, -1)
        return dequantize_kv(k_pages[pages].reshape(s, width, kh, -1), v_pages[pages].reshape(s, width, kh, -1), ab)
    read = read_block or stored

    def body(i, carry):
        m, l, acc = carry
        pages = lax.dynamic_slice_in_dim(table, i * bp, bp, axis=1)                 # [S, bp]
        kb, vb = read(pages, i * width)
        kb, vb = kb[token_seq], vb[token_seq]                                         # [T, B, KH, D] f32
        sc = jnp.einsum("tkgd,tbkd->tkgb", qg, kb)
        j = i * width + jnp.arange(width)
        ok = ((j[None, :] <= positions[:, None]) & (j[None, :] < tok_len[:, None]))[:, None, None, :]
        m_new = jnp.maximum(m, jnp.max(jnp.where(ok, sc, -jnp.inf), axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        pr = jnp.where(ok, jnp.exp(sc - m_safe[..., None]), 0.0)
        corr = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        l = l * corr + pr.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("tkgb,tbkd->tkgd", pr, vb)
        return m_new, l, acc

    zero = qg * 0.0         # derived from q: under the TP shard_map the carries vary over devices as the body's do
    init = (zero[..., 0] - jnp.inf, zero[..., 0], zero)
    num_blocks = jnp.minimum((jnp.max(seq_lens) + width - 1) // width, nb_static)
    _, l, acc = lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(t, h, d).astype(q.dtype)
