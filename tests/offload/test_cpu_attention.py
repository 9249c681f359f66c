"""Attention on the CPU (policy cpu_attention, nfjax/offload/cpu_attention.py) and Top-K sparse attention (policy
attention_topk): the attention against a numpy reference written here (grouped heads, causal rows, the Top-K rule),
and offloaded generation with the KV cache off the GPU and its decode attention on the CPU giving the paged
engine's tokens (float32), with the CPU attention in the measured trace."""
from __future__ import annotations

import math

import numpy as np
import pytest

from nfjax.engine import SamplingParams
from nfjax.offload import Policy, Split
from nfjax.offload.cpu_attention import cpu_attention
from nfjax.offload.engine import OffloadEngine
from tests.offload.common import MAX_LEN, PROMPTS, engine_tokens, model, tokenizer


def reference(q, k, v, positions, scale, topk=1.0):
    """q [B*T, H, D], k/v [B, S, KH, D], positions [B, T] -> [B*T, H*D]: row b's query at position p attends to
    positions <= p, keeping the ceil(topk (p + 1)) largest scores."""
    b, t = positions.shape
    h, d = q.shape[1:]
    kh = k.shape[2]
    out = np.zeros((b, t, h, d))
    for i in range(b):
        for j in range(t):
            p = positions[i, j]
            for hh in range(h):
                g = hh // (h // kh)
                s = (k[i, :p + 1, g] @ q[i * t + j, hh]) * scale
                keep = max(1, math.ceil(topk * (p + 1)))
                thr = np.sort(s)[::-1][keep - 1]
                s = np.where(s >= thr, s, -np.inf)
                w = np.exp(s - s.max())
                out[i, j, hh] = (w / w.sum()) @ v[i, :p + 1, g]
    return out.reshape(b * t, h * d)


@pytest.mark.parametrize("t", [1, 3])
def test_cpu_attention_matches_numpy(t):
    rng = np.random.default_rng(0)
    b, s, h, kh, d = 3, 24, 4, 2, 16
    q = rng.standard_normal((b * t, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kh, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kh, d)).astype(np.float32)
    positions = np.array([[p + i for i in range(t)] for p in (5, 11, 20)], np.int32)
    for topk in (1.0, 0.9999, 0.5, 0.1):
        got = cpu_attention(q, (k, v), positions, d ** -0.5, topk)
        np.testing.assert_allclose(got, reference(q, k, v, positions, d ** -0.5, topk), rtol=2e-5, atol=2e-5)
    # K = 100% (every score kept through the Top-K path) is the dense result
    np.testing.assert_allclose(cpu_attention(q, (k, v), positions, d ** -0.5, 0.9999),
                               cpu_attention(q, (k, v), positions, d ** -0.5, 1.0), rtol=1e-6, atol=1e-6)
    assert not np.allclose(cpu_attention(q, (k, v), positions, d ** -0.5, 0.1),
                           cpu_attention(q, (k, v), positions, d ** -0.5, 1.0), atol=1e-3)



@pytest.mark.parametrize("chunks", [64, None])
def test_cpu_attention_pieces_combine_to_the_whole(chunks, monkeypatch):
    """A block attended in chunks (a row's queries ending in different chunks, one row whose first query's chunk
    holds nothing past it) equals the numpy reference; in 64-position chunks, the chunks wholly past a row's last
    query are never read."""
    import nfjax.offload.cpu_attention as ca
    if chunks:
        monkeypatch.setattr(ca, "chunk_positions", lambda k: chunks)
    rng = np.random.default_rng(1)
    b, t, s, h, kh, d = 2, 3, 400, 4, 2, 16
    q = rng.standard_normal((b * t, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kh, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kh, d)).astype(np.float32)
    positions = np.array([[3, 130, 131], [200, 255, 256]], np.int32)
    want = reference(q, k, v, positions, d ** -0.5)
    np.testing.assert_allclose(cpu_attention(q, (k, v), positions, d ** -0.5), want, rtol=2e-5, atol=2e-5)
    if chunks:
        k[:, 320:], v[:, 320:] = np.nan, np.nan
        np.testing.assert_allclose(cpu_attention(q, (k, v), positions, d ** -0.5), want, rtol=2e-5,
                                   atol=2e-5)


def test_cpu_attention_int4_block_matches_the_device_function(monkeypatch):
    """The int4 (rotated) format in pieces equals `dense_attention` over the whole block, the device's function."""
    import jax.numpy as jnp

    import nfjax.offload.cpu_attention as ca
    from nfjax.offload.compute import BatchKV, dense_attention
    from pallas_kernels import kv_quant
    monkeypatch.setattr(ca, "chunk_positions", lambda k: 64)
    rng = np.random.default_rng(2)
    b, s, h, kh, d = 2, 200, 8, 2, 64
    k = jnp.asarray(rng.standard_normal((b, s, kh, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, s, kh, d)), jnp.bfloat16)
    arrays = tuple(np.asarray(a) for a in kv_quant.quantize_kv("int4", k, v))
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    positions = np.array([[150], [199]], np.int32)
    want = dense_attention(jnp.asarray(q), BatchKV(arrays), jnp.asarray(positions), d ** -0.5)
    np.testing.assert_allclose(cpu_attention(q, arrays, positions, d ** -0.5), np.asarray(want), rtol=1e-4,
                               atol=1e-4)

POLICIES = {
    # one batch a block (the CPU's attention in series); Top-K at 99.99%: every score kept, through the sparse path
    "kv-cpu-topk100": Policy(gpu_batch_size=4, num_gpu_batches=1, cache=Split(0, 100, 0), cpu_attention=True,
                             attention_topk=99.99),
    # three batches: each batch's CPU attention runs while the device starts the next batch
    "kv-all-tiers": Policy(gpu_batch_size=2, num_gpu_batches=3, weights=Split(50, 50, 0), cache=Split(30, 30, 40),
                           cpu_attention=True),
    "row-by-row": Policy(gpu_batch_size=4, num_gpu_batches=1, cache=Split(0, 100, 0), cpu_attention=True,
                         schedule="row_by_row"),
}


@pytest.mark.parametrize("name", ["opt", "llama"])
def test_tokens_equal_the_paged_engine_with_attention_on_the_cpu(name, tmp_path):
    want = engine_tokens(name)
    for label, pol in POLICIES.items():
        if name == "llama" and label != "kv-all-tiers":
            continue                         # Llama's grouped heads: one placement (the numpy test covers more)
        pol = pol.replace(offload_dir=str(tmp_path))
        with OffloadEngine.from_model(model(name), tokenizer(name), pol, max_model_len=MAX_LEN, trace=True) as eng:
            outs = eng.generate(PROMPTS, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
            eng.trace.flush()
            cpu = [e for e in eng.trace.events if e.lane == "cpu attention"]
        assert tuple(tuple(o.token_ids) for o in outs) == want, label
        # every decode pass attended each CPU-held block on the CPU: 15 passes x its blocks x blocks of prompts
        held = sum(t != "gpu" for t in _kv_tiers(pol, model(name).cfg.num_layers))
        blocks = -(-len(PROMPTS) // pol.block_size)
        assert len(cpu) == 15 * held * blocks, label


def _kv_tiers(pol, layers):
    from nfjax.offload.store import kv_tiers
    return kv_tiers(layers, pol.num_gpu_batches, pol.cache)


def test_cpu_attention_over_the_int4_cache(tmp_path):
    """The KV cache in int4 (head_dim 64): attending the packed blocks on the CPU gives the tokens the device
    gives with the cache on the GPU (the same dequantization, on the other backend)."""
    from nfjax.models.random_init import random_model
    from tests.offload.common import OPT
    m = random_model(OPT.replace(hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64), seed=5, std=0.25,
                     host=True)
    got = []
    for cache, ca in ((Split(100, 0, 0), False), (Split(30, 30, 40), True)):
        pol = Policy(gpu_batch_size=2, num_gpu_batches=3, cache=cache, compress_cache=True, cpu_attention=ca,
                     offload_dir=str(tmp_path))
        with OffloadEngine.from_model(m, tokenizer("opt"), pol, max_model_len=MAX_LEN) as eng:
            got.append([o.token_ids for o in eng.generate(PROMPTS, SamplingParams.greedy(max_tokens=8,
                                                                                         ignore_eos=True))])
    assert got[0] == got[1]


def test_chunk_positions_hold_about_piece_bytes_of_k():
    from nfjax.offload.cpu_attention import PIECE_BYTES, chunk_positions
    assert chunk_positions(np.zeros((1, 1, 56, 128), np.float16)) == 256          # OPT-30B: 14 KB a position
    assert chunk_positions(np.zeros((1, 1, 16, 128), np.float16)) == 1024
    assert chunk_positions(np.zeros((1, 1, 64, 256), np.float32)) == 64           # never below 64
    for kh in (1, 3, 8, 40):
        row = kh * 128 * 2
        c = chunk_positions(np.zeros((1, 1, kh, 128), np.float16))
        assert c * row <= max(PIECE_BYTES, 64 * row) and (c == 64 or 2 * c * row > PIECE_BYTES)


def test_piece_count_is_the_split_cpu_attention_makes(monkeypatch):
    """`piece_count` (what the cost model reads) counts the pieces `cpu_attention` runs, for a block whose rows are
    all live."""
    from nfjax.offload import cpu_attention as ca
    seen = []
    real = ca._chunk

    def spy(q, arrays, positions, i, start, size, scale):
        seen.append((i, start))
        return real(q, arrays, positions, i, start, size, scale)
    monkeypatch.setattr(ca, "_chunk", spy)
    monkeypatch.setattr(ca, "PIECE_BYTES", 4 * 1024)             # 64 positions of 4 KV heads x 16 (f32) a piece
    b, s, kh, d = 3, 200, 4, 16
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((b, s, kh, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((b, 2 * kh, d)).astype(np.float32)
    ca.cpu_attention(q, (k, v), np.full((b, 1), s - 1, np.int32), d ** -0.5)
    assert len(seen) == ca.piece_count(b, s, kh * d * 4) == 3 * 4
