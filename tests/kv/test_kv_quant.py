"""The KV quantizer (pallas_kernels/kv_quant.py): round trips within each format's error bound, the packed int4
layout, int8's signed codes, the aux rows, and the bytes each format takes."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_quant as kq


def _draw(seed, shape, outliers=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if outliers:            # K-like: a few large channels, rows of very different norms
        x[..., :3] *= 20.0
        x *= np.exp(rng.standard_normal(shape[:-1] + (1,))).astype(np.float32)
    return x


@pytest.mark.parametrize("d", [64, 128])
def test_fp8_round_trip_is_relative_to_each_row(d):
    x = _draw(1, (50, 3, d))
    q, s = kq.quantize_fp8(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (50, 3)
    y = np.asarray(kq.dequantize_fp8(q, s))
    amax = np.abs(x).max(-1, keepdims=True)
    # e4m3: 3 mantissa bits, so |error| <= 2^-4 |x| for normal values, and below 2^-9 * scale for subnormal ones
    assert np.all(np.abs(y - x) <= np.maximum(2.0 ** -4 * np.abs(x), amax / 448 * 2.0 ** -9) * 1.0001)
    assert np.all(np.abs(np.asarray(q, np.float32)) <= 448)         # the scale is rounded up: nothing saturates
    assert np.asarray(s, np.float32).dtype == np.float32 and np.all(np.asarray(s) == np.asarray(
        jnp.asarray(s).astype(jnp.bfloat16).astype(jnp.float32)))    # scales are bfloat16 values


@pytest.mark.parametrize("fmt,d", [("int4", 64), ("int4", 128), ("int8", 64), ("int8", 128)])
def test_grouped_round_trip_within_half_a_step_of_its_group(fmt, d):
    quant, dequant = kq.GROUP_CODECS[fmt]
    half = kq.INT4_HALF if fmt == "int4" else kq.INT8_HALF
    x = _draw(2, (40, 2, d))
    x[0, 0] = 3.25                               # a constant group: exact
    x[1, 0, :64] = 1000.0 + np.linspace(0, 1, 64)   # narrow group far from 0 (a bfloat16 minimum would miss it)
    codes, s, c = quant(jnp.asarray(x))
    assert codes.dtype == kq.value_dtype(fmt, None) and codes.shape == (40, 2, kq.value_width(fmt, d))
    assert s.shape == c.shape == (40, 2, d // 64)
    y = np.asarray(dequant(codes, s, c))
    xg, yg = x.reshape(40, 2, -1, 64), y.reshape(40, 2, -1, 64)
    step = np.asarray(s)[..., None]
    assert np.all(np.abs(yg - xg) <= step / 2 * 1.0001 + 1e-6 * np.abs(xg))
    # the step is (max - min) / (2 half), widened by the center's rounding to bfloat16 (at most 2^-9 of its magnitude)
    lo, hi = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
    assert np.all(step <= ((hi - lo) / 2 + np.abs(hi + lo) / 2 * 2.0 ** -9) / half * 1.01 + 1e-30)
    assert np.array_equal(y[0, 0], x[0, 0])
    assert np.abs(y[1, 0, :64] - x[1, 0, :64]).max() <= (0.5 + 1000 * 2.0 ** -9) / (2 * half) * 1.01


def test_int8_codes_are_signed_and_span_256_levels():
    """int8 stores u - 128 for codes u in [0, 255]: a group's minimum and maximum are codes -128 and 127, its
    middle (the center) between codes -1 and 0, so x = (s + 0.5) * scale + center."""
    x = np.linspace(-3.0, 5.0, 64, dtype=np.float32)[None]
    q, s, c = kq.quantize_int8(jnp.asarray(x))
    q = np.asarray(q)
    assert q.dtype == np.int8 and q[0, 0] == -128 and q[0, -1] == 127
    assert np.unique(q).size == 64                                          # 64 even values, 256 levels: no two share one
    assert float(c[0, 0]) == 1.0                                           # (-3 + 5) / 2
    np.testing.assert_allclose((q.astype(np.float32) + 0.5) * float(s[0, 0]) + 1.0,
                               np.asarray(kq.dequantize_int8(jnp.asarray(q), s, c)), rtol=1e-6)


def test_int4_packing_puts_the_two_halves_in_the_two_nibbles():
    codes = np.arange(16, dtype=np.uint8)[None].repeat(2, 0)[:, np.r_[0:16, 15:-1:-1]][:, :32]   # [2, 32]
    packed = np.asarray(kq.pack_int4(jnp.asarray(codes)))
    assert packed.shape == (2, 16)
    assert np.array_equal(packed & 15, codes[:, :16]) and np.array_equal(packed >> 4, codes[:, 16:])
    assert np.array_equal(np.asarray(kq.unpack_int4(jnp.asarray(packed))), codes)


@pytest.mark.parametrize("fmt,d", [("fp8", 64), ("fp8", 128), ("int4", 64), ("int4", 128), ("int8", 64),
                                   ("int8", 128)])
def test_kv_pairs_and_their_aux_rows(fmt, d):
    k, v = _draw(3, (7, 2, d)), _draw(4, (7, 2, d), outliers=False)
    kq_, vq_, aux = kq.quantize_kv(fmt, jnp.asarray(k), jnp.asarray(v))
    w = kq.aux_width(fmt, d)
    assert aux.shape == (7, 2, w) and aux.dtype == jnp.bfloat16 and w % 8 == 0
    kd, vd = (np.asarray(a) for a in kq.dequantize_kv(kq_, vq_, aux))
    if fmt == "fp8":
        assert np.array_equal(np.asarray(aux[..., 2:], np.float32), np.zeros((7, 2, w - 2)))
        ref = [np.asarray(kq.dequantize_fp8(*kq.quantize_fp8(jnp.asarray(a)))) for a in (k, v)]
    elif fmt == "int8":           # not rotated; the aux row is int4's layout: (scale, center) a group, K then V
        ref = [np.asarray(kq.dequantize_int8(*kq.quantize_int8(jnp.asarray(a)))) for a in (k, v)]
        _, s, c = kq.quantize_int8(jnp.asarray(v))
        g = d // 64
        np.testing.assert_array_equal(np.asarray(aux[..., 2 * g:4 * g:2], np.float32), np.asarray(s))
        np.testing.assert_array_equal(np.asarray(aux[..., 2 * g + 1:4 * g:2], np.float32), np.asarray(c))
    else:            # K and V are stored rotated (kv_quant.ROTATED): rotated back here (H H = I)
        ref = [np.asarray(kq.dequantize_int4(*kq.quantize_int4(kq.rotate(jnp.asarray(a))))) for a in (k, v)]
        kd, vd, ref = kd @ kq.hadamard(d), vd @ kq.hadamard(d), [r @ kq.hadamard(d) for r in ref]
    np.testing.assert_allclose(kd, ref[0], rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(vd, ref[1], rtol=1e-6, atol=1e-5)
    for a, b in ((kd, k), (vd, v)):
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        # int4 on k: three outlier channels stretch every group's range (rms error ~ range / 15 / sqrt(12));
        # int8: range / 255 / sqrt(12)
        assert err < {"fp8": 0.04, "int8": 0.015, "int4": 0.2 if b is k else 0.1}[fmt], err
    # unquantized: dequantize is a cast
    a, b = kq.dequantize_kv(jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), None)
    assert a.dtype == jnp.float32
    assert np.array_equal(np.asarray(a), np.asarray(jnp.asarray(k, jnp.bfloat16), np.float32))


def test_bytes_per_token_and_head():
    assert kq.token_head_bytes("bfloat16", 128, "bfloat16") == 512
    assert kq.token_head_bytes("bfloat16", 64, "float32") == 512
    assert kq.token_head_bytes("fp8", 128, "bfloat16") == 256 + 16           # values + one 8-wide bf16 aux row
    assert kq.token_head_bytes("int4", 128, "bfloat16") == 128 + 16          # 4.5 bits a value
    assert kq.token_head_bytes("int4", 64, "bfloat16") == 64 + 16
    assert kq.token_head_bytes("int8", 128, "bfloat16") == kq.token_head_bytes("fp8", 128, "bfloat16")   # fp8's bytes
    assert kq.aux_width("int8", 128) == kq.aux_width("int4", 128) == 8
    for f in ("int4", "int8"):
        with pytest.raises(ValueError, match="multiple of 64"):
            kq.aux_width(f, 96)
    with pytest.raises(ValueError, match="choices: bfloat16, fp8, int8, int4"):
        kq.check_kv_dtype("int2")


def test_int4_keys_and_values_are_stored_rotated():
    """int4 stores K and V rotated by the normalized Hadamard matrix (orthogonal, symmetric): rotating the queries
    the same way keeps q.k, rotating the outputs back undoes it on p.v, and the rotation spreads outlier channels
    (a lower round-trip error than the same rows quantized unrotated)."""
    h = kq.hadamard(64)
    np.testing.assert_allclose(h @ h, np.eye(64), atol=1e-6)
    np.testing.assert_allclose(h, h.T)
    q, k = _draw(5, (9, 64)), _draw(6, (9, 64))
    rot = lambda a: np.asarray(kq.rotate(jnp.asarray(a)))          # noqa: E731
    np.testing.assert_allclose(rot(q) @ rot(k).T, q @ k.T, rtol=1e-4, atol=1e-3)
    p = np.abs(_draw(7, (5, 9), outliers=False))
    np.testing.assert_allclose(rot(p @ rot(k)), p @ k, rtol=1e-4, atol=1e-3)
    kq_, vq_, aux = kq.quantize_kv("int4", jnp.asarray(k), jnp.asarray(k))
    kd, vd = (np.asarray(a) @ h for a in kq.dequantize_kv(kq_, vq_, aux))    # rotated back
    np.testing.assert_allclose(kd, vd)
    plain = np.asarray(kq.dequantize_int4(*kq.quantize_int4(jnp.asarray(k))))
    err_rot, err_plain = (np.linalg.norm(a - k) / np.linalg.norm(k) for a in (kd, plain))
    assert err_rot < 0.8 * err_plain, (err_rot, err_plain)
    assert kq.rotates("int4") and not kq.rotates("fp8") and not kq.rotates("int8") and not kq.rotates_v("int8")
    with pytest.raises(ValueError, match="power of 2"):
        kq.hadamard(96)
    x = _draw(8, (4, 192))          # head_dim 192: three 64-blocks, still orthogonal and symmetric
    np.testing.assert_allclose(rot(rot(x)), x, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rot(x)[:, 64:128], x[:, 64:128] @ h, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("d", [64, 128, 192])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rotation_of_16_bit_inputs_is_as_exact_as_an_f32_product(d, dtype):
    """A 16-bit input goes through H's +-1 signs in its own dtype (the tensor cores) and is scaled after: its
    products are exact, so the f32 result matches a float64 product of the same 16-bit values to f32 rounding,
    and the f32 path (used for f32 inputs) to within it."""
    x = jnp.asarray(_draw(9, (3, 5, d)), dtype)
    b = d & -d
    ref = (np.asarray(x, np.float64).reshape(3, 5, d // b, b) @ kq.hadamard(b).astype(np.float64)).reshape(x.shape)
    got = np.asarray(kq.rotate(x, jnp.float32))
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    f32 = np.asarray(kq.rotate(jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(got, f32, rtol=0, atol=1e-6 * np.abs(ref).max())
    assert kq.rotate(x).dtype == dtype
