"""Grouped GEMM (Mosaic GPU interpret mode on CPU) against its jnp reference and XLA's `jax.lax.ragged_dot`;
the real kernel is cross-lowered for CUDA at Mixtral-8x7B's expert shapes (no GPU needed). The interpreter fills
new buffers with NaN, so a row of a group that no tile wrote shows up as non-finite."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_gemm import group_alignment, grouped_gemm, tile_table
from pallas_kernels.grouped_gemm_ref import grouped_gemm_ref


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _seed() -> int:
    return int(os.environ.get("NFJAX_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 31))


# (group sizes in units of the 128-row alignment, tail tiles, K, N, config, programs). One interpreted call costs
# several seconds of CPU, so the case covers: an empty expert between two others, a group of two M tiles, a
# static tail nobody computes, N=384 over 256-wide tiles (the last N tile shifted back), 3 programs over 8 tiles
# (pipelines crossing tiles of different experts), 2 K steps.
CASES = [((1, 0, 2), 1, 128, 384, "128x256_s4_ws", 3),
         ((1, 0, 3), 1, 128, 384, "64x256_s5_ws_n", 3)]    # 64-row tiles: the consumers split the columns


@pytest.mark.parametrize("groups,tail,k,n,config,programs", CASES)
def test_grouped_gemm_kernel_matches_reference(groups, tail, k, n, config, programs):
    seed = _seed()
    a = group_alignment(config)
    sizes = jnp.asarray([g * a for g in groups], jnp.int32)
    m = (sum(groups) + tail) * a
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (len(groups), k, n), jnp.bfloat16)
    out = np.asarray(grouped_gemm(x, w, sizes, num_ctas=programs, config=config, interpret=True), np.float32)
    valid = int(sizes.sum())
    assert out.shape == (m, n)
    assert np.isfinite(out[:valid]).all(), f"unwritten (NaN-poisoned) rows, seed {seed}"
    ref = grouped_gemm_ref(x.astype(jnp.float32), w.astype(jnp.float32), sizes)      # f32, not rounded
    assert _rel_err(out[:valid], ref[:valid]) < 1e-2, f"seed {seed}"
    xla = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
    assert _rel_err(out[:valid], xla[:valid]) < 1e-2, f"seed {seed}"


def test_reference_equals_ragged_dot_on_unaligned_groups():
    """The reference and XLA's ragged_dot agree on any group sizes (the CPU path runs unpadded groups),
    rows past the groups included (zeros)."""
    rng = np.random.default_rng(_seed())
    x = jnp.asarray(rng.standard_normal((37, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 24, 40)), jnp.float32)
    sizes = jnp.asarray([5, 0, 17, 9], jnp.int32)                          # 31 rows grouped, 6 past them
    ref = np.asarray(grouped_gemm_ref(x, w, sizes))
    np.testing.assert_allclose(np.asarray(jax.lax.ragged_dot(x, w, sizes)), ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ref[5:22], np.asarray(x[5:22] @ w[2]), rtol=1e-5, atol=1e-4)
    assert not ref[31:].any()


def test_tile_table():
    t = np.asarray(tile_table(jnp.asarray([256, 0, 128, 0], jnp.int32), m=640, block_m=128, tiles_n=3))
    assert t[0] == 3 * 3                                   # 3 valid M tiles x 3 N tiles
    assert t[1:].tolist() == [0, 0, 2, 4, 4]               # experts of the M tiles; 4 = past the groups


MIXTRAL = [(4096, 14336), (14336, 4096)]                   # an expert's gate/up and down


@pytest.mark.parametrize("num_ctas", [None, 66])
def test_grouped_gemm_lowers_for_gpu(num_ctas):
    sds = jax.ShapeDtypeStruct
    for k, n in MIXTRAL:
        m = 2048 * 2 + 8 * 128                              # 2048 tokens x top-2 + the padding bound
        args = (sds((m, k), jnp.bfloat16), sds((8, k, n), jnp.bfloat16), sds((8,), jnp.int32))
        grouped_gemm.trace(*args, num_ctas=num_ctas).lower(lowering_platforms=("cuda",))


def test_swiglu_epilogue_matches_the_unfused_ops():
    """act="swiglu" over a gate/up weight interleaved in blocks of half a tile: silu(x @ gate) * (x @ up) per
    group, as the unfused GEMMs and nfjax's swiglu give it (bf16 outputs rounded alike), N / 2 columns."""
    from nfjax.models.llama import swiglu
    from pallas_kernels.grouped_gemm import swiglu_block
    from pallas_kernels.grouped_gemm_ref import deinterleave, interleave
    seed = _seed()
    a, blk = group_alignment(), swiglu_block()
    sizes = jnp.asarray([a, 0, 2 * a], jnp.int32)
    m, k, h = 4 * a, 128, 2 * blk                                  # two tiles of [gate | up] a row block
    kx, kg, ku = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    gate, up = (jax.random.normal(kk, (3, k, h), jnp.bfloat16) * 0.2 for kk in (kg, ku))
    w = interleave(gate, up, blk)
    np.testing.assert_array_equal(np.asarray(deinterleave(w.reshape(3 * k, 2 * h), blk)[1]),
                                  np.asarray(up.reshape(3 * k, h)))
    out = np.asarray(grouped_gemm(x, w, sizes, num_ctas=3, act="swiglu", interpret=True), np.float32)
    valid = int(sizes.sum())
    assert out.shape == (m, h)
    assert np.isfinite(out[:valid]).all(), f"unwritten (NaN-poisoned) rows, seed {seed}"
    want = swiglu(grouped_gemm_ref(x, gate, sizes), grouped_gemm_ref(x, up, sizes))
    assert _rel_err(out[:valid], want[:valid]) < 1e-2, f"seed {seed}"


def test_swiglu_epilogue_lowers_for_gpu():
    sds = jax.ShapeDtypeStruct
    m = 2048 * 2 + 8 * 128
    args = (sds((m, 4096), jnp.bfloat16), sds((8, 4096, 2 * 14336), jnp.bfloat16), sds((8,), jnp.int32))
    grouped_gemm.trace(*args, act="swiglu").lower(lowering_platforms=("cuda",))
