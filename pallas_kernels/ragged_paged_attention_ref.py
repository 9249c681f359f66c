"""Pure-jnp reference: ragged paged attention for a mixed batch (decodes and prefill chunks together).

Each token attends causally to its own sequence's cache positions [0, position]; K/V of the current step must
already be written. Used on CPU and as the oracle for every kernel.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import MASK_VALUE
from pallas_kernels.kv_kivi64 import read_pages
from pallas_kernels.kv_quant import dequantize_kv


def ragged_paged_attention_ref(q: Float[Array, "T H D"], k_pages: Float[Array, "N PS KH D"],
                               v_pages: Float[Array, "N PS KH D"], positions: Int[Array, "T"],
                               token_seq: Int[Array, "T"], page_table: Int[Array, "S P"],
                               seq_lens: Int[Array, "S"], scale: float, aux_pages=None,
                               k_tail=None, v_tail=None) -> Float[Array, "T H D"]:
    """`aux_pages` [N, PS, KH, W]: the pages are in a quantized format (kv_quant.py), dequantized here;
    `k_tail` [S, 64, KH, D]: a format with a tail (kivi64, fp8r), each sequence's filling K group in its row,
    and its V in `v_tail` (fp8r; kv_kivi64.read_pages)."""
    t, h, d = q.shape
    _, ps, kh, _ = k_pages.shape
    s, p = page_table.shape
    if k_tail is not None:
        k_seq, v_seq = read_pages(k_pages[page_table], v_pages[page_table], aux_pages[page_table], k_tail, seq_lens,
                                  v_tail=v_tail)
    else:
        aux = None if aux_pages is None else aux_pages[page_table].reshape(s, p * ps, kh, -1)
        k_seq, v_seq = dequantize_kv(k_pages[page_table].reshape(s, p * ps, kh, -1),    # [S, L, KH, D] f32
                                     v_pages[page_table].reshape(s, p * ps, kh, -1), aux)
    kt, vt = k_seq[token_seq], v_seq[token_seq]                # [T, L, KH, D]
    qg = q.reshape(t, kh, h // kh, d).astype(jnp.float32)
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, kt.astype(jnp.float32)) * scale
    j = jnp.arange(p * ps)
    ok = (j[None, :] <= positions[:, None]) & (j[None, :] < seq_lens[token_seq][:, None])
    scores = jnp.where(ok[:, None, None, :], scores, MASK_VALUE)
    w = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgl,tlkd->tkgd", w, vt.astype(jnp.float32))
    return out.reshape(t, h, d).astype(q.dtype)
