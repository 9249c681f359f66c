"""Dense (GEMM) ops: XLA's dot (cuBLAS) by default; the persistent Pallas GEMM when a schedule gives the op a
resource share on a GPU, so the GEMM runs on `ctx.num_ctas` CTAs and leaves the other SMs to a kernel on
another stream (NanoFlow's R). A cuBLAS GEMM takes every SM, so beside it nothing overlaps (shared/DESIGN.md)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from nfjax.compat import on_gpu


def pallas_gemm_fits(x, w) -> bool:
    k, n = w.shape
    return (on_gpu() and x.dtype == w.dtype and jnp.dtype(x.dtype).itemsize == 2 and k % 64 == 0
            and n % 64 == 0)


def dense(lin: nnx.Linear, x: Float[Array, "T K"], num_ctas: int | None = None) -> Float[Array, "T N"]:
    """`lin(x)`; with `num_ctas` (and a GPU, 16-bit weights) through the persistent Pallas GEMM."""
    w = lin.kernel[...]
    if num_ctas is None or not pallas_gemm_fits(x, w):
        return lin(x)
    from pallas_kernels.persistent_gemm import persistent_gemm
    y = persistent_gemm(x, w, num_ctas=num_ctas)
    return y if lin.bias is None else y + lin.bias[...].astype(y.dtype)
