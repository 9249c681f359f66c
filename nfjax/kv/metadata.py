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

    Padding tokens write their K/V into the reserved scratch page 0 and belong to no real sequence.
    """
    positions: Int[Array, "T"]       # position of each token inside its sequence
    slot_mapping: Int[Array, "T"]    # flat KV slot (page * page_size + offset) each token's K/V goes to
    token_seq: Int[Array, "T"]       # row of page_table each token belongs to (padding: 0)
    page_table: Int[Array, "S P"]    # page ids per sequence (unused entries: 0)
    seq_lens: Int[Array, "S"]        # KV length per sequence after this step's writes (padding seqs: 0)
    query_start: Int[Array, "S1"]    # S + 1 offsets of each sequence's first token in the flat batch
    num_decode: Int[Array, ""]       # sequences [0, num_decode) are decodes with exactly one query token
    logits_index: Int[Array, "S"]    # flat index of each sequence's last token (the one sampled from)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def to_device(self) -> "AttentionMetadata":
        return AttentionMetadata(**{f.name: jax.numpy.asarray(getattr(self, f.name)) for f in fields(self)})


def build_metadata(seqs: list[tuple[list[int], int, int]], num_tokens: int, max_seqs: int,
                   max_pages: int, page_size: int, num_decode: int = 0) -> AttentionMetadata:
    """Host-side (numpy) metadata for sequences given as (page_ids, first_position, num_query_tokens).

    Decode sequences must come first. Padding fills up to the static `num_tokens` / `max_seqs`.
    """
    if len(seqs) > max_seqs:
        raise ValueError(f"{len(seqs)} sequences exceed the step's max_seqs={max_seqs}")
    pos = np.zeros(num_tokens, np.int32)
    slot = np.zeros(num_tokens, np.int32)       # padding -> scratch page 0
    tseq = np.zeros(num_tokens, np.int32)
    table = np.zeros((max_seqs, max_pages), np.int32)
    lens = np.zeros(max_seqs, np.int32)
    qstart = np.zeros(max_seqs + 1, np.int32)
    lidx = np.zeros(max_seqs, np.int32)
    t = 0
    for s, (pages, start, n) in enumerate(seqs):
        if t + n > num_tokens:
            raise ValueError(f"batch holds more than num_tokens={num_tokens} tokens")
        if len(pages) > max_pages or start + n > len(pages) * page_size:
            raise ValueError(f"sequence {s} needs more pages than it was given ({len(pages)})")
        table[s, :len(pages)] = pages
        p = np.arange(start, start + n)
        pos[t:t + n] = p
        slot[t:t + n] = np.asarray(pages, np.int64)[p // page_size] * page_size + p % page_size
        tseq[t:t + n] = s
        lens[s] = start + n
        qstart[s] = t
        lidx[s] = t + n - 1
        t += n
    qstart[len(seqs):] = t
    return AttentionMetadata(pos, slot, tseq, table, lens, qstart, np.asarray(num_decode, np.int32), lidx)
