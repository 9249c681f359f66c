"""kivi64's math (pallas_kernels/kv_kivi64.py): K per channel over a group of 64 positions within half a step of
each channel's range, the aux rows' layout (row r: channels r, 64 + r), V as int4 rotated, and `read_pages`
taking the filling group from the tail rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_kivi64 as kk
from pallas_kernels import kv_quant as kq


def _k(seed, shape):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 3] = 40.0 + rng.standard_normal(shape[:-1])          # an outlier channel, far from 0 (K-like)
    return x


@jax.jit
def _round_trip(x):
    codes, cols = kk.quantize_k_group(x)
    aux = jnp.zeros(x.shape[:-1] + (kq.aux_width("kivi64", x.shape[-1]),), kq.AUX_DTYPE)
    return codes, cols, kk.dequantize_k_group(codes, aux.at[..., :cols.shape[-1]].set(cols))


def test_k_group_round_trip_within_half_a_step_of_each_channel():
    d = 128                                                    # two blocks of 64 channels in a row's columns
    x = _k(0, (3, 64, 2, d))
    x[1, :, 0, 5] = 2.5                                        # a constant channel: exact
    codes, cols, y = _round_trip(jnp.asarray(x))
    assert codes.shape == (3, 64, 2, d // 2) and codes.dtype == jnp.uint8 and cols.shape == (3, 64, 2, 2 * d // 64)
    y = np.asarray(y)
    rng_ = x.max(1, keepdims=True) - x.min(1, keepdims=True)   # each channel's range over the group
    # half a step of 15, the scale rounded up to bfloat16 and the center rounded to it: below 0.54 of a step
    assert np.all(np.abs(y - x) <= rng_ / 15 * 0.54 + 1e-6)
    assert np.all(y[1, :, 0, 5] == 2.5)
    a = np.asarray(cols, np.float32)
    # row r, columns (2g, 2g + 1): channel 64 g + r's scale and center
    for g in range(d // 64):
        ch = 64 * g + 7
        lo, hi = x[2, :, 1, ch].min(), x[2, :, 1, ch].max()
        assert a[2, 7, 1, 2 * g + 1] == pytest.approx((lo + hi) / 2, rel=1e-2, abs=1e-2)
        assert a[2, 7, 1, 2 * g] >= (hi - lo) / 15 * 0.999


def test_read_pages_takes_the_filling_group_from_the_tail():
    d, s, p = 64, 2, 3
    x = _k(1, (s, p, 64, 1, d))
    v = np.random.default_rng(2).standard_normal((s, p, 64, 1, d)).astype(np.float32)
    tail = jnp.asarray(np.random.default_rng(3).standard_normal((s, 64, 1, d)), jnp.bfloat16)
    lens = jnp.asarray([130, 64])                 # sequence 0: two groups + 2 in the tail; 1: one group, none

    @jax.jit
    def run(x, v):
        codes, cols = kk.quantize_k_group(x)
        vq, vcols = kk.quantize_v(v)
        aux = jnp.concatenate([cols, vcols, jnp.zeros((s, p, 64, 1, 4), kq.AUX_DTYPE)], -1)
        return (kk.read_pages(codes, vq, aux, tail, lens), kk.dequantize_k_group(codes, aux),
                kk.read_pages(codes[:, 1:], vq[:, 1:], aux[:, 1:], tail, lens, start=64)[0],
                kq.rotate(v, jnp.float32))
    (k_out, v_out), deq, k_blk, vr = run(jnp.asarray(x), jnp.asarray(v))
    k_out, v_out = np.asarray(k_out), np.asarray(v_out)
    assert np.array_equal(k_out[0, 128:130], np.asarray(tail[0, :2], np.float32))
    deq = np.asarray(deq).reshape(s, p * 64, 1, d)
    assert np.array_equal(k_out[0, :128], deq[0, :128]) and np.array_equal(k_out[1, :64], deq[1, :64])
    vr = np.asarray(vr).reshape(s, p * 64, 1, d)
    assert np.abs(v_out - vr).max() < 0.1 * np.abs(vr).max()     # V: int4, rotated
    # a later block of positions (start 64): the tail sits at 128 + i, row i
    assert np.array_equal(np.asarray(k_blk)[0, 64:66], np.asarray(tail[0, :2], np.float32))
