"""The horizontal kernel (decode attention beside a GEMM) and the side-by-side-weights GEMM it runs.

The CPU Mosaic GPU interpreter of jax 0.10.2 cannot run the fused kernel (its `run_scoped` branches close
over the kernel's refs, which the interpreter's lowering rejects), so here it is cross-lowered for CUDA; its
outputs are compared with the two kernels run separately on the device by `bench/kernels/decode_share.py
--fused-only` (equal GEMM, attention within 1.7e-3, bench/results/decode_share-fused-20261123.json). The
multi-weight GEMM path, the part the fused kernel adds to the GEMM, runs here in the interpreter (through the
kernel body, `persistent_gemm.gemm_kernel`)."""
import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._compat import mosaic_gpu_interpret_params
from pallas_kernels._mgpu import compiler_params
from pallas_kernels.attention_beside_gemm import decode_attention_beside_gemm, gemm_fits
from pallas_kernels.persistent_gemm import DEFAULT_CONFIG, NUM_WGS, TILE_CONFIGS, cdiv, gemm_kernel, gemm_scratch, \
    persistent_gemm_ref


def _gemm_side_by_side(x, ws, num_ctas, cfg):
    """The GEMM half of the fused kernel on its own: `gemm_kernel` over a tuple of weights, in the interpreter."""
    n_tiles = cdiv(x.shape[0], cfg.block_m) * sum(w.shape[1] for w in ws) // cfg.block_n
    nw = len(ws)

    def body(x_hbm, *rest):
        gemm_kernel(x_hbm, tuple(rest[:nw]), tuple(rest[nw:2 * nw]), *rest[2 * nw:], cfg=cfg,
                    num_ctas=min(num_ctas, n_tiles))

    return plgpu.kernel(
        body, out_type=tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype) for w in ws),
        scratch_types=gemm_scratch(cfg, x.dtype), grid=(min(num_ctas, n_tiles),), grid_names=("p",),
        num_threads=NUM_WGS + int(cfg.producer), thread_name="wg", compiler_params=compiler_params(),
        interpret=mosaic_gpu_interpret_params())(x, *ws)


def test_gemm_over_weights_side_by_side_matches_reference():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (136, 128), jnp.bfloat16)            # 2 M-tiles, the last one shifted back
    ws = (jax.random.normal(k2, (128, 256), jnp.bfloat16), jax.random.normal(k3, (128, 512), jnp.bfloat16))
    cfg = TILE_CONFIGS[DEFAULT_CONFIG]
    ys = _gemm_side_by_side(x, ws, 3, cfg)
    for y, w in zip(ys, ws):
        ref = np.asarray(persistent_gemm_ref(x, w), np.float32)
        assert np.abs(np.asarray(y, np.float32) - ref).max() <= 0.02 * np.abs(ref).max()
    with pytest.raises(ValueError, match="N multiples of block_n=256"):
        _gemm_side_by_side(x, (ws[0], ws[1][:, :320]), 3, cfg)


def test_fused_kernel_lowers_for_cuda_and_checks_shapes():
    sds = jax.ShapeDtypeStruct
    cache = sds((2, 4096, 16, 8, 128), jnp.bfloat16)
    w = sds((4096, 14336), jnp.bfloat16)
    args = (sds((256, 32, 128), jnp.bfloat16), cache, cache, sds((), jnp.int32), sds((256, 80), jnp.int32),
            sds((256,), jnp.int32), sds((1792, 4096), jnp.bfloat16), (w, w))
    text = decode_attention_beside_gemm.trace(*args, scale=128 ** -0.5, attn_ctas=33).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1
    cfg = TILE_CONFIGS["128x256_s4_ws"]
    assert gemm_fits((1792, 4096), [(4096, 14336)] * 2, cfg)
    assert not gemm_fits((100, 4096), [(4096, 14336)], cfg) and not gemm_fits((1792, 4096), [(4096, 100)], cfg)
    with pytest.raises(ValueError, match="the fused kernel needs"):
        decode_attention_beside_gemm.trace(*args[:6], sds((100, 4096), jnp.bfloat16), (w,), scale=0.1,
                                           attn_ctas=33)


def test_fused_kernel_with_the_swiglu_epilogue_lowers_for_cuda():
    """act="swiglu": the GEMM half writes silu(gate) * up from the interleaved gate/up weight, [M, N / 2] (the
    epilogue's values are checked in interpret mode through the dense kernel, tests/pallas_kernels/
    test_persistent_gemm.py); a tuple of weights is refused."""
    sds = jax.ShapeDtypeStruct
    cache = sds((2, 4096, 16, 8, 128), jnp.bfloat16)
    w = sds((4096, 28672), jnp.bfloat16)
    args = (sds((256, 32, 128), jnp.bfloat16), cache, cache, sds((), jnp.int32), sds((256, 80), jnp.int32),
            sds((256,), jnp.int32), sds((1792, 4096), jnp.bfloat16))
    attn, y = jax.eval_shape(lambda *a: decode_attention_beside_gemm(*a, w, scale=0.1, attn_ctas=33, act="swiglu"),
                             *args)
    assert y.shape == (1792, 14336)
    decode_attention_beside_gemm.trace(*args, w, scale=0.1, attn_ctas=33, act="swiglu").lower(
        lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match="one interleaved"):
        decode_attention_beside_gemm.trace(*args, (w, w), scale=0.1, attn_ctas=33, act="swiglu")


@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("attn,total", [(33, 132), (28, 132), (1, 5), (4, 4)])
def test_cta_roles_cover_each_half_once(attn, total, spread):
    from pallas_kernels.attention_beside_gemm import cta_role
    roles = [tuple(int(v) for v in cta_role(jnp.int32(p), attn, total, spread)) for p in range(total)]
    a_idx = [a for is_a, a, _ in roles if is_a]
    g_idx = [g for is_a, _, g in roles if not is_a]
    assert a_idx == list(range(attn)) and g_idx == list(range(total - attn))
    if spread and attn < total:      # no two attention programs side by side when they are at most half
        pids = [p for p, r in enumerate(roles) if r[0]]
        assert attn * 2 > total or min(np.diff(pids), default=2) >= 2
