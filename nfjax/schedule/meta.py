"""Attention metadata of one nano-batch: the tokens [lo, hi) of a step's flat batch, as a batch of its own.

The step's layout is decodes first (token s is decode sequence s), then prefill chunks, then padding. A
nano-batch is rebased so that it has the same layout: its sequences start at s0, the sequence of token lo, so
its decode rows are [0, num_decode') and map to its first sequences, as the decode kernel expects, and every
sequence's query range is clipped to the nano-batch. A sequence whose chunk runs past hi is cut there: its
seq_len becomes the KV length after this nano-batch's own writes, so kernels that derive positions from
(seq_lens, query_start) see the right ones. The pure-jnp reference reads the per-token positions/token_seq.

Sizes stay static (S sequences, P pages); only values change. The full range returns `meta` unchanged.
"""
from __future__ import annotations

import jax.numpy as jnp

from nfjax.kv.metadata import AttentionMetadata


def nano_metadata(meta: AttentionMetadata, lo: int, hi: int) -> AttentionMetadata:
    t = meta.positions.shape[0]
    if (lo, hi) == (0, t):
        return meta
    if not 0 <= lo < hi <= t:
        raise ValueError(f"nano-batch [{lo}, {hi}) is outside the step's {t} tokens")
    s = meta.seq_lens.shape[0]
    nd = meta.num_decode
    qs = meta.query_start                      # [S + 1]; qs[S] = number of real tokens
    real = qs[s]
    # first sequence of the nano-batch; all-padding nano-batches get no sequence at all
    s0 = jnp.where(lo < nd, lo, jnp.where(lo < real, meta.token_seq[lo], s)).astype(jnp.int32)
    idx = s0 + jnp.arange(s)
    valid = idx < s
    src = jnp.minimum(idx, s - 1)
    q_end = qs[src + 1]
    lens = jnp.where(valid, meta.seq_lens[src] - jnp.maximum(q_end - hi, 0), 0)
    q0 = jnp.clip(qs[jnp.minimum(s0 + jnp.arange(s + 1), s)] - lo, 0, hi - lo)
    tok = jnp.arange(lo, hi)
    tseq = jnp.where(tok < real, meta.token_seq[lo:hi] - s0, 0)
    return AttentionMetadata(
        positions=meta.positions[lo:hi], slot_mapping=meta.slot_mapping[lo:hi], token_seq=tseq,
        page_table=jnp.where(valid[:, None], meta.page_table[src], 0), seq_lens=jnp.maximum(lens, 0),
        query_start=q0.astype(jnp.int32), num_decode=jnp.clip(jnp.minimum(nd, hi) - s0, 0, s).astype(jnp.int32),
        logits_index=jnp.clip(meta.logits_index - lo, 0, hi - lo - 1), kv_tail=meta.kv_tail[src])
