"""kivi64 in the paged cache (nfjax/kv/kivi64.py): K written through steps of every shape (a prefill of whole
groups, chunks ending mid-group, decodes filling a group one position at a time, several sequences a step) reads
back as its groups quantized per channel and its filling group exact; a step split into nano-batches writes the
same cache; attention on the CPU (blocked loop and reference) matches softmax attention over what is read."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nfjax.config import CacheConfig, ConfigError, ModelConfig
from nfjax.kv.attention import paged_attention
from nfjax.kv.cache import KVCache
from nfjax.kv.metadata import build_metadata
from nfjax.schedule.meta import nano_metadata
from pallas_kernels import kv_kivi64 as kk
from pallas_kernels import kv_quant as kq
from pallas_kernels.ragged_paged_attention_ref import ragged_paged_attention_ref

CFG = ModelConfig(vocab_size=258, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=64, max_position_embeddings=512, eos_token_ids=(257,), bos_token_id=256, dtype="bfloat16")
T, S, P = 160, 4, 4
PAGES = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
# tokens each sequence writes per step (0: not in the step): whole groups, mid-group chunks, decodes
PLANS = [[70, 60, 1, 1, 1, 0, 1, 66],
         [64, 64, 10, 1, 1, 1, 1, 1],
         [0, 5, 59, 1, 62, 1, 0, 2]]


@jax.jit
def _write(kv, k, v, meta):
    return kv.write(jnp.int32(1), meta.slot_mapping, k, v, meta)


def _steps(plans, seed=0):
    """(metadata, K, V) of each step, decodes first, and each sequence's K and V in bfloat16."""
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((sum(p), 2, 64)).astype(np.float32) for p in plans]
    for k in ks:
        k[..., 3] += 30.0                                           # an outlier channel
    ks = [np.asarray(jnp.asarray(k, jnp.bfloat16), np.float32) for k in ks]
    vs = [rng.standard_normal(k.shape).astype(np.float32) for k in ks]
    pos, out = [0] * len(plans), []
    for st in range(len(plans[0])):
        live = sorted((plans[i][st] != 1, i) for i in range(len(plans)) if plans[i][st])
        seqs = [(PAGES[i], pos[i], plans[i][st]) for _, i in live]
        meta = build_metadata(seqs, T, S, P, 64, num_decode=sum(1 for s in seqs if s[2] == 1),
                              kv_tails=[i + 1 for _, i in live])          # tail rows 1..3: any row will do
        k, v = np.zeros((T, 2, 64), np.float32), np.zeros((T, 2, 64), np.float32)
        o = 0
        for _, i in live:
            n = plans[i][st]
            k[o:o + n], v[o:o + n] = ks[i][pos[i]:pos[i] + n], vs[i][pos[i]:pos[i] + n]
            o, pos[i] = o + n, pos[i] + n
        out.append((meta.to_device(), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)))
    return out, ks, vs, pos


def _cache():
    return KVCache.create(CFG, CacheConfig(page_size=64, num_pages=13, max_pages_per_seq=P, kv_dtype="kivi64"),
                          tail_rows=4)


def _read(kv, lens):
    pt = jnp.asarray(PAGES)
    return kk.read_pages(kv.k[1][pt], kv.v[1][pt], kv.aux[1][pt], kv.k_tail[1][jnp.arange(1, 4)], jnp.asarray(lens))


def test_k_reads_back_quantized_by_group_and_exact_in_the_tail():
    steps, ks, vs, lens = _steps(PLANS)
    kv = _cache()
    for meta, k, v in steps:
        kv = _write(kv, k, v, meta)
    k_out, v_out = (np.asarray(a) for a in _read(kv, lens))
    for i, n in enumerate(lens):
        f = n // 64 * 64
        x = ks[i][:f].reshape(-1, 64, 2, 64)
        step = (x.max(1, keepdims=True) - x.min(1, keepdims=True)) / 15
        assert np.all(np.abs(k_out[i, :f].reshape(x.shape) - x) <= 0.54 * step + 1e-6), i   # per channel
        assert np.array_equal(k_out[i, f:n], ks[i][f:n]), i                                 # the filling group
        vr = np.asarray(kq.rotate(jnp.asarray(vs[i][:n]), jnp.float32))
        assert np.abs(v_out[i, :n] - vr).max() < 0.15 * np.abs(vr).max(), i
    assert np.all(np.asarray(kv.k[0]) == 0) and np.all(np.asarray(kv.k_tail[0]) == 0)    # other layers untouched


def test_nano_batches_write_the_same_cache():
    steps, _, _, lens = _steps(PLANS)
    whole, split = _cache(), _cache()
    for meta, k, v in steps:
        whole = _write(whole, k, v, meta)
        for lo, hi in ((0, 50), (50, T)):        # the cut falls inside a prefill chunk
            split = _write(split, k[lo:hi], v[lo:hi], nano_metadata(meta, lo, hi))
    for name in ("k", "v", "aux"):
        assert np.array_equal(np.asarray(getattr(whole, name)), np.asarray(getattr(split, name))), name
    # the tails hold the same filling groups (rows past them are dead: a nano-batch may leave rows there)
    for a, b in zip(_read(whole, lens), _read(split, lens)):
        for i, n in enumerate(lens):
            assert np.array_equal(np.asarray(a)[i, :n], np.asarray(b)[i, :n])


def test_attention_reads_the_pages_and_the_tail():
    plans = [[70, 60], [64, 1], [5, 58]]
    steps, _, _, lens = _steps(plans)
    kv = _cache()
    for meta, k, v in steps:
        kv = _write(kv, k, v, meta)
    meta = steps[-1][0]
    q = jnp.asarray(np.random.default_rng(5).standard_normal((T, 4, 64)), jnp.bfloat16)
    out = np.asarray(paged_attention(q, kv, jnp.int32(1), meta, 0.125), np.float32)     # CPU: the blocked loop
    # the same through the plain reference (rotated V: the outputs come back through H)
    tails = kv.tail_rows(jnp.int32(1), meta.kv_tail)
    ref = ragged_paged_attention_ref(q, kv.k[1], kv.v[1], meta.positions, meta.token_seq, meta.page_table,
                                     meta.seq_lens, 0.125, aux_pages=kv.aux[1], k_tail=tails)
    ref = np.asarray(kq.rotate(ref), np.float32)
    # and by hand from what the cache reads back: sequence 0's chunk of 60 (positions 70..129), causal
    k_out, v_out = (np.asarray(a) for a in _read(kv, lens))
    qs = np.asarray(meta.query_start)
    i0 = int(np.flatnonzero(np.asarray(meta.slot_mapping) == PAGES[0][2] * 64 + 1)[0])   # position 129 of seq 0
    qq = np.asarray(q[i0], np.float32).reshape(2, 2, 64)
    sc = np.einsum("kgd,lkd->kgl", qq, k_out[0, :130]) * 0.125
    w = np.exp(sc - sc.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    hand = np.asarray(kq.rotate(jnp.asarray(np.einsum("kgl,lkd->kgd", w, v_out[0, :130]).reshape(4, 64))))
    assert qs[-1] == sum(p[-1] for p in plans)
    assert np.abs(out[:qs[-1]] - ref[:qs[-1]]).max() < 2e-2 * np.abs(ref).max()
    assert np.abs(out[i0] - hand).max() < 2e-2 * np.abs(hand).max()


def test_kivi64_needs_pages_of_64():
    with pytest.raises(ConfigError, match=r"kivi64 needs pages of 64.*--page-size.*16"):
        CacheConfig(kv_dtype="kivi64")
    with pytest.raises(ValueError, match="tail_rows"):
        KVCache.create(CFG, CacheConfig(page_size=64, num_pages=3, max_pages_per_seq=2, kv_dtype="kivi64"))
