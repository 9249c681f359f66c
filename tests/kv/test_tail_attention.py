"""fp8r (docs/design.md section 14.3): fp8 pages and each sequence's filling group of K and V in bfloat16 tail rows.
The write keeps both; the CPU's reference paths read K and V past the last complete group from the tails; the
kernel path (Mosaic GPU interpret mode) reads the complete groups with the fp8 kernels and the tails with the
bfloat16 one (nfjax/kv/tail_attention.py), and matches the reference on a mixed step."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nfjax.config import CacheConfig, ConfigError
from nfjax.kv.attention import paged_attention
from nfjax.kv.cache import KVCache
from pallas_kernels import kv_kivi64 as kk
from pallas_kernels import kv_quant as kq
from tests.kv.test_kivi64_cache import CFG, P, PAGES, PLANS, T, _steps, _write


def _cache():
    return KVCache.create(CFG, CacheConfig(page_size=64, num_pages=13, max_pages_per_seq=P, kv_dtype="fp8r"),
                          tail_rows=4)


def _written(plans):
    steps, ks, vs, lens = _steps(plans)
    kv = _cache()
    for meta, k, v in steps:
        kv = _write(kv, k, v, meta)
    return steps, ks, vs, lens, kv


def test_pages_hold_fp8_and_the_tail_the_filling_group_exact():
    _, ks, vs, lens, kv = _written(PLANS)
    pt = jnp.asarray(PAGES)
    rows = jnp.arange(1, 4)
    k_out, v_out = (np.asarray(a) for a in kk.read_pages(kv.k[1][pt], kv.v[1][pt], kv.aux[1][pt], kv.k_tail[1][rows],
                                                         jnp.asarray(lens), v_tail=kv.v_tail[1][rows]))
    flat = [a[1][pt].reshape(3, P * 64, 2, -1) for a in (kv.k, kv.v, kv.aux)]
    k_fp8, v_fp8 = (np.asarray(a) for a in kq.dequantize_kv(*flat))
    for i, n in enumerate(lens):
        f = n // 64 * 64
        assert np.array_equal(k_out[i, :f], k_fp8[i, :f]), i                   # complete groups: the fp8 pages
        assert np.array_equal(k_out[i, f:n], ks[i][f:n]), i                     # the filling group: exact
        assert not np.array_equal(k_fp8[i, f:n], ks[i][f:n]), i                 # (which fp8 is not)
        assert np.array_equal(v_out[i, :f], v_fp8[i, :f]), i                    # V likewise
        assert np.array_equal(v_out[i, f:n], np.asarray(jnp.asarray(vs[i][f:n], jnp.bfloat16), np.float32)), i
        assert np.abs(v_fp8[i, :n] - vs[i][:n]).max() < 0.07 * np.abs(vs[i][:n]).max(), i
    assert np.all(np.asarray(kv.k_tail[0]) == 0) and np.all(np.asarray(kv.v_tail[0]) == 0)   # other layers untouched


@pytest.mark.parametrize("plans,window", [([[70, 60], [64, 1], [5, 58]], None), ([[70, 60], [64, 1], [5, 58]], 2),
                                          ([[62, 0, 1], [0, 63, 1], [70, 0, 1]], None)])
def test_kernel_path_reads_the_tail_as_the_reference_does(plans, window):
    """A mixed step (a chunk ending two positions into a group, a decode one position past a group, a chunk inside
    the first group), and a step of decodes at lengths 63 (no complete group: the fp8 call reads nothing), 64 (an
    empty tail) and 71: the decode kernel over complete groups with the tail's bfloat16 call merged as splits, the
    prefill over a bfloat16 copy with the tail rows spliced in, against the reference (the blocked loop)."""
    steps, _, _, lens, kv = _written(plans)
    meta = steps[-1][0]
    q = jnp.asarray(np.random.default_rng(5).standard_normal((T, 4, 64)), jnp.bfloat16)
    ref = np.asarray(paged_attention(q, kv, jnp.int32(1), meta, 0.125, use_kernels=False), np.float64)
    live = int(np.asarray(meta.query_start)[-1])
    run = jax.jit(lambda kv: paged_attention(q, kv, jnp.int32(1), meta, 0.125, use_kernels=True, interpret=True,
                                             num_ctas=3, max_prefill_seqs=window, copy_pages=8))
    out = np.asarray(run(kv), np.float64)
    err = np.linalg.norm(out[:live] - ref[:live]) / np.linalg.norm(ref[:live])
    assert np.isfinite(out).all() and err < 1e-2, err
    # the tails are read: with K's or V's tail rows zeroed, the rows that see a filling group's position move, and
    # no other row does
    pos, seq = np.asarray(meta.positions)[:live], np.asarray(meta.token_seq)[:live]
    sees = pos >= np.asarray(meta.seq_lens)[seq] // 64 * 64
    assert sees.any() and (~sees).any()
    for name in ("k_tail", "v_tail"):
        zeroed = np.asarray(run(dataclasses.replace(kv, **{name: jnp.zeros_like(getattr(kv, name))})), np.float64)
        moved = np.linalg.norm(zeroed[:live] - out[:live], axis=(1, 2)) / np.linalg.norm(out[:live], axis=(1, 2))
        assert (moved[sees] > 0.01).all() and (moved[~sees] == 0).all(), (name, moved)


def test_fp8r_needs_pages_of_64_and_a_prefill_copy():
    with pytest.raises(ConfigError, match=r"fp8r needs pages of 64.*--page-size.*16"):
        CacheConfig(kv_dtype="fp8r")
    steps, _, _, _, kv = _written([[70], [64], [5]])
    q = jnp.zeros((T, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="fp8r's prefill reads a bfloat16 copy"):
        paged_attention(q, kv, jnp.int32(1), steps[-1][0], 0.125, use_kernels=True, interpret=True, num_ctas=3)
