"""The attention kernels on quantized caches (fp8, int8, int4; pallas_kernels/_kv_dequant.py) in Mosaic GPU interpret
mode against their references, which dequantize the whole cache first; GPU lowering checked by cross-lowering for
CUDA. Ragged lengths, pages of 16 and 64, GQA 1/4/8, head_dim 64/128."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_quant
from pallas_kernels.paged_decode_attention import paged_decode_attention_ref
from pallas_kernels.paged_decode_swapped import paged_decode_attention_swapped

def _cache_types(fmt, ps, d):
    """The stacked values' and aux rows' types of a quantized cache (8 kv heads, 4096 pages of `ps`)."""
    sds = jax.ShapeDtypeStruct
    lead = (2, 4096, ps, 8)
    return (sds((*lead, kv_quant.value_width(fmt, d)), kv_quant.value_dtype(fmt, jnp.bfloat16)),
            sds((*lead, kv_quant.aux_width(fmt, d)), kv_quant.AUX_DTYPE))


# (format, page_size, group, head_dim, block_kv, num_splits, programs, stages, dequantizing warpgroups)
# (None: the format's default, int4's 2 over an even number of stages, else 1; 0: the consumer dequantizes)
DECODE = [("fp8", 16, 4, 64, 64, None, 3, 2, 2), ("int4", 64, 8, 128, 64, 3, 4, 3, None),
          ("int4", 16, 1, 64, 128, 2, 5, 4, 2), ("fp8", 64, 1, 128, 128, 1, 2, 2, 0),
          ("int8", 64, 4, 128, 64, 3, 3, 2, None), ("int8", 16, 8, 64, 64, 2, 2, 2, 0)]


@pytest.mark.parametrize("fmt,ps,g,d,bkv,ns,progs,stages,nd", DECODE)
def test_swapped_decode_on_quantized_cache(paged_case, fmt, ps, g, d, bkv, ns, progs, stages, nd):
    _check_swapped(paged_case, fmt, ps, g, d, bkv, ns, progs, stages, nd)


@pytest.mark.parametrize("fmt,ps,d,stages,nd,prefetch", [("fp8", 16, 128, 4, 2, False), ("int8", 64, 128, 2, 1, True),
                                                          ("int4", 16, 64, 4, 2, False)])
def test_swapped_decode_with_k_dequantized_in_the_consumer(paged_case, fmt, ps, d, stages, nd, prefetch):
    """k_in_consumer: K dequantized into the consumer's registers (wgmma's register operand), V by the dequantizers;
    with prefetch_pages (int8), the producer's page-table reads move ahead of its wait for the stage."""
    _check_swapped(paged_case, fmt, ps, 4, d, 64, 2, 3, stages, nd, k_in_consumer=True, prefetch_pages=prefetch,
                   fp8_mma=False)           # fp8's default reads K undequantized (fp8_mma)


@pytest.mark.parametrize("ps,g,d,stages,nd", [(16, 4, 128, 4, 1), (64, 8, 64, 2, 2)])
def test_swapped_decode_with_fp8_k_read_by_fp8_wgmma(paged_case, ps, g, d, stages, nd):
    """fp8_mma: K's fp8 stage meets the query's two e4m3 parts in wgmma, undequantized; V by the dequantizers."""
    _check_swapped(paged_case, "fp8", ps, g, d, 64, 2, 3, stages, nd, fp8_mma=True)


@pytest.mark.parametrize("fmt,ps,g,d,stages,nd", [("int8", 16, 4, 128, 4, 1), ("int8", 64, 8, 64, 2, 2),
                                                  ("int4", 16, 4, 128, 4, 2), ("int4", 64, 1, 128, 2, 1)])
def test_swapped_decode_with_k_codes_read_by_int8_wgmma(paged_case, fmt, ps, g, d, stages, nd):
    """int8_mma: K's codes (int8 as stored, int4 unpacked in registers) meet the query's int8 parts in int32
    wgmmas, each group's scale and center applied to its scores; V by the dequantizers. Two groups at head_dim 128,
    one at 64."""
    _check_swapped(paged_case, fmt, ps, g, d, 64, 2, 3, stages, nd, int8_mma=True)


@pytest.mark.parametrize("ps,g,stages,nd,pipeline", [(64, 1, 2, 1, False), (64, 4, 4, 2, True)])
def test_swapped_decode_with_int4_groups_in_their_own_accumulators(paged_case, ps, g, stages, nd, pipeline):
    """group_accs: int4's two halves of D (a group each) meet the query's hi / lo parts (no zero blocks) in a wgmma
    and an accumulator each; also behind the block before's P V^T (pipeline), where the scores arrive as a tuple
    (pages of 16: `test_int4_groups_apart_score_exactly_as_grouped`)."""
    _check_swapped(paged_case, "int4", ps, g, 128, 64, 2, 3, stages, nd, int8_mma=True, group_accs=True,
                   pipeline=pipeline)


@pytest.mark.parametrize("fmt,kw", [("fp8", {"fp8_mma": True}), ("int8", {"int8_mma": True})])
def test_swapped_decode_with_one_dequantized_tile_and_256_position_blocks(paged_case, fmt, kw):
    """deq_tiles=1: one V tile buffer, which leaves SMEM for 256-position blocks; the dequantizer waits for the
    consumer's release of the tile before each block."""
    _check_swapped(paged_case, fmt, 16, 4, 128, 256, 2, 3, 2, 1, deq_tiles=1, **kw)


@pytest.mark.parametrize("fmt,stages,nd,tiles,kw", [("int4", 6, 3, 3, {"int8_mma": True}),
                                                    ("fp8", 2, 1, 3, {"fp8_mma": True})])
def test_swapped_decode_with_more_dequantizers_or_tile_buffers(paged_case, fmt, stages, nd, tiles, kw):
    """Three dequantizers over six stages and three tile buffers (each sees every completion of its own stages'
    and buffers' barriers), and one dequantizer three tiles ahead of the consumer."""
    _check_swapped(paged_case, fmt, 16, 4, 128, 64, 2, 3, stages, nd, deq_tiles=tiles, **kw)


def test_one_dequantized_tile_takes_one_dequantizer(paged_case):
    with pytest.raises(ValueError, match="tile buffers over 2 dequantizers"):
        _check_swapped(paged_case, "int8", 16, 4, 128, 64, 2, 3, 2, 2, deq_tiles=1, int8_mma=True)


def test_int8_query_parts_carry_the_query():
    """hi + lo / 254 in the item's scale is the query to ~1 / 64,000 of its largest value, each part on its own
    group's columns only."""
    q = jax.random.normal(jax.random.key(3), (5, 8, 128), jnp.float32) * 3
    parts, sc = kv_quant.int8_query_parts(q)
    assert parts.shape == (5, 32, 128) and parts.dtype == jnp.int8
    p = np.asarray(parts, np.float32).reshape(5, 2, 2, 8, 128)          # [item, hi/lo, group, row, column]
    assert not p[:, :, 0, :, 64:].any() and not p[:, :, 1, :, :64].any()
    back = (p[:, 0].sum(1) + p[:, 1].sum(1) / kv_quant.INT8_LO) * np.asarray(sc)[:, None, None]
    assert np.abs(back - np.asarray(q)).max() <= 2e-5 * np.abs(np.asarray(q)).max()


def test_int4_groups_apart_score_exactly_as_grouped(paged_case):
    """group_accs changes how the integer dots are laid out, not their values: the same output bit for bit in
    interpret mode (a swapped hi / lo or group would not be)."""
    lens = [3, 2 * 64 + 5, 47]
    c = paged_case(kv_heads=2, group=4, head_dim=128, page_size=16, seq_lens=lens, kv_dtype="int4")
    args = (c.queries(len(lens)), c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens))
    outs = [np.asarray(paged_decode_attention_swapped(*args, scale=c.scale, num_ctas=3, num_splits=2, block_kv=64,
                                                      num_stages=4, interpret=True, aux_cache=c.aux, dequant_wgs=2,
                                                      int8_mma=True, group_accs=apart), np.float32)
            for apart in (True, False)]
    np.testing.assert_array_equal(outs[0], outs[1])
    assert np.abs(outs[0]).max() > 0


def test_int8_query_parts_apart_carry_the_query_in_half_the_bytes():
    """grouped=False (the kernel's group_accs): [hi; lo] over all of D, no zero blocks, the same values as the
    grouped layout's blocks put together."""
    q = jax.random.normal(jax.random.key(3), (5, 8, 128), jnp.float32) * 3
    apart, sc = kv_quant.int8_query_parts(q, grouped=False)
    grouped, sc2 = kv_quant.int8_query_parts(q)
    assert apart.shape == (5, 16, 128) and apart.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(sc2))
    g = np.asarray(grouped).reshape(5, 2, 2, 8, 128).sum(2)             # each part's two group blocks together
    np.testing.assert_array_equal(np.asarray(apart).reshape(5, 2, 8, 128), g)


def test_group_accs_needs_int4_with_int8_mma(paged_case):
    for fmt, kw in (("int8", {"int8_mma": True}), ("int4", {"int8_mma": False, "k_in_consumer": True})):
        with pytest.raises(ValueError, match="group_accs"):
            _check_swapped(paged_case, fmt, 16, 4, 128, 64, 2, 3, 4, 2, group_accs=True, **kw)


def test_fp8_mma_needs_fp8_and_dequantizers(paged_case):
    with pytest.raises(ValueError, match="fp8_mma"):
        _check_swapped(paged_case, "int8", 16, 4, 128, 64, 2, 3, 2, 1, fp8_mma=True)
    with pytest.raises(ValueError, match="fp8_mma"):
        _check_swapped(paged_case, "fp8", 16, 4, 128, 64, 2, 3, 2, 0, fp8_mma=True)
    with pytest.raises(ValueError, match="int8_mma"):
        _check_swapped(paged_case, "fp8", 16, 4, 128, 64, 2, 3, 2, 1, int8_mma=True)
    with pytest.raises(ValueError, match="int8_mma"):
        _check_swapped(paged_case, "int8", 16, 4, 128, 64, 2, 3, 2, 0, int8_mma=True)
    with pytest.raises(ValueError, match="head_dim 128"):
        _check_swapped(paged_case, "int4", 16, 4, 64, 64, 2, 3, 2, 1, int8_mma=True)


def test_k_in_consumer_needs_dequantizers(paged_case):
    with pytest.raises(ValueError, match="k_in_consumer"):
        _check_swapped(paged_case, "fp8", 16, 4, 128, 64, 2, 3, 2, 0, k_in_consumer=True)


def _check_swapped(paged_case, fmt, ps, g, d, bkv, ns, progs, stages, nd, **kw):
    lens = [0, 1, 2 * bkv + 5, 3 * ps - 1]
    c = paged_case(kv_heads=2, group=g, head_dim=d, page_size=ps, seq_lens=lens, kv_dtype=fmt)
    q = c.queries(len(lens))
    args = (q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens))
    out = paged_decode_attention_swapped(*args, scale=c.scale, num_ctas=progs, num_splits=ns, block_kv=bkv,
                                         num_stages=stages, row_sums="wgmma" if g < 8 else "reduce", interpret=True,
                                         aux_cache=c.aux, dequant_wgs=nd, **kw)
    ref = paged_decode_attention_ref(*args, c.scale, aux_cache=c.aux)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), f"seed {c.seed}"
    assert c.rel_err(out, ref) < 1e-2, f"seed {c.seed}"
    assert np.all(out[0] == 0)


@pytest.mark.parametrize("fmt,ps,d,kw", [("fp8", 16, 128, {}), ("int4", 16, 128, {}),
                                         ("int4", 64, 64, {"block_kv": 64, "num_stages": 3}),
                                         ("fp8", 16, 64, {"num_ctas": 33, "row_sums": "wgmma", "dequant_wgs": 2}),
                                         ("int4", 16, 128, {"dequant_wgs": 0}),
                                         ("fp8", 16, 128, {"dequant_wgs": 1, "fp8_mma": False}),
                                         ("int8", 16, 128, {}), ("int8", 64, 64, {"block_kv": 64, "dequant_wgs": 0}),
                                         ("fp8", 16, 128, {"prefetch_pages": True}),
                                         ("fp8", 16, 128, {"k_in_consumer": True, "dequant_wgs": 2, "num_stages": 4}),
                                         ("int8", 16, 128, {"k_in_consumer": True, "num_stages": 4}),
                                         ("int4", 16, 64, {"k_in_consumer": True, "dequant_wgs": 1}),
                                         ("fp8", 16, 128, {"fp8_mma": True}),
                                         ("fp8", 64, 64, {"fp8_mma": True, "dequant_wgs": 2, "num_stages": 2}),
                                         ("int8", 16, 128, {"int8_mma": True}),
                                         ("int8", 64, 64, {"int8_mma": True, "dequant_wgs": 2, "num_stages": 2}),
                                         ("int4", 16, 128, {"int8_mma": True}),
                                         ("int4", 64, 128, {"int8_mma": True, "dequant_wgs": 1}),
                                         ("int4", 16, 128, {"group_accs": True}),
                                         ("int4", 64, 128, {"group_accs": True, "pipeline": True}),
                                         ("fp8", 16, 128, {"block_kv": 256, "num_stages": 2, "deq_tiles": 1}),
                                         ("int8", 16, 128, {"block_kv": 256, "num_stages": 2, "deq_tiles": 1,
                                                            "dequant_wgs": 1}),
                                         ("int4", 64, 128, {"num_stages": 6, "dequant_wgs": 3, "deq_tiles": 3}),
                                         ("int4", 16, 128, {"num_stages": 4, "dequant_wgs": 4, "deq_tiles": 4})])
def test_swapped_decode_on_quantized_cache_lowers_for_gpu(fmt, ps, d, kw):
    sds = jax.ShapeDtypeStruct
    cache, aux = _cache_types(fmt, ps, d)
    args = (sds((64, 32, d), jnp.bfloat16), cache, cache, sds((), jnp.int32), sds((64, 256), jnp.int32),
            sds((64,), jnp.int32))
    paged_decode_attention_swapped.trace(*args, scale=d ** -0.5, aux_cache=aux, **kw).lower(
        lowering_platforms=("cuda",))


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_codes_loaded_straight_into_the_wgmma_layout_lower_for_gpu(fmt, monkeypatch):
    """`_kv_dequant.CODE_LOAD = "direct"` (the probe's FORMAT:direct): the dequantizers load 8-bit values in the
    WGMMA layout itself, no shuffle; every format's default kernel lowers with it, to another program."""
    from pallas_kernels import _kv_dequant
    sds = jax.ShapeDtypeStruct
    cache, aux = _cache_types(fmt, 16, 128)
    args = (sds((64, 32, 128), jnp.bfloat16), cache, cache, sds((), jnp.int32), sds((64, 256), jnp.int32),
            sds((64,), jnp.int32))
    text = {}
    for mode in _kv_dequant.CODE_LOADS:
        monkeypatch.setattr(_kv_dequant, "CODE_LOAD", mode)
        jax.clear_caches()                      # the kernel's jit would hand back the other mode's trace
        text[mode] = paged_decode_attention_swapped.trace(*args, scale=128 ** -0.5, aux_cache=aux).lower(
            lowering_platforms=("cuda",)).as_text()
    jax.clear_caches()
    assert text["direct"] != text["upcast"]


HEADS = [("fp8", 16, 8, 128, 64, 2, 3), ("int4", 64, 4, 64, 128, None, 2), ("int8", 16, 1, 128, 64, 2, 3)]


@pytest.mark.parametrize("fmt,ps,g,d,bkv,ns,progs", HEADS)
def test_heads_decode_on_quantized_cache(paged_case, fmt, ps, g, d, bkv, ns, progs):
    from pallas_kernels.paged_decode_attention import paged_decode_attention
    lens = [0, 2 * bkv + 5, 3 * ps - 1]
    c = paged_case(kv_heads=2, group=g, head_dim=d, page_size=ps, seq_lens=lens, kv_dtype=fmt)
    q = c.queries(len(lens))
    args = (q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens))
    out = paged_decode_attention(*args, scale=c.scale, num_ctas=progs, num_splits=ns, block_kv=bkv, num_stages=2,
                                 interpret=True, aux_cache=c.aux)
    ref = paged_decode_attention_ref(*args, c.scale, aux_cache=c.aux)
    # int8 with one query head: 0.0029-0.0057 over seeds 1-7, and 0.0102 at seed 1189164980 (the 16-bit tiles and
    # P, against a reference over the same dequantized cache), so 1e-2 failed a run now and then
    assert c.rel_err(np.asarray(out, np.float32), ref) < 1.5e-2, f"seed {c.seed}"


# (format, page_size, group, head_dim, programs, first_seq)
PREFILL = [("fp8", 16, 4, 64, None, 1), ("int4", 64, 8, 128, 3, 0), ("int4", 16, 1, 64, None, 0),
           ("fp8", 64, 4, 128, 4, 1), ("int8", 64, 8, 64, None, 1), ("int8", 16, 4, 128, 3, 0)]


@pytest.mark.parametrize("fmt,ps,g,d,bkv,first", [("fp8", 16, 4, 128, 64, 1), ("int8", 64, 1, 64, 128, 0),
                                                   ("int4", 16, 8, 128, 128, 1)])
def test_prefill_on_quantized_cache_with_two_warpgroups(paged_case, fmt, ps, g, d, bkv, first):
    """num_warpgroups=2 on a quantized cache: one warpgroup dequantizes K, the other V, both compute."""
    _check_prefill(paged_case, fmt, ps, g, d, None, first, block_kv=bkv, num_warpgroups=2)


@pytest.mark.parametrize("fmt,ps,g,d,progs,first", PREFILL)
def test_prefill_on_quantized_cache(paged_case, fmt, ps, g, d, progs, first):
    """One warpgroup a tile: named, or the default on a persistent grid (`progs`), which two would refuse."""
    _check_prefill(paged_case, fmt, ps, g, d, progs, first, block_kv=64,
                   **({"num_warpgroups": 1} if progs is None else {}))


def _check_prefill(paged_case, fmt, ps, g, d, progs, first, **kw):
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
    qlens, before = [3, 21, 1, 9], [5, 0, 70, 130]
    c = paged_case(kv_heads=2, group=g, head_dim=d, page_size=ps, seq_lens=np.add(qlens, before), kv_dtype=fmt)
    t = sum(qlens) + 3
    q = c.queries(t)
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    args = (q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens), qs, jnp.int32(first))
    out = paged_prefill_attention(*args, scale=c.scale, num_ctas=progs, num_stages=2, interpret=True,
                                  aux_cache=c.aux, **kw)
    ref = paged_prefill_attention_ref(*args, c.scale, aux_cache=c.aux)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all() and c.rel_err(out, ref) < 1e-2, f"seed {c.seed}"
    assert np.all(out[:qlens[0] if first else 0] == 0) and np.all(out[sum(qlens):] == 0)


@pytest.mark.parametrize("fmt,d", [("fp8", 128), ("int4", 64), ("int8", 128)])
def test_prefill_heads_and_fused_on_quantized_cache_lower_for_gpu(fmt, d):
    from pallas_kernels.attention_beside_gemm import decode_attention_beside_gemm
    from pallas_kernels.paged_decode_attention import paged_decode_attention
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention
    sds = jax.ShapeDtypeStruct
    cache, aux = _cache_types(fmt, 16, d)
    lay, pt, lens = sds((), jnp.int32), sds((4, 256), jnp.int32), sds((4,), jnp.int32)
    for nw in (1, 2):                   # one warpgroup dequantizing both, or K and V split between two
        paged_prefill_attention.trace(sds((2048, 32, d), jnp.bfloat16), cache, cache, lay, pt, lens,
                                      sds((5,), jnp.int32), sds((), jnp.int32), scale=0.1, aux_cache=aux,
                                      num_warpgroups=nw).lower(lowering_platforms=("cuda",))
    dec = (sds((256, 32, d), jnp.bfloat16), cache, cache, lay, sds((256, 80), jnp.int32), sds((256,), jnp.int32))
    paged_decode_attention.trace(*dec, scale=0.1, aux_cache=aux).lower(lowering_platforms=("cuda",))
    w = sds((4096, 14336), jnp.bfloat16)
    for nd in (None, 0):                # a dequantizing warpgroup (the default), or the consumer dequantizes
        text = decode_attention_beside_gemm.trace(*dec, sds((1792, 4096), jnp.bfloat16), (w, w), scale=0.1,
                                                  attn_ctas=33, aux_cache=aux, dequant_wgs=nd).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("mosaic_gpu") >= 1


@pytest.mark.parametrize("fmt,d,parts", [("fp8", 128, True), ("int8", 128, True), ("int4", 128, True),
                                         ("int4", 64, False), ("bfloat16", 128, False)])
def test_fused_kernel_reads_the_cache_as_the_decode_kernel_does(fmt, d, parts):
    """The fused kernel's attention CTAs take the decode kernel's resolved options with one dequantizer: fp8's and
    int8's K by wgmmas against the query's parts (int4's at head_dim 128), K in the consumer, V by the dequantizer;
    an fp8 cache once took the consumer's serial dequantizing there."""
    from pallas_kernels.paged_decode_swapped import kernel_options
    sds = jax.ShapeDtypeStruct
    q = sds((256, 32, d), jnp.bfloat16)
    if fmt == "bfloat16":
        cache, aux = sds((2, 4096, 16, 8, d), jnp.bfloat16), None
    else:
        cache, aux = _cache_types(fmt, 16, d)
    o = kernel_options(q, cache, aux, num_ctas=33, dequant_wgs=None if aux is None else 1)
    assert o.query_parts == parts and o.fmt == fmt
    assert o.dequant_wgs == (0 if aux is None else 1) and o.k_in_consumer == (aux is not None)
    assert o.row_sums == "wgmma" and o.num_stages % max(o.dequant_wgs, 1) == 0
    assert kernel_options(q, cache, aux, num_ctas=33, dequant_wgs=0).query_parts is False


@pytest.mark.parametrize("fmt,ps,d,stages,nd,kw", [("bfloat16", 16, 128, 3, 0, {}),
                                                   ("fp8", 16, 128, 4, 1, {"fp8_mma": True}),
                                                   ("int8", 64, 128, 2, 2, {"int8_mma": True}),
                                                   ("int4", 16, 128, 4, 2, {"int8_mma": True}),
                                                   ("int4", 16, 64, 4, 1, {"k_in_consumer": True}),
                                                   ("int8", 16, 128, 3, 0, {})])
def test_swapped_decode_pipelined(paged_case, fmt, ps, d, stages, nd, kw):
    """pipeline: each block's score wgmmas issued behind the block before's P V^T, the scores carried to the next
    step; an item's last step issues them on a stage nobody filled and drops them (lens 1 and 2 x 64 + 5 end
    inside a block, 3 x 16 - 1 at 16-position pages inside one). bf16, K read by fp8 / int8 wgmmas, K dequantized
    into registers, and the consumer dequantizing both (nd 0)."""
    _check_swapped(paged_case, fmt, ps, 4, d, 64, 2, 3, stages, nd, pipeline=True, **kw)


def test_pipeline_refuses_the_dequantizers_k_tiles_and_reduced_sums(paged_case):
    with pytest.raises(ValueError, match="pipeline takes the wgmma row sums"):
        _check_swapped(paged_case, "fp8", 16, 4, 128, 64, 2, 3, 2, 1, pipeline=True, fp8_mma=False,
                       k_in_consumer=False)
    with pytest.raises(ValueError, match="pipeline takes the wgmma row sums"):
        _check_swapped(paged_case, "bfloat16", 16, 8, 128, 64, 2, 3, 3, 0, pipeline=True)     # g 8: reduced sums
    with pytest.raises(ValueError, match="at least 2 stages"):
        _check_swapped(paged_case, "bfloat16", 16, 4, 128, 64, 2, 3, 1, 0, pipeline=True)


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8", "int8", "int4"])
def test_pipelined_swapped_decode_lowers_for_gpu(fmt):
    """The pipelined consumer's three wgmma accumulators in one wait (f32, f32, and f32 or int32) build for the GPU,
    with the formats' default K paths."""
    sds = jax.ShapeDtypeStruct
    if fmt == "bfloat16":
        cache, aux = sds((2, 4096, 16, 8, 128), jnp.bfloat16), None
    else:
        cache, aux = _cache_types(fmt, 16, 128)
    dec = (sds((256, 32, 128), jnp.bfloat16), cache, cache, sds((), jnp.int32), sds((256, 80), jnp.int32),
           sds((256,), jnp.int32))
    text = paged_decode_attention_swapped.trace(*dec, scale=0.1, aux_cache=aux, pipeline=True,
                                                row_sums="wgmma").lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1
