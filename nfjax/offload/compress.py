"""4-bit group-wise weight compression (FlexGen section 5) for weights that live off the GPU.

The format is the KV cache's int4 (pallas_kernels/kv_quant.py, `quantize_int4` / `dequantize_int4`), reused as
is: groups of 64 consecutive values along the last axis, each with a scale and a center (asymmetric: 16
levels spanning the group's [min, max]; kv_quant.py says why the offset is the group's middle rather than its
minimum), two codes a byte. A weight kernel [in, out] is grouped along `in` (it is quantized transposed, as
[out, in]): on SmolLM2-135M, 512 tokens of the README, perplexity went from 71.6 in float32 to 97.2 with groups
along `in` and to 133 with groups along `out` (tests/offload/test_perplexity.py). Only 2-D weights whose `in` is a
multiple of 64 are compressed (norms and biases stay as they are: they are < 0.1% of a layer). Scale and
center are stored as bfloat16 (kv_quant rounds them to bfloat16 values already), so a compressed weight
takes 0.5 + 4/64 = 0.5625 bytes a value against 2 for bfloat16 (3.6x less to store and to move).
Compression runs once, where the weights are made; decompression runs on the device inside the layer's
compiled program (`decompress`), so only the packed bytes cross the bus.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_quant import GROUP, dequantize_int4, quantize_int4

PARAM_DTYPE = jnp.bfloat16          # the stored scale and center


@jax.tree_util.register_dataclass
@dataclass
class Packed:
    """One compressed kernel [in, out], stored transposed: codes uint8 [out, in / 2], scale and center bfloat16
    [out, in / 64]."""
    codes: jax.Array
    scale: jax.Array
    center: jax.Array


def compressible(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and shape[0] % GROUP == 0


def packed_bytes(shape: tuple[int, ...]) -> int:
    """Bytes a weight of `shape` takes compressed."""
    n = int(np.prod(shape))
    return n // 2 + 2 * (n // GROUP) * jnp.dtype(PARAM_DTYPE).itemsize


@jax.jit
def _compress(w):
    codes, scale, center = quantize_int4(w.T)
    return codes, scale.astype(PARAM_DTYPE), center.astype(PARAM_DTYPE)


def compress(w) -> Packed:
    """A weight (any device, or numpy) -> its `Packed` form, computed where `w` lives."""
    return Packed(*_compress(w))


def decompress(p: Packed, dtype) -> jax.Array:
    """`Packed` -> the weight in `dtype` (traced inside the layer programs)."""
    return dequantize_int4(p.codes, p.scale, p.center).T.astype(dtype)


def decompress_tree(tree, dtype):
    """Every `Packed` leaf of a pytree decompressed; other leaves as they are."""
    return jax.tree.map(lambda x: decompress(x, dtype) if isinstance(x, Packed) else x, tree,
                        is_leaf=lambda x: isinstance(x, Packed))
