"""Batch metadata for paged attention: one flat token batch (decode tokens first, prefill chunks after)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import jax
import numpy as np
from jaxtyping import Array, Int


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """All array fields; static sizes come from their shapes (T tokens, S sequences, P pages per sequence).

    Padding tokens belong to no real sequence; their slots are distinct and past any cache, so their K/V writes
    are dropped (`KVCache.write`).
    """
    positions: Int[Array, "T"]       # position of each token inside its sequence
    slot_mapping: Int[Array, "T"]    # flat KV slot (page * page_size + offset) each token's K/V goes to
    token_seq: Int[Array, "T"]       # row of page_table each token belongs to (padding: 0)
    page_table: Int[Array, "S P"]    # page ids per sequence (unused entries: 0)
    seq_lens: Int[Array, "S"]        # KV length per sequence after this step's writes (padding seqs: 0)
    query_start: Int[Array, "S1"]    # S + 1 offsets of each sequence's first token in the flat batch
    num_decode: Int[Array, ""]       # sequences [0, num_decode) are decodes with exactly one query token
    logits_index: Int[Array, "S"]    # flat index of each sequence's last token (the one sampled from)
    kv_tail: Int[Array, "S"]         # row of KVCache.k_tail holding each sequence's filling K group (kivi64 only)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def to_device(self) -> "AttentionMetadata":
        return AttentionMetadata(**{f.name: jax.numpy.asarray(getattr(self, f.name)) for f in fields(self)})


PADDING_SLOT = 1 << 30          # first slot of the padding tokens: past any cache (pages x page size < 2^30)


def build_metadata(seqs: list[tuple[list[int], int, int]], num_tokens: int, max_seqs: int,
                   max_pages: int, page_size: int, num_decode: int = 0,
                   kv_tails: list[int] | None = None) -> AttentionMetadata:
    """Host-side (numpy) metadata for sequences given as (page_ids, first_position, num_query_tokens).
    `kv_tails`: each sequence's K tail row (kivi64, nfjax/kv/tail_slots.py; None: row i uses tail row i, right
    for callers whose row i is the same sequence in every step).

    Decode sequences must come first. Padding fills up to the static `num_tokens` / `max_seqs`. Vectorized
    over sequences: the engine builds one per step for up to hundreds of sequences.
    """
    n = len(seqs)
    if n > max_seqs:
        raise ValueError(f"{n} sequences exceed the step's max_seqs={max_seqs}")
    table = np.zeros((max_seqs, max_pages), np.int32)
    lens = np.zeros(max_seqs, np.int32)
    qstart = np.zeros(max_seqs + 1, np.int32)
    lidx = np.zeros(max_seqs, np.int32)
    tails = np.arange(max_seqs, dtype=np.int32)
    if kv_tails is not None:
        tails[:len(kv_tails)] = kv_tails
    pos = np.zeros(num_tokens, np.int32)
    # Padding: distinct slots past the cache, dropped by the write. One shared slot made XLA's scatter serialise
    # on it: 0.86 ms a layer program for 63 padding tokens of an 8B decode step (H100, docs/design.md).
    slot = PADDING_SLOT + np.arange(num_tokens, dtype=np.int32)
    tseq = np.zeros(num_tokens, np.int32)
    if n:
        starts = np.fromiter((st for _, st, _ in seqs), np.int64, n)
        counts = np.fromiter((c for _, _, c in seqs), np.int64, n)
        npages = np.fromiter((len(pg) for pg, _, _ in seqs), np.int64, n)
        total = int(counts.sum())
        if total > num_tokens:
            raise ValueError(f"batch holds more than num_tokens={num_tokens} tokens")
        bad = np.flatnonzero((npages > max_pages) | (starts + counts > npages * page_size))
        if bad.size:
            raise ValueError(f"sequence {bad[0]} needs more pages than it was given ({npages[bad[0]]})")
        rows = np.repeat(np.arange(n), npages)
        cols = np.arange(int(npages.sum())) - np.repeat(np.cumsum(npages) - npages, npages)
        table[rows, cols] = np.concatenate([np.asarray(pg, np.int32) for pg, _, _ in seqs])
        first = np.cumsum(counts) - counts                       # each sequence's first token in the batch
        tok_seq = np.repeat(np.arange(n), counts)
        p = np.repeat(starts, counts) + np.arange(total) - np.repeat(first, counts)
        pos[:total] = p
        slot[:total] = table[tok_seq, p // page_size] * page_size + p % page_size
        tseq[:total] = tok_seq
        lens[:n] = starts + counts
        qstart[:n] = first
        lidx[:n] = first + counts - 1
        qstart[n:] = total
    return AttentionMetadata(pos, slot, tseq, table, lens, qstart, np.asarray(num_decode, np.int32), lidx,
                             tails)
