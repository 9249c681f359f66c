"""Persistent GEMM (Mosaic GPU interpret mode on CPU) against its jnp reference; the real kernel is cross-lowered
for CUDA at the Llama-3-8B shapes (no GPU needed). The interpreter fills new buffers with NaN, so an output
tile that no program wrote shows up as non-finite."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.persistent_gemm import TILE_CONFIGS, TileConfig, persistent_gemm, persistent_gemm_ref, \
    tile_origin


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


# (M, K, N, config, programs). Each interpreted call costs 5-12 s of CPU, so each case covers several paths:
#  200 rows: the last M tile is shifted back (overlap); N=384 with 256-wide tiles: same for N;
#  3 programs over 4 tiles: one program takes two tiles, so its pipeline crosses a tile boundary;
#  100 rows: padded to a multiple of 8 and up to one M tile; K=200: padded to the 64-wide K step;
#  5 stages over 4 K steps: the prefetch of the next tile starts before the current one is consumed.
CASES = [(200, 256, 384, "128x256_s4_ws", 3),      # default: producer warpgroup, chunked epilogue
         (100, 200, 384, "128x256_s3", 1),         # consumer 0 issues the copies; whole-tile epilogue
         (200, 256, 384, "128x128_s5_ws", 1)]


@pytest.mark.parametrize("m,k,n,config,programs", CASES)
def test_gemm_kernel_matches_reference(m, k, n, config, programs):
    seed = int(os.environ.get("NFJAX_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 31))
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.bfloat16)
    out = persistent_gemm(x, w, num_ctas=programs, config=config, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), f"unwritten (NaN-poisoned) outputs, seed {seed}"
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))      # f32, not rounded to bf16
    assert rel_err(out, ref) < 1e-2, f"seed {seed}"
    assert rel_err(out, persistent_gemm_ref(x, w)) < 1e-2


@pytest.mark.parametrize("m,n,bm,bn,gm", [(2048, 28672, 128, 256, 16), (200, 384, 128, 256, 16),
                                          (1000, 4096, 256, 128, 8), (4096, 8192, 128, 256, 16)])
def test_tile_order_covers_output_once(m, n, bm, bn, gm):
    tm, tn = -(-m // bm), -(-n // bn)
    t = jnp.arange(tm * tn, dtype=jnp.int32)
    m0, n0 = (np.asarray(v) for v in tile_origin(t, m=m, n=n, block_m=bm, block_n=bn, group_m=gm))
    assert len(set(zip(m0.tolist(), n0.tolist()))) == tm * tn                 # every tile exactly once
    assert m0.min() == 0 and n0.min() == 0 and m0.max() == m - bm and n0.max() == n - bn   # edges reached
    assert (m0 % 8 == 0).all() and (n0 % 64 == 0).all()                       # TMA offsets on the SMEM tiling
    g = min(gm, tm)
    assert (n0[:g] == n0[0]).all() and len(set(m0[:g].tolist())) == g        # a group shares a w column block


def test_tile_config_check():
    for cfg in TILE_CONFIGS.values():
        cfg.check()
    with pytest.raises(ValueError):
        TileConfig(128, 256, 64, stages=5, epi_cols=256).check()             # over 227 KB of SMEM
    with pytest.raises(ValueError):
        TileConfig(256, 256).check()                                          # 256 accumulator registers


LLAMA3_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]      # qkv, o_proj, gate_up, down


@pytest.mark.parametrize("config", sorted(TILE_CONFIGS))
def test_gemm_kernel_lowers_for_gpu(config):
    sds = jax.ShapeDtypeStruct
    for i, (k, n) in enumerate(LLAMA3_8B):
        m = (2048, 512, 1000, 4096)[i]         # 1000: padded to a multiple of 8, last M tile shifted back
        args = (sds((m, k), jnp.bfloat16), sds((k, n), jnp.bfloat16))
        persistent_gemm.trace(*args, config=config, num_ctas=(None, 88)[i % 2]).lower(
            lowering_platforms=("cuda",))


def test_swiglu_epilogue_matches_the_unfused_ops():
    """act="swiglu" on the dense kernel (the MLP's gate/up, nfjax/models/dense.py): gate and up interleaved in blocks
    of half a tile give silu(x @ gate) * (x @ up) rounded as the unfused GEMM + swiglu round it; 200 rows (the last
    M tile shifted back) over 3 programs and 2 column tiles."""
    from nfjax.models.llama import swiglu
    from pallas_kernels.grouped_gemm_ref import interleave
    seed = int(os.environ.get("NFJAX_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 31))
    kx, kg, ku = jax.random.split(jax.random.key(seed), 3)
    m, k, f = 200, 128, 256
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    gate, up = (jax.random.normal(kk, (k, f), jnp.bfloat16) * 0.1 for kk in (kg, ku))
    w = interleave(gate, up, TILE_CONFIGS["128x256_s4_ws"].block_n // 2)
    out = persistent_gemm(x, w, num_ctas=3, act="swiglu", interpret=True)
    assert out.shape == (m, f) and out.dtype == jnp.bfloat16
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), f"unwritten (NaN-poisoned) outputs, seed {seed}"
    want = np.asarray(swiglu(persistent_gemm_ref(x, gate), persistent_gemm_ref(x, up)), np.float32)
    assert rel_err(out, want) < 1e-2, f"seed {seed}"


def test_swiglu_epilogue_refusals():
    sds = jax.ShapeDtypeStruct
    x, w = sds((256, 128), jnp.bfloat16), sds((128, 384), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of block_n"):          # 384 columns: a tile straddles gate/up
        persistent_gemm.trace(x, w, act="swiglu").lower(lowering_platforms=("cuda",))
    w = sds((128, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="epi_cols"):     # a 256-column epilogue over a 128-column result: no store
        persistent_gemm.trace(x, w, act="swiglu", config="128x256_s3").lower(lowering_platforms=("cuda",))


def test_swiglu_epilogue_lowers_for_gpu():
    sds = jax.ShapeDtypeStruct
    for m in (128, 384, 2048):
        persistent_gemm.trace(sds((m, 4096), jnp.bfloat16), sds((4096, 28672), jnp.bfloat16),
                              act="swiglu").lower(lowering_platforms=("cuda",))
