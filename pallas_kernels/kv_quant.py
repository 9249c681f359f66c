"""KV cache formats: the one quantizer. K/V are quantized where they enter the paged cache (nfjax/kv/cache.py) and
dequantized where attention reads them (the Pallas kernels, their pure-jnp references). Pure jnp, no nfjax
import: the kernels, the references and the engine all use this module.

Formats (`CacheConfig.kv_dtype`, `--kv-dtype`):
  * "bfloat16": unquantized, in the model's dtype (bfloat16 on the GPU; a float32 model keeps float32 K/V).
  * "fp8": float8 e4m3 values, one scale per token and kv head (amax / 448, rounded up to bfloat16, so no value
    saturates). Two bytes of scale per 128-value row is 1.6% on top of the values.
  * "int4": FlexGen's group-wise asymmetric 4-bit format: groups of 64 along head_dim, each with a scale and an
    offset (16 levels spanning the group's [min, max]), two values a byte, K and V stored rotated (`ROTATED`).
    Codes u in [0, 15] decode as x = (u - 7.5) * scale + center, center = (min + max) / 2 rounded to bfloat16:
    the same 16 levels as min + k * (max - min) / 15, k = 0..15, but with the offset kept at the group's
    middle, where rounding it to bfloat16 costs at most a fraction of a step (a bfloat16 *minimum* far from 0
    is off by up to 0.4% of its magnitude, which can exceed the whole step of a narrow group). The scale is
    (max - center, center - min) / 7.5 rounded up, so the levels always cover the group.
  * "int8": the same group-wise asymmetric format at 8 bits: groups of 64 along head_dim, codes u in [0, 255]
    decoding as x = (u - 127.5) * scale + center (center and scale by int4's rules, 127.5 in place of 7.5),
    stored signed (s = u - 128: x = (s + 0.5) * scale + center), one value a byte, not rotated. At fp8's bytes
    (and the same one aux row) it keeps SmolLM2-135M's top-1 agreement with a bfloat16 cache at 97.95% and its
    perplexity at -0.07%, where fp8 gives 95.22% / +0.77% (docs/design.md section 14.2).
  * "kivi64": K per channel over groups of 64 positions (the group still filling kept in bfloat16 beside the
    pages), V as int4; pages of 64 (pallas_kernels/kv_kivi64.py, docs/design.md section 14.1). Served by the
    references only so far: no kernel reads it, and a GPU refuses it at start.
  * "fp8r": fp8's pages, plus each sequence's newest group of K and V (the positions past the last multiple of 64)
    kept in bfloat16 beside them, as kivi64 keeps its filling K group (KIVI's full-precision residual: the recent
    keys are where fp8 cost SmolLM2 its top-1 agreement); pages of 64. Attention reads K and V of
    positions below 64 floor(len / 64) from the pages, the rest from the tail rows (docs/design.md section 14.3).
  * "fp8_page": float8 with one scale per page and kv head, for the accuracy comparison only (docs/design.md
    section 10): a write that raises a page's maximum rescales the page's earlier rows. Its write rewrites the
    whole layer (the reference path on a CPU); no kernel serves it.

Layout of the stacked cache (`nfjax.kv.cache.KVCache`): values k, v [L, N, PS, KH, D] (fp8: float8_e4m3fn;
int8: int8; int4: uint8 [..., D / 2], byte j holding code j in its low nibble and code j + D / 2 in its high one,
so the two nibbles of a tile unpack into its two halves of head_dim with no interleaving) and, for every quantized
format, `aux` [L, N, PS, KH, W] bfloat16: one row of W = `aux_width` (8 for head_dim <= 128) values per token and
kv head holding K's and V's parameters:
  fp8 / fp8_page: [k_scale, v_scale, 0, ...]
  int4 / int8:    [k_scale_0, k_center_0, ..., k_scale_{G-1}, k_center_{G-1}, v_scale_0, v_center_0, ...]
The aux rows share the values' [L, N, PS, KH] leading layout, so a page's rows move with its values (the
writes, swapping, the tensor-parallel split over kv heads), and one page's rows of one kv head are PS x W
contiguous-by-row bfloat16 (16 bytes a row: one TMA copy of [PS, W] per page, as for the values).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

KV_DTYPES = ("bfloat16", "fp8", "int8", "int4", "kivi64", "fp8r")     # the formats offered (the flag's choices)
INT4_CODES = ("int4", "kivi64")               # formats whose values are packed 4-bit codes
GROUPED = ("int8", "int4", "kivi64")          # formats with a scale and a center per GROUP values of head_dim
FP8_VALUES = ("fp8", "fp8_page", "fp8r")      # formats whose values are e4m3 with a scale per row
TAIL_FORMATS = ("kivi64", "fp8r")               # formats keeping each sequence's filling K group in bfloat16
V_TAIL_FORMATS = ("fp8r",)                      # ... and its V (read with K by the bfloat16 kernel on the GPU)
MEASURE_ONLY = ("fp8_page",)                    # accepted by the config, served by the references only
ALL_KV_DTYPES = KV_DTYPES + MEASURE_ONLY

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 64                                      # the grouped formats' group along head_dim
AUX_DTYPE = jnp.bfloat16
_TINY = 1e-30                                   # the scale of an all-zero row / constant group


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in ALL_KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; choices: {', '.join(KV_DTYPES)}")
    return kv_dtype


def is_quantized(kv_dtype: str) -> bool:
    return check_kv_dtype(kv_dtype) != "bfloat16"


def has_tail(kv_dtype: str) -> bool:
    """The format keeps each sequence's newest K group of 64 positions in a bfloat16 tail row (`TAIL_FORMATS`):
    pages of 64, chunks ending at groups, tail rows moving with swapped pages (nfjax/kv/tail_slots.py)."""
    return kv_dtype in TAIL_FORMATS


def groups(head_dim: int) -> int:
    """The groups of a grouped format's row (`GROUPED`)."""
    if head_dim % GROUP:
        raise ValueError(f"{' / '.join(GROUPED)} KV needs head_dim a multiple of {GROUP}, got {head_dim}")
    return head_dim // GROUP


def aux_width(kv_dtype: str, head_dim: int) -> int:
    """Columns of a token-and-head's aux row (0: no aux array)."""
    if not is_quantized(kv_dtype):
        return 0
    used = 2 if kv_dtype in FP8_VALUES else 4 * groups(head_dim)
    return -(-used // 8) * 8                     # 16-byte rows (a TMA copy's least row width)


def value_dtype(kv_dtype: str, model_dtype) -> jnp.dtype:
    if kv_dtype in INT4_CODES:
        return jnp.dtype(jnp.uint8)
    if kv_dtype == "int8":
        return jnp.dtype(jnp.int8)
    if kv_dtype in FP8_VALUES:
        return jnp.dtype(FP8)
    check_kv_dtype(kv_dtype)
    return jnp.dtype(model_dtype)


def value_width(kv_dtype: str, head_dim: int) -> int:
    """The last dimension of the stored values (int4: two values a byte)."""
    return head_dim // 2 if kv_dtype in INT4_CODES else head_dim


def token_head_bytes(kv_dtype: str, head_dim: int, model_dtype) -> int:
    """Device bytes one token's K and V of one kv head take, scales included (int4 values: two a byte)."""
    values = value_width(kv_dtype, head_dim) * value_dtype(kv_dtype, model_dtype).itemsize
    return 2 * values + aux_width(kv_dtype, head_dim) * jnp.dtype(AUX_DTYPE).itemsize


# int4 stores K and V rotated along head_dim by the normalized Hadamard matrix H (orthogonal and symmetric):
# q.k = (qH).(kH) and sum p v = (sum p vH) H, so attention takes its queries rotated and its outputs come back in
# H's frame (nfjax.kv.attention.rotate_queries / rotate_outputs; the engine folds H into o_proj's weight instead of
# rotating them back, nfjax/models/rotation_fold.py); the kernels and references are unchanged. The rotation
# spreads outlier channels over the group: SmolLM2's K round-trips through int4 at 8.6% rms error rotated against
# 13.2% plain (V 9.0% against 9.6%; fp8 gains nothing: 2.5% against 2.1%), and its held-out perplexity with an
# int4 cache was +12.9% plain, +5.9% with K rotated, +4.4% with both (docs/design.md section 14).
# int8 is not rotated: at 256 levels a group's outliers cost little (the probe's plain64b8, docs/design.md 14.2).
ROTATED = ("int4",)
V_ROTATED = ("int4", "kivi64")      # kivi64 quantizes K per channel, not rotated (its outliers stay in their channels)


def rotates(kv_dtype: str) -> bool:
    """The format stores K (so attention takes its queries rotated) rotated (`ROTATED`)."""
    return kv_dtype in ROTATED


def rotates_v(kv_dtype: str) -> bool:
    """The format stores V rotated (`V_ROTATED`): attention's outputs come back rotated."""
    return kv_dtype in V_ROTATED


def hadamard(d: int) -> np.ndarray:
    """The normalized d x d Sylvester-Hadamard matrix (d a power of 2), f32."""
    if d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs head_dim a power of 2, got {d}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(d))


def rotate(x, dtype=None):
    """x [..., D] @ H (f32), in `dtype` (default x's); H is block-diagonal, blocks of the largest power of 2 that
    divides D (all of D when it is one; at D = 192, three of 64), so it is orthogonal and symmetric for any D.
    A 16-bit x is multiplied by H's +-1 signs in its own dtype (exact products, f32 sums: the tensor cores) and
    scaled after: as exact as an f32 product, where a "highest"-precision f32 dot took ~0.11 ms a layer for a
    2,048-token step's queries on the H200, 7 ms of its 68 (docs/design.md section 14)."""
    d = x.shape[-1]
    b = d & -d
    xb = x.reshape(*x.shape[:-1], d // b, b)
    if x.dtype in (jnp.bfloat16, jnp.float16):
        signs = jnp.asarray(np.sign(hadamard(b)), x.dtype)
        y = jnp.dot(xb, signs, preferred_element_type=jnp.float32) * np.float32(1.0 / np.sqrt(b))
    else:
        y = jnp.dot(xb.astype(jnp.float32), jnp.asarray(hadamard(b)), precision="highest")
    return y.reshape(x.shape).astype(dtype or x.dtype)


def _bf16_up(x):
    """x (f32, >= 0) rounded to a bfloat16 that is >= x (back in f32)."""
    return (x * (1.0 + 2.0 ** -8)).astype(AUX_DTYPE).astype(jnp.float32)


# ---- fp8 ----------------------------------------------------------------------------------------------
def fp8_scale(amax):
    return jnp.maximum(_bf16_up(amax / FP8_MAX), _TINY)


def quantize_fp8(x, scale=None):
    """x [..., D] -> (float8 values [..., D], f32 scale [...]): one scale per row (given, or the row's amax)."""
    x = x.astype(jnp.float32)
    if scale is None:
        scale = fp8_scale(jnp.max(jnp.abs(x), axis=-1))
    q = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return q, scale


def dequantize_fp8(q, scale):
    return q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


# ---- int4 / int8: groups of GROUP values with a scale and a center ------------------------------------------
INT4_HALF, INT8_HALF = 7.5, 127.5               # half the span of the codes: 16 levels, 256 levels


def quantize_groups(x, half: float):
    """x [..., D] -> (f32 codes [..., D] in [0, 2 half], f32 scale [..., G], f32 center [..., G]); groups of
    GROUP along D, 2 half + 1 levels spanning each group's [min, max] (module doc: the center is the group's
    middle rounded to bfloat16, the scale rounded up)."""
    *lead, d = x.shape
    g = groups(d)
    xg = x.astype(jnp.float32).reshape(*lead, g, GROUP)
    lo, hi = xg.min(-1), xg.max(-1)
    center = ((lo + hi) * 0.5).astype(AUX_DTYPE).astype(jnp.float32)
    scale = jnp.maximum(_bf16_up(jnp.maximum(hi - center, center - lo) / half), _TINY)
    codes = jnp.clip(jnp.round((xg - center[..., None]) / scale[..., None] + half), 0, 2 * half)
    return codes.reshape(*lead, d), scale, center


def dequantize_groups(codes, scale, center, half: float):
    """f32 codes [..., D] (`quantize_groups`'s) with scale, center [..., G] -> f32 [..., D]."""
    *lead, d = codes.shape
    g = d // GROUP
    x = (codes.reshape(*lead, g, GROUP) - half) * scale.astype(jnp.float32)[..., None] \
        + center.astype(jnp.float32)[..., None]
    return x.reshape(*lead, d)


def pack_int4(codes):
    """uint8 codes [..., D] in [0, 15] -> bytes [..., D / 2]: byte j = code j | code (j + D / 2) << 4."""
    h = codes.shape[-1] // 2
    return (codes[..., :h] | (codes[..., h:] << 4)).astype(jnp.uint8)


def unpack_int4(packed):
    """bytes [..., D / 2] -> uint8 codes [..., D]."""
    return jnp.concatenate([packed & 15, packed >> 4], axis=-1)


def quantize_int4(x):
    """x [..., D] -> (packed codes uint8 [..., D / 2], f32 scale [..., G], f32 center [..., G]); groups of 64
    along D."""
    codes, scale, center = quantize_groups(x, INT4_HALF)
    return pack_int4(codes.astype(jnp.uint8)), scale, center


def dequantize_int4(packed, scale, center):
    """packed [..., D / 2] with scale, center [..., G] -> f32 [..., D]."""
    return dequantize_groups(unpack_int4(packed).astype(jnp.float32), scale, center, INT4_HALF)


def quantize_int8(x):
    """x [..., D] -> (int8 codes u - 128 [..., D], f32 scale [..., G], f32 center [..., G]); groups of 64 along D."""
    codes, scale, center = quantize_groups(x, INT8_HALF)
    return (codes - 128).astype(jnp.int8), scale, center


def dequantize_int8(q, scale, center):
    """int8 [..., D] with scale, center [..., G] -> f32 [..., D]."""
    return dequantize_groups(q.astype(jnp.float32) + 128, scale, center, INT8_HALF)


GROUP_CODECS = {"int4": (quantize_int4, dequantize_int4), "int8": (quantize_int8, dequantize_int8)}
GROUP_CODE_DTYPES = {jnp.dtype(jnp.uint8): "int4", jnp.dtype(jnp.int8): "int8"}      # stored dtype -> format


# ---- K/V pairs with their aux rows ----------------------------------------------------------------------
def quantize_kv(kv_dtype: str, k, v):
    """k, v [..., D] -> (k values, v values, aux [..., W] bfloat16) in the cache's format (per-token formats;
    fp8_page's rows are set by its page-wide write, nfjax.kv.cache). int4 stores K and V rotated (`ROTATED`)."""
    d = k.shape[-1]
    w = aux_width(kv_dtype, d)
    if kv_dtype in FP8_VALUES:
        (kq, ks), (vq, vs) = quantize_fp8(k), quantize_fp8(v)
        cols = [ks[..., None], vs[..., None]]
    elif kv_dtype in GROUP_CODECS:
        quant = GROUP_CODECS[kv_dtype][0]
        (kq, ks, kc) = quant(rotate(k, jnp.float32) if rotates(kv_dtype) else k)
        (vq, vs, vc) = quant(rotate(v, jnp.float32) if rotates_v(kv_dtype) else v)
        cols = [jnp.stack([ks, kc], -1).reshape(*ks.shape[:-1], -1),
                jnp.stack([vs, vc], -1).reshape(*vs.shape[:-1], -1)]
    else:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not a per-token quantized format (kivi64's K is quantized "
                         f"a group at a time: nfjax/kv/kivi64.py)")
    aux = jnp.concatenate(cols, -1)
    aux = jnp.pad(aux, [(0, 0)] * (aux.ndim - 1) + [(0, w - aux.shape[-1])])
    return kq, vq, aux.astype(AUX_DTYPE)


def dequantize_kv(k, v, aux, dtype=jnp.float32):
    """(k, v) [..., D] in `dtype` from cache values and aux rows of any matching leading shape (values [..., D],
    int4 [..., D / 2]; aux [..., W]); aux None: the values as they are. The format follows the values' dtype
    (uint8: int4, int8: int8, else fp8; kivi64's pages read through pallas_kernels/kv_kivi64.py `read_pages`)."""
    if aux is None:
        return k.astype(dtype), v.astype(dtype)
    fmt = GROUP_CODE_DTYPES.get(jnp.dtype(k.dtype))
    if fmt is not None:
        deq = GROUP_CODECS[fmt][1]
        g = groups(k.shape[-1] * (2 if fmt in INT4_CODES else 1))
        a = aux.astype(jnp.float32)
        kp, vp = a[..., :2 * g].reshape(*a.shape[:-1], g, 2), a[..., 2 * g:4 * g].reshape(*a.shape[:-1], g, 2)
        return deq(k, kp[..., 0], kp[..., 1]).astype(dtype), deq(v, vp[..., 0], vp[..., 1]).astype(dtype)
    return dequantize_fp8(k, aux[..., 0]).astype(dtype), dequantize_fp8(v, aux[..., 1]).astype(dtype)


def _item_units(qr: Float[Array, "I GP D"], top: float):
    """(q in units of its item's scale, f32; the scale [I]): the item's largest magnitude becomes `top`."""
    x = qr.astype(jnp.float32)
    sc = jnp.maximum(jnp.max(jnp.abs(x), axis=(1, 2)), 1e-30) / top
    return x / sc[:, None, None], sc


def fp8_query_parts(qr: Float[Array, "I GP D"]):
    """(q as [I, 2 GP, D] float8_e4m3fn: a high part and the low part of what it leaves, both in units of the item's
    scale; the scale [I] f32). hi + lo carries ~8 significant bits (bfloat16's), where one e4m3 would carry 4, so
    K's fp8 values meet the query in fp8 wgmmas at about the precision of the f16 path (paged_decode_swapped's
    `fp8_mma`)."""
    x, sc = _item_units(qr, FP8_MAX)
    hi = x.astype(FP8)
    # the barrier keeps XLA:GPU from folding f32 -> e4m3 -> f32 into nothing (excess precision allowed), which
    # made lo 0 and left the query at e4m3's precision (4.6% off on the GPU against 0.2% in interpret mode)
    lo = (x - lax.optimization_barrier(hi).astype(jnp.float32)).astype(FP8)
    return jnp.concatenate([hi, lo], axis=1), sc


INT8_LO = 254.0         # the low int8 part's unit: 1 / 254 of the high part's (its residual lies in [-0.5, 0.5])


def int8_hi_lo(qr: Float[Array, "I GP D"]):
    """(hi, lo, the scale [I]) of `int8_query_parts` before its layout: hi and lo [I, GP, D] f32 integers."""
    x, sc = _item_units(qr, 127.0)
    hi = jnp.clip(jnp.round(x), -127, 127)
    return hi, jnp.clip(jnp.round((x - hi) * INT8_LO), -127, 127), sc


def int8_query_parts(qr: Float[Array, "I GP D"], grouped: bool = True):
    """(q as [I, 2 G GP, D] int8, the scale [I] f32) for int8 wgmmas against an int8 cache's K codes (G groups of
    GROUP along D). In units of the item's scale s = amax / 127, hi = round(q / s) and lo = round((q / s - hi) * 254):
    q = s (hi + lo / 254) to ~1 / 64,000 of amax, above bfloat16's precision. Block (p, g) of GP rows (p = 0 hi,
    1 lo) holds part p on group g's columns and zeros elsewhere, so one wgmma over all of D gives every group's dot
    product apart (each group has its own K scale and center; paged_decode_swapped's `int8_mma`). `grouped=False`:
    [I, 2 GP, D], hi then lo over all of D, for a wgmma a group (the kernel's `group_accs`): half the bytes."""
    i, gp, d = qr.shape
    ng = groups(d)
    hi, lo, sc = int8_hi_lo(qr)
    if not grouped:
        return jnp.concatenate([hi, lo], axis=1).astype(jnp.int8), sc
    # built as uint32 words, four codes a word, bitcast to int8 at the end: a quarter of the per-byte stores of a
    # concatenate of int8 blocks, 46.6 -> 37.3 us at 1,024 rows x 8 kv heads on the H200 (docs/design.md section 14)
    word_group = jnp.arange(d // 4) // (GROUP // 4)
    blocks = [jnp.where(word_group == g, int8_words(part), jnp.uint32(0)) for part in (hi, lo) for g in range(ng)]
    return lax.bitcast_convert_type(jnp.concatenate(blocks, axis=1), jnp.int8).reshape(i, 2 * ng * gp, d), sc


def int8_words(x: Float[Array, "... D"]):
    """[..., D] f32 integers in [-127, 127] -> [..., D / 4] uint32 holding codes 4j..4j+3 in bytes 0..3 (the order
    `lax.bitcast_convert_type` unpacks them in)."""
    b = (x.astype(jnp.int32) & 0xFF).astype(jnp.uint32).reshape(*x.shape[:-1], x.shape[-1] // 4, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
