"""Attention dispatch over the paged cache: Pallas kernels on GPU, pure-jnp references elsewhere.

Three entry points, all taking the step's flat token batch (decode tokens first, then prefill chunks, then
padding) and its AttentionMetadata:
  * `decode_attention`: the decode rows only. The decode kernel runs over the first min(S, T) rows as if each
    were a decode query; rows at or past num_decode (a traced value) get sequence length 0, so their work
    items exit at once without reading K/V. Returns min(S, T) rows.
  * `prefill_attention`: the prefill rows only. The prefill kernel lays out its query tiles on device over the
    sequences >= num_decode; its tile bound is static (T / tokens_per_tile + max_prefill_seqs) and tiles past
    the live ones exit at once. Rows that are not prefill tokens come back 0 (kernels) or don't-care (ref).
  * `paged_attention`: both, row t taken from the decode output if t < num_decode, else from the prefill one.
What padding costs on GPU: one early-exit CTA per empty work item, plus the prefill query-tile gather, which
is proportional to the static tile bound; `max_prefill_seqs` (the batcher's cap on prefill chunks per step)
shrinks it. The kernels read the stacked cache with the layer index inside the kernel: no per-layer copy.
`use_kernels=None` picks the kernels on GPU when shapes/dtypes suit them; `interpret=True` runs them through
the Mosaic GPU interpreter (CPU tests only).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from nfjax.compat import num_sms, on_gpu
from nfjax.kv.blocked_attention import blocked_paged_attention
from nfjax.config import ConfigError, ModelConfig
from nfjax.kv.cache import KVCache, check_format
from nfjax.kv.metadata import AttentionMetadata
from pallas_kernels.paged_decode_swapped import paged_decode_attention_swapped
from pallas_kernels.paged_prefill_attention import paged_prefill_attention
from nfjax.kv.tail_attention import decode_tail_split, splice_tail
from pallas_kernels.kv_kivi64 import GROUP as TAIL_GROUP
from pallas_kernels.kv_quant import (KV_DTYPES, dequantize_kv, has_tail, is_quantized, rotate, rotates,
                                     rotates_v)
from pallas_kernels._kv_dequant import QUANT_KERNEL_FORMATS, kernel_refusal
from pallas_kernels.ragged_paged_attention_ref import ragged_paged_attention_ref


# KV formats the Pallas kernels read (dequantizing in the kernel: pallas_kernels/_kv_dequant.py); the references
# read every format. fp8r's pages are fp8's, its K tail rows read beside the kernels (nfjax/kv/tail_attention.py).
KERNEL_KV_DTYPES = ("bfloat16",) + QUANT_KERNEL_FORMATS + ("fp8r",)
PAGE_FORMAT = {"fp8r": "fp8"}           # the format the kernels read a cache's pages as


def kernels_support(q, kv: KVCache) -> bool:
    h, d = q.shape[1], q.shape[2]
    kvh = kv.k.shape[3]
    if kv.kv_dtype not in KERNEL_KV_DTYPES:
        return False
    if not (d % 64 == 0 and h % kvh == 0 and h // kvh <= 64):
        return False
    if kv.aux is not None:                      # quantized: bf16 queries; int4 / int8 take one or two groups
        return q.dtype == jnp.bfloat16 and kernel_refusal(PAGE_FORMAT.get(kv.kv_dtype, kv.kv_dtype), d) is None
    return jnp.dtype(kv.k.dtype).itemsize == 2 and q.dtype == kv.k.dtype


def check_kv_format(model: ModelConfig, kv_dtype: str, gpu: bool) -> None:
    """At start: a quantized format needs the kernels on a GPU (the references there read the whole page-table
    width every step), so one they cannot serve for this model is a ConfigError naming the flag and choices."""
    check_format(model, kv_dtype)
    why = _gpu_refusal(model, kv_dtype) if gpu else None
    if why:
        served = [f for f in KV_DTYPES if _gpu_refusal(model, f) is None]
        raise ConfigError(f"--kv-dtype / cache.kv_dtype {kv_dtype!r} cannot be served on this GPU: {why}; "
                          f"choices here: {', '.join(served)} (all: {', '.join(KV_DTYPES)})")


def _gpu_refusal(model: ModelConfig, kv_dtype: str) -> str | None:
    if not is_quantized(kv_dtype):
        return None                 # unquantized: shapes the kernels do not take run the reference, as before
    if kv_dtype == "kivi64":
        return "no attention kernel reads it yet (the CPU's reference path does; docs/design.md section 14.1)"
    if kv_dtype not in KERNEL_KV_DTYPES:
        return "no attention kernel reads it (a format for the accuracy comparison only)"
    if model.head_dim % 64 or model.num_heads // model.num_kv_heads > 64 or model.dtype != "bfloat16":
        return (f"the kernels need head_dim % 64 == 0, at most 64 query heads a kv head and bfloat16 activations "
                f"(head_dim {model.head_dim}, {model.num_heads}/{model.num_kv_heads} heads, {model.dtype})")
    return kernel_refusal(PAGE_FORMAT.get(kv_dtype, kv_dtype), model.head_dim)


def _use_kernels(use_kernels, q, kv) -> bool:
    if use_kernels and kv.kv_dtype not in KERNEL_KV_DTYPES:
        raise ValueError(f"no attention kernel reads the {kv.kv_dtype} KV format")
    return (on_gpu() and kernels_support(q, kv)) if use_kernels is None else use_kernels


def _reference(q, kv: KVCache, layer, meta: AttentionMetadata, scale):
    """Off the kernels. On the CPU, the blocked loop bounded by the step's longest sequence; on the GPU the plain
    reference, since a loop with a traced trip count there reads its predicate back to the host every iteration
    and the host could no longer run a step ahead."""
    t = q.shape[0]
    attend = ragged_paged_attention_ref if on_gpu() else blocked_paged_attention
    k, v, aux = kv.layer_pages(layer)
    return attend(q, k, v, meta.positions[:t], meta.token_seq[:t], meta.page_table, meta.seq_lens, scale,
                  aux_pages=aux, k_tail=kv.tail_rows(layer, meta.kv_tail),
                  v_tail=kv.v_tail_rows(layer, meta.kv_tail))


def rotate_queries(q: Float[Array, "T H D"], kv: KVCache) -> Float[Array, "T H D"]:
    """The queries in the frame of the cache: formats that store K and V rotated (kv_quant.ROTATED) need qH
    (q.k = (qH).(kH)); every entry point here applies it, and a caller of the kernels directly must too."""
    return rotate(q) if rotates(kv.kv_dtype) else q


def rotate_outputs(o: Float[Array, "T H D"], kv: KVCache) -> Float[Array, "T H D"]:
    """Attention outputs back out of the cache's frame: over V stored rotated, attention gives oH, and H H = I."""
    return rotate(o) if rotates_v(kv.kv_dtype) else o


def outputs_for_o_proj(o: Float[Array, "T H D"], kv: KVCache, folded: bool) -> Float[Array, "T H D"]:
    """Attention rows from the cache's frame into the one o_proj takes: its own, or V's rotated frame where the
    Runner folded the rotation into its weight (`folded`, nfjax/models/rotation_fold.py); H H = I, so one rotation
    converts either way."""
    return rotate(o) if rotates_v(kv.kv_dtype) != folded else o


def decode_attention(q: Float[Array, "T H D"], kv: KVCache, layer: Int[Array, ""], meta: AttentionMetadata,
                     scale: float, *, use_kernels: bool | None = None, interpret: bool = False,
                     num_ctas: int | None = None, cache_frame_out: bool = False) -> Float[Array, "R H D"]:
    """Rows [0, R = min(S, T)); rows at or past num_decode are 0 (kernels) or don't-care (reference).
    `num_ctas`: the decode kernel's persistent CTA count (NanoFlow's resource share). `cache_frame_out`: the
    outputs stay in the cache's frame (the caller takes them on, once for a step's merged rows:
    `outputs_for_o_proj`); otherwise they come back in the model's frame (`rotate_outputs`)."""
    out = _decode(rotate_queries(q, kv), kv, layer, meta, scale, use_kernels, interpret, num_ctas)
    return out if cache_frame_out else rotate_outputs(out, kv)


def _decode(q, kv, layer, meta, scale, use_kernels, interpret, num_ctas):
    if not _use_kernels(use_kernels, q, kv):
        s = meta.seq_lens.shape[0]
        lens = jnp.where(jnp.arange(s) < meta.num_decode, meta.seq_lens, 0)
        return _reference(q[:min(s, q.shape[0])], kv, layer, dataclasses.replace(meta, seq_lens=lens), scale)
    q_r, pt, lens = decode_rows(q, meta)
    tail = None
    if has_tail(kv.kv_dtype):         # the kernel reads the complete groups, the tail rows the rest
        tail = decode_tail_split(q_r, kv, layer, lens, meta.kv_tail[:q_r.shape[0]], scale, meta.num_decode,
                                 num_ctas=num_ctas or num_sms(), interpret=interpret)
        lens = (lens // TAIL_GROUP) * TAIL_GROUP
    # the decodes are rows [0, num_decode): the kernel visits no other row (a mixed step's call runs over max_seqs)
    return paged_decode_attention_swapped(q_r, kv.k, kv.v, layer, pt, lens, scale=scale,
                                          num_ctas=num_ctas or num_sms(), interpret=interpret, aux_cache=kv.aux,
                                          live_rows=meta.num_decode, extra_split=tail)


def decode_rows(q: Float[Array, "T H D"], meta: AttentionMetadata):
    """The decode kernel's inputs: rows [0, R = min(S, T)) as queries, their page-table rows, and their lengths
    with rows at or past num_decode set to 0 (their work exits at once)."""
    s = meta.seq_lens.shape[0]
    r = min(s, q.shape[0])
    lens = jnp.where(jnp.arange(s) < meta.num_decode, meta.seq_lens, 0)
    return q[:r], meta.page_table[:r], lens[:r]


def prefill_attention(q: Float[Array, "T H D"], kv: KVCache, layer: Int[Array, ""], meta: AttentionMetadata,
                      scale: float, *, use_kernels: bool | None = None, interpret: bool = False,
                      max_prefill_seqs: int | None = None, copy_pages: int = 0,
                      cache_frame_out: bool = False) -> Float[Array, "T H D"]:
    """All T rows; only the prefill tokens' rows are meaningful. `copy_pages` > 0 on a quantized cache: the prefill
    rows' pages (at most that many: the batcher's limit) dequantized into a bfloat16 copy first (`dequantized_pages`),
    the bfloat16 kernel over it. `cache_frame_out` as in `decode_attention`."""
    out = _prefill(rotate_queries(q, kv), kv, layer, meta, scale, use_kernels, interpret, max_prefill_seqs,
                   copy_pages)
    return out if cache_frame_out else rotate_outputs(out, kv)


def dequantized_pages(kv: KVCache, layer: Int[Array, ""], page_table: Int[Array, "W P"], seq_lens: Int[Array, "W"],
                      capacity: int):
    """The pages rows of `page_table` hold up to `seq_lens`, gathered in row order into a bfloat16 copy of
    `capacity` pages ([1, C, PS, KH, D] each for K and V, one layer), and the table renumbered into the copy. Pages
    past `capacity` are dropped (read as entry 0): the caller keeps the rows' pages within it (the batcher's limit).
    Unused entries of the copy hold page 0 (the scratch page); the table's entries past each row's length point at
    entry 0."""
    idx, table, _ = copy_table(page_table, seq_lens, kv.k.shape[2], capacity)
    return (*_copy_of(kv, layer, idx), table)


def _copy_of(kv: KVCache, layer: Int[Array, ""], idx: Int[Array, "C"]):
    """K and V [1, C, PS, KH, D] bfloat16: the cache's pages `idx` of one layer, dequantized."""
    k, v = dequantize_kv(kv.k[layer, idx], kv.v[layer, idx], kv.aux[layer, idx], jnp.bfloat16)
    return k[None], v[None]


def copy_table(page_table: Int[Array, "W P"], seq_lens: Int[Array, "W"], page_size: int, capacity: int):
    """`dequantized_pages`' layout: (the cache's page id of each copy entry [capacity], the table renumbered into
    the copy [W, P], which table entries the copy holds [W, P]). A page past the copy reads entry 0 (wrong values,
    but never an index past the copy: a kernel reading past it hangs in interpret mode)."""
    p = page_table.shape[1]
    live = jnp.arange(p)[None, :] < ((seq_lens + page_size - 1) // page_size)[:, None]    # [W, P]
    slot = (jnp.cumsum(live.reshape(-1)) - 1).reshape(live.shape)
    idx = jnp.zeros((capacity,), jnp.int32).at[jnp.where(live, slot, capacity).reshape(-1)].set(
        page_table.reshape(-1), mode="drop")
    kept = live & (slot < capacity)
    return idx, jnp.where(kept, slot, 0).astype(jnp.int32), kept


def _prefill(q, kv, layer, meta, scale, use_kernels, interpret, max_prefill_seqs, copy_pages=0):
    if not _use_kernels(use_kernels, q, kv):
        return _reference(q, kv, layer, meta, scale)
    s = meta.seq_lens.shape[0]
    nd = meta.num_decode
    pt, lens, qs, tails = meta.page_table, meta.seq_lens, meta.query_start, meta.kv_tail
    if max_prefill_seqs is not None and max_prefill_seqs < s:
        # Prefill sequences sit right after the decodes: take the window [nd, nd + max_prefill_seqs).
        w = max_prefill_seqs
        idx = nd + jnp.arange(w)
        pt, tails = pt[jnp.clip(idx, 0, s - 1)], tails[jnp.clip(idx, 0, s - 1)]
        lens = jnp.where(idx < s, lens[jnp.clip(idx, 0, s - 1)], 0)
        qs = qs[jnp.clip(nd + jnp.arange(w + 1), 0, s)]      # window ends where sequence nd + w starts
        first = jnp.int32(0)
    else:
        first = nd
    if has_tail(kv.kv_dtype) and not copy_pages:
        raise ValueError(f"{kv.kv_dtype}'s prefill reads a bfloat16 copy of its pages (copy_pages > 0)")
    if copy_pages and kv.kv_dtype in QUANT_KERNEL_FORMATS + tuple(PAGE_FORMAT):
        # rows before `first` (the decodes, without a window) read nothing: their lengths count no page
        rows = jnp.arange(lens.shape[0])
        read = jnp.where(rows >= first, lens, 0)
        idx, table, kept = copy_table(pt, read, kv.k.shape[2], copy_pages)        # `dequantized_pages`' copy
        k, v = _copy_of(kv, layer, idx)
        if has_tail(kv.kv_dtype):
            k, v = splice_tail(k, v, table, kept, read, kv, layer, tails)
        return paged_prefill_attention(q, k, v, jnp.int32(0), table, lens, qs, first, scale=scale,
                                       interpret=interpret)
    return paged_prefill_attention(q, kv.k, kv.v, layer, pt, lens, qs, first, scale=scale, interpret=interpret,
                                   aux_cache=kv.aux)


def paged_attention(q: Float[Array, "T H D"], kv: KVCache, layer: Int[Array, ""], meta: AttentionMetadata,
                    scale: float, *, use_kernels: bool | None = None, interpret: bool = False,
                    num_ctas: int | None = None, max_prefill_seqs: int | None = None,
                    copy_pages: int = 0) -> Float[Array, "T H D"]:
    """The whole mixed batch (padding rows: 0 on the kernel path, don't-care on the reference path); `copy_pages`
    as in `prefill_attention`."""
    q = rotate_queries(q, kv)
    if not _use_kernels(use_kernels, q, kv):
        return rotate_outputs(_reference(q, kv, layer, meta, scale), kv)
    t = q.shape[0]
    dec = _decode(q, kv, layer, meta, scale, True, interpret, num_ctas)
    pre = _prefill(q, kv, layer, meta, scale, True, interpret, max_prefill_seqs, copy_pages)
    dec_full = jnp.zeros_like(q).at[:dec.shape[0]].set(dec.astype(q.dtype))
    return rotate_outputs(jnp.where((jnp.arange(t) < meta.num_decode)[:, None, None], dec_full, pre), kv)
