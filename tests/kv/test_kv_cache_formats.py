"""The paged cache in each KV format: writes quantize into the cache (padding dropped), the page-scaled fp8 variant
keeps one scale per page, swapping moves pages as stored, and the references read quantized pages."""
import jax.numpy as jnp
import numpy as np
import pytest

from nfjax.config import CacheConfig, ModelConfig, pages_for
from nfjax.kv.attention import paged_attention, rotate_outputs, rotate_queries
from nfjax.kv.blocked_attention import blocked_paged_attention
from nfjax.kv.cache import KVCache, bytes_per_token
from nfjax.kv.metadata import PADDING_SLOT, build_metadata
from nfjax.kv.prefix_cache import pack_pages, unpack_pages
from pallas_kernels import kv_quant as kq
from pallas_kernels.ragged_paged_attention_ref import ragged_paged_attention_ref

MODEL = ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=64, dtype="bfloat16")


def _cache(fmt, num_pages=6, ps=16):
    return KVCache.create(MODEL, CacheConfig(page_size=ps, num_pages=num_pages, kv_dtype=fmt))


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_write_quantizes_rows_and_drops_padding(fmt):
    kv = _cache(fmt)
    w = kq.aux_width(fmt, 64)
    assert kv.k.shape == (2, 6, 16, 2, 32 if fmt == "int4" else 64) and kv.aux.shape == (2, 6, 16, 2, w)
    assert kv.k.dtype == kq.value_dtype(fmt, None)
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((5, 2, 64)), jnp.bfloat16) for _ in range(2))
    slots = jnp.asarray([3 * 16 + 5, 17, 40, PADDING_SLOT, PADDING_SLOT + 1], jnp.int32)
    out = kv.write(jnp.int32(1), slots, k, v)
    assert out.kv_dtype == fmt and out.k.dtype == kv.k.dtype
    kd, vd = kq.dequantize_kv(out.k, out.v, out.aux)                      # [L, N, PS, KH, D]
    rk, rv = kq.dequantize_kv(*kq.quantize_kv(fmt, k, v))
    for i, s in enumerate([53, 17, 40]):
        assert np.array_equal(np.asarray(kd[1, s // 16, s % 16]), np.asarray(rk[i]))
        assert np.array_equal(np.asarray(vd[1, s // 16, s % 16]), np.asarray(rv[i]))
    written = np.zeros((6, 16), bool)
    written[[3, 1, 2], [5, 1, 8]] = True
    assert np.all(np.asarray(out.k)[1][~written] == 0) and np.all(np.asarray(out.aux)[1][~written] == 0)
    assert np.all(np.asarray(out.k)[0] == 0)                                # the other layer is untouched


def test_page_scaled_fp8_keeps_one_scale_per_page_and_head():
    kv = _cache("fp8_page", num_pages=3)
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((16, 2, 64)) * np.geomspace(0.01, 100, 16)[:, None, None]   # growing rows
    vals = rng.standard_normal((16, 2, 64))
    for t in range(16):          # one token at a time into page 2: the scale grows, earlier rows are re-rounded
        kv = kv.write(jnp.int32(0), jnp.asarray([32 + t], jnp.int32), jnp.asarray(rows[t:t + 1], jnp.float32),
                      jnp.asarray(vals[t:t + 1], jnp.float32))
    aux = np.asarray(kv.aux[0, 2], np.float32)                              # [PS, KH, W]
    assert np.all(aux[:, :, :2] == aux[:1, :, :2])                          # one scale per page and kv head
    np.testing.assert_allclose(aux[0, :, 0], np.abs(rows).max(axis=(0, 2)) / 448, rtol=2 ** -7)
    kd, vd = (np.asarray(a[0, 2]) for a in kq.dequantize_kv(kv.k, kv.v, kv.aux))
    # the last row is rounded once (2^-4 for values in e4m3's normal range); earlier rows were rounded again at
    # every growth of the scale, and their errors add up (up to 25% here, against 6% rounded once: the reason
    # the engine's fp8 keeps a scale per token, docs/design.md section 10)
    big = np.abs(rows) > aux[0, None, :, 0:1] * 2 ** -6
    rel = np.abs(kd - rows) / np.abs(rows)
    assert np.all(rel[-1][big[-1]] <= 2.0 ** -4) and np.all(rel[big] <= 0.3)
    assert np.linalg.norm(vd - vals) / np.linalg.norm(vals) < 0.08     # iid rows: the scale still grows a little
    # a write elsewhere leaves a full page exactly as it was (its scale still holds it: no re-rounding)
    before = [np.asarray(a[0, 2]) for a in kv.arrays()]
    kv = kv.write(jnp.int32(0), jnp.asarray([5], jnp.int32), jnp.asarray(rows[:1], jnp.float32),
                  jnp.asarray(vals[:1], jnp.float32))
    assert all(np.array_equal(b, np.asarray(a[0, 2])) for a, b in zip(kv.arrays(), before))


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8", "int8", "int4"])
def test_take_and_put_pages_move_pages_as_stored(fmt):
    """Swapping's page copies, and the prefix tiers' uint8 rows (pack_pages / unpack_pages), keep pages as stored."""
    kv = _cache(fmt)
    rng = np.random.default_rng(2)
    k, v = (jnp.asarray(rng.standard_normal((96, 2, 64)), jnp.float32) for _ in range(2))
    kv = kv.write(jnp.int32(0), jnp.arange(96, dtype=jnp.int32), k, v)
    blocks = kv.take_pages(jnp.asarray([1, 4]))
    assert len(blocks) == (2 if fmt == "bfloat16" else 3)
    assert blocks[0].dtype == kv.k.dtype and blocks[0].shape == (2, 2, *kv.k.shape[2:])
    moved = kv.put_pages(jnp.asarray([5, 99]), blocks)                       # 99: past the cache, dropped
    for a, b in zip(moved.arrays(), kv.arrays()):
        assert np.array_equal(np.asarray(a[:, 5]), np.asarray(b[:, 1]))
        assert np.array_equal(np.asarray(a[:, :5]), np.asarray(b[:, :5]))
    rows = pack_pages(kv, jnp.asarray([1, 4]))
    assert rows.dtype == jnp.uint8
    for a, b in zip(unpack_pages(kv, jnp.asarray([5, 99]), rows).arrays(), moved.arrays()):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fmt,ps", [("fp8", 16), ("int8", 64), ("int4", 16), ("int4", 64), ("fp8_page", 16)])
def test_references_read_quantized_pages(fmt, ps):
    """Both kernel-less paths (the reference, and the blocked loop the CPU runs) on a mixed batch: a quantized
    cache gives the reference's output on its dequantized pages; int4 stores K and V rotated, so the queries go in
    rotated and the outputs come out rotated back, as `paged_attention` (the engine's entry point) does itself."""
    rng = np.random.default_rng(3)
    specs = [(300, 1), (7, 1), (0, 9), (40, 5)]              # (cached before, new tokens): decodes, then chunks
    need = [pages_for(a + n, ps) for a, n in specs]
    n_pages = sum(need) + 2
    kv = KVCache.create(MODEL, CacheConfig(page_size=ps, num_pages=n_pages, kv_dtype=fmt))
    perm = rng.permutation(np.arange(1, n_pages))
    seqs, off = [], 0
    for (a, n), c in zip(specs, need):
        seqs.append((perm[off:off + c].tolist(), a, n))
        off += c
    meta = build_metadata(seqs, 18, 5, max(need) + 1, ps, num_decode=2).to_device()
    all_slots = np.concatenate([[p * ps + i for p in pg for i in range(ps)][:a + n] for pg, a, n in seqs])
    k, v = (jnp.asarray(rng.standard_normal((len(all_slots), 2, 64)) * 2, jnp.float32) for _ in range(2))
    kv = kv.write(jnp.int32(1), jnp.asarray(all_slots, jnp.int32), k, v)
    q = jnp.asarray(rng.standard_normal((18, 4, 64)), jnp.float32)
    kp, vp, aux = kv.layer_pages(1)
    args = (meta.positions, meta.token_seq, meta.page_table, meta.seq_lens, 0.125)
    qr = rotate_queries(q, kv)
    ref = rotate_outputs(ragged_paged_attention_ref(qr, *kq.dequantize_kv(kp, vp, aux), *args), kv)
    live = 1 + 1 + 9 + 5
    for attend in (ragged_paged_attention_ref, blocked_paged_attention):
        out = rotate_outputs(attend(qr, kp, vp, *args, aux_pages=aux), kv)
        np.testing.assert_allclose(np.asarray(out)[:live], np.asarray(ref)[:live], rtol=2e-5, atol=2e-5)
    out = paged_attention(q, kv, jnp.int32(1), meta, 0.125, use_kernels=False)
    np.testing.assert_allclose(np.asarray(out)[:live], np.asarray(ref)[:live], rtol=2e-5, atol=2e-5)
    exact = ragged_paged_attention_ref(q, *_unquantized(k, v, all_slots, ps, n_pages), *args)   # f32 pages
    err = np.linalg.norm(np.asarray(ref - exact)[:live]) / np.linalg.norm(np.asarray(exact)[:live])
    assert err < (0.05 if fmt.startswith("fp8") else 0.01 if fmt == "int8" else 0.16), err   # e4m3: 2^-4 / sqrt(3) rms


def _unquantized(k, v, slots, ps, n_pages):
    full = [np.zeros((n_pages * ps, 2, 64), np.float32) for _ in range(2)]
    full[0][slots], full[1][slots] = np.asarray(k), np.asarray(v)
    return tuple(jnp.asarray(f.reshape(n_pages, ps, 2, 64)) for f in full)


def test_bytes_per_token_counts_compressed_values_and_scales():
    assert bytes_per_token(MODEL) == 2 * 2 * 2 * 64 * 2                              # bf16 K and V
    assert bytes_per_token(MODEL, kv_dtype="fp8") == 2 * 2 * (2 * 64 + 16)
    assert bytes_per_token(MODEL, kv_dtype="int4") == 2 * 2 * (2 * 32 + 16)
    assert bytes_per_token(MODEL, kv_dtype="int8") == 2 * 2 * (2 * 64 + 16)
    for fmt in ("fp8", "int8", "int4"):       # what the cache really allocates
        kv = _cache(fmt, num_pages=4)
        held = sum(a.size * a.dtype.itemsize for a in kv.arrays())
        assert held == bytes_per_token(MODEL, kv_dtype=fmt) * 4 * 16


def _mixed_step(fmt: str, seed: int):
    """A mixed step over a `fmt` cache at layer 1: two decodes (contexts 40 and 3) and two prefill chunks (9 tokens
    from 0, 14 after 20) on shuffled pages. Returns (kv, seqs, pages each sequence needs, metadata, queries, the
    reference path's attention)."""
    rng = np.random.default_rng(seed)
    specs = [(40, 1), (3, 1), (0, 9), (20, 14)]
    need = [pages_for(a + n, 16) for a, n in specs]
    n_pages = sum(need) + 2
    kv = KVCache.create(MODEL, CacheConfig(page_size=16, num_pages=n_pages, kv_dtype=fmt))
    perm = rng.permutation(np.arange(1, n_pages))
    seqs, off = [], 0
    for (a, n), c in zip(specs, need):
        seqs.append((perm[off:off + c].tolist(), a, n))
        off += c
    slots = np.concatenate([[p * 16 + i for p in pg for i in range(16)][:a + n] for pg, a, n in seqs])
    k, v = (jnp.asarray(rng.standard_normal((len(slots), 2, 64)), jnp.bfloat16) for _ in range(2))
    kv = kv.write(jnp.int32(1), jnp.asarray(slots, jnp.int32), k, v)
    meta = build_metadata(seqs, 28, 5, 5, 16, num_decode=2).to_device()
    q = jnp.asarray(rng.standard_normal((28, 4, 64)), jnp.bfloat16)
    return kv, seqs, need, meta, q, paged_attention(q, kv, jnp.int32(1), meta, 0.125, use_kernels=False)


def test_kernel_path_matches_reference_on_quantized_cache():
    """The engine's attention entry point on a mixed step batch over an int4 cache: the kernels (Mosaic GPU
    interpret mode, dequantizing in the kernel) against the reference path (fp8 and the other shapes:
    tests/pallas_kernels/test_quantized_kv.py)."""
    fmt = "int4"
    from nfjax.kv.attention import paged_attention
    kv, seqs, need, meta, q, ref = _mixed_step(fmt, 4)
    out = paged_attention(q, kv, jnp.int32(1), meta, 0.125, use_kernels=True, interpret=True, num_ctas=3)
    live = 1 + 1 + 9 + 14
    o, r = np.asarray(out[:live], np.float64), np.asarray(ref[:live], np.float64)
    assert np.isfinite(o).all() and np.linalg.norm(o - r) / np.linalg.norm(r) < 1e-2


@pytest.mark.parametrize("fmt,window", [("int4", None), ("fp8", 2)])
def test_prefill_over_a_dequantized_copy_of_its_pages(fmt, window):
    """`copy_pages` (ExecutionConfig.prefill_dequant_first): the prefill rows' pages dequantized into a bfloat16
    copy, the bfloat16 kernel over it (interpret mode), against the reference; with and without the prefill
    window (`max_prefill_seqs`). The copy holds exactly the prefill rows' pages in row order."""
    from nfjax.kv.attention import dequantized_pages
    kv, seqs, need, meta, q, ref = _mixed_step(fmt, 5)
    cap = need[2] + need[3] + 1                                      # the prefill rows' pages, and one to spare
    out = paged_attention(q, kv, jnp.int32(1), meta, 0.125, use_kernels=True, interpret=True, num_ctas=3,
                          max_prefill_seqs=window, copy_pages=cap)
    live = 1 + 1 + 9 + 14
    o, r = np.asarray(out[:live], np.float64), np.asarray(ref[:live], np.float64)
    assert np.isfinite(o).all() and np.linalg.norm(o - r) / np.linalg.norm(r) < 1e-2
    # the path is taken: a copy too small for the rows' pages (the batcher never forms one) drops the last pages
    short = paged_attention(q, kv, jnp.int32(1), meta, 0.125, use_kernels=True, interpret=True, num_ctas=3,
                            max_prefill_seqs=window, copy_pages=need[2])
    assert np.linalg.norm(np.asarray(short[11:live], np.float64) - r[11:]) > 0.1 * np.linalg.norm(r[11:])
    # the copy: rows 2 and 3's pages in order, then page 0; the table points each row's pages at them
    lens = jnp.asarray([0, 0, 9, 34], jnp.int32)
    kc, vc, table = dequantized_pages(kv, jnp.int32(1), meta.page_table[:4], lens, cap)
    pages = seqs[2][0] + seqs[3][0]
    kd, vd = kq.dequantize_kv(kv.k[1], kv.v[1], kv.aux[1], jnp.bfloat16)
    assert kc.shape == (1, cap, 16, 2, 64) and kc.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kc[0, :len(pages)]), np.asarray(kd[jnp.asarray(pages)]))
    np.testing.assert_array_equal(np.asarray(vc[0, len(pages):]), np.asarray(vd[jnp.zeros(1, jnp.int32)]))
    assert np.asarray(table[2])[:need[2]].tolist() == list(range(need[2]))
    assert np.asarray(table[3])[:need[3]].tolist() == list(range(need[2], need[2] + need[3]))
