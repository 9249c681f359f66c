"""Decode kernel (Mosaic GPU interpret mode on CPU) against its jnp reference; GPU lowering checked by
cross-lowering for CUDA (no GPU needed)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_decode_attention import choose_num_splits, paged_decode_attention, \
    paged_decode_attention_ref
from pallas_kernels.paged_decode_swapped import paged_decode_attention_swapped
from pallas_kernels.ragged_paged_attention_ref import ragged_paged_attention_ref

KERNELS = {"heads": paged_decode_attention, "swapped": paged_decode_attention_swapped}

# (page_size, group, head_dim, block_kv, num_splits, programs): GQA 1/4/8, pages 16/64, head_dim 64/128
CASES = [(16, 4, 64, 64, None, 3), (64, 8, 128, 64, 3, 4), (16, 1, 128, 128, 2, 5), (64, 4, 64, 128, 1, 2)]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("ps,g,d,bkv,ns,progs", CASES)
def test_decode_kernel_matches_reference(paged_case, kernel, ps, g, d, bkv, ns, progs):
    # ragged lengths, none a multiple of the block; one empty sequence
    lens = [0, 1, 2 * bkv + 5, 3 * ps - 1][:4]
    c = paged_case(kv_heads=2, group=g, head_dim=d, page_size=ps, seq_lens=lens)
    q = c.queries(len(lens))
    out = KERNELS[kernel](q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens), scale=c.scale,
                          num_ctas=progs, num_splits=ns, block_kv=bkv, num_stages=2, interpret=True)
    ref = paged_decode_attention_ref(q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens), c.scale)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), f"unwritten (NaN-poisoned) outputs, seed {c.seed}"
    assert c.rel_err(out, ref) < 1e-2, f"seed {c.seed}"
    assert np.all(out[0] == 0)                                   # empty sequence -> 0


def test_swapped_row_sums_by_reduction_match_reference(paged_case):
    """The swapped kernel's other softmax denominator (f32 cross-warp sums, `row_sums="reduce"`), which it takes
    on all the SMs (the engine's decode attention outside a share)."""
    lens = [0, 1, 2 * 64 + 5, 47]
    c = paged_case(kv_heads=2, group=4, head_dim=64, page_size=16, seq_lens=lens)
    q = c.queries(len(lens))
    out = paged_decode_attention_swapped(q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens),
                                         scale=c.scale, num_ctas=3, block_kv=64, num_stages=2,
                                         row_sums="reduce", interpret=True)
    ref = paged_decode_attention_ref(q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens), c.scale)
    assert c.rel_err(np.asarray(out, np.float32), ref) < 1e-2
    with pytest.raises(ValueError, match="row_sums="):
        paged_decode_attention_swapped(q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens),
                                       scale=c.scale, row_sums="shuffle", interpret=True)


def test_decode_reference_matches_mixed_reference(paged_case):
    c = paged_case(kv_heads=2, group=4, head_dim=64, page_size=16, seq_lens=[7, 40, 16])
    q = c.queries(3)
    lens = jnp.asarray(c.seq_lens)
    a = paged_decode_attention_ref(q, c.k, c.v, c.layer, c.page_table, lens, c.scale)
    b = ragged_paged_attention_ref(q, c.k[c.layer], c.v[c.layer], lens - 1, jnp.arange(3), c.page_table, lens,
                                   c.scale)
    assert c.rel_err(a, b) < 1e-2


def test_choose_num_splits():
    assert choose_num_splits(512, 132) == 1          # 4 rounds, 97% busy
    assert choose_num_splits(8, 132) == 16
    assert choose_num_splits(64, 132) == 2


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("ps,d,kw", [(16, 128, {}), (64, 128, {"block_kv": 64, "num_stages": 4}),
                                     (16, 64, {"num_ctas": 16, "num_splits": 4}),
                                     (16, 128, {"block_kv": 192, "num_stages": 2})])
def test_decode_kernel_lowers_for_gpu(kernel, ps, d, kw):
    if kernel == "heads" and kw.get("block_kv") == 192:
        pytest.skip("192-position blocks fit SMEM only in the swapped kernel (its q/p tiles are 8 rows)")
    sds = jax.ShapeDtypeStruct
    cache = sds((2, 4096, ps, 8, d), jnp.bfloat16)
    args = (sds((64, 32, d), jnp.bfloat16), cache, cache, sds((), jnp.int32), sds((64, 256), jnp.int32),
            sds((64,), jnp.int32))
    KERNELS[kernel].trace(*args, scale=d ** -0.5, **kw).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("row_sums", ["wgmma", "reduce"])
def test_swapped_row_sums_lower_for_gpu(row_sums):
    """Both softmax denominators of the swapped kernel build for the GPU (the engine takes "wgmma" on a share of
    the SMs, "reduce" on all of them)."""
    sds = jax.ShapeDtypeStruct
    cache = sds((2, 4096, 16, 8, 128), jnp.bfloat16)
    args = (sds((64, 32, 128), jnp.bfloat16), cache, cache, sds((), jnp.int32), sds((64, 256), jnp.int32),
            sds((64,), jnp.int32))
    paged_decode_attention_swapped.trace(*args, scale=0.1, row_sums=row_sums).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("live", [0, 2, 3])
def test_swapped_live_rows_visit_only_the_first_rows(paged_case, live):
    """`live_rows` (a mixed step's decodes, first in its max_seqs rows): the persistent CTAs share only the items of
    rows before it (8 of 20 items over 3 CTAs at 2 rows), which match the reference; rows past it come out 0 and
    finite although the kernel leaves their outputs unwritten."""
    lens = [9, 2 * 64 + 5, 47, 33, 70]
    c = paged_case(kv_heads=2, group=4, head_dim=64, page_size=16, seq_lens=lens)
    q = c.queries(len(lens))
    args = (q, c.k, c.v, c.layer, c.page_table, jnp.asarray(c.seq_lens))
    kw = dict(scale=c.scale, num_ctas=3, num_splits=2, block_kv=64, num_stages=2, interpret=True)
    out = np.asarray(paged_decode_attention_swapped(*args, live_rows=jnp.int32(live), **kw), np.float32)
    ref = paged_decode_attention_ref(*args, c.scale)
    assert np.isfinite(out).all()
    assert np.all(out[live:] == 0)
    if live:
        assert c.rel_err(out[:live], ref[:live]) < 1e-2, f"seed {c.seed}"


def test_swapped_live_rows_lower_for_gpu():
    sds = jax.ShapeDtypeStruct
    cache = sds((2, 4096, 16, 8, 128), jnp.bfloat16)
    args = (sds((64, 32, 128), jnp.bfloat16), cache, cache, sds((), jnp.int32), sds((64, 256), jnp.int32),
            sds((64,), jnp.int32))
    paged_decode_attention_swapped.trace(*args, scale=0.1, live_rows=sds((), jnp.int32)).lower(
        lowering_platforms=("cuda",))
