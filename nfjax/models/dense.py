"""Dense (GEMM) ops: XLA's dot (cuBLAS) by default; the persistent Pallas GEMM when a schedule gives the op a
resource share on a GPU, so the GEMM runs on `ctx.num_ctas` CTAs and leaves the other SMs to a kernel on
another stream (NanoFlow's R). A cuBLAS GEMM takes every SM, so beside it nothing overlaps (shared/DESIGN.md).

The MLP's gate/up with SwiGLU in the persistent GEMM's epilogue (`dense_swiglu`) from SWIGLU_EPILOGUE_MIN_ROWS
tokens: its joined weight interleaves gate and up columns (nfjax/models/fused.py) and no [T, 2F] array is written
(docs/design.md section 20)."""
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


# From this many rows the epilogue path beats XLA's dot + SwiGLU; below it XLA's dot is faster. H200, Llama-3-8B's
# [4096, 28672] gate/up, kernel us (XLA / ours): 16 rows 56 / 62, 64 59 / 64, 128 66 / 60, 256 113 / 93, 384 156 /
# 130, 1024 367 / 298, 2048 734 / 596 (bench/results/dense_swiglu-20261129.json).
SWIGLU_EPILOGUE_MIN_ROWS = 128


def epilogue_runs(dtype) -> bool:
    """Whether the SwiGLU epilogue's kernel runs here (a GPU, 16-bit weights): the joiner interleaves only then."""
    return on_gpu() and jnp.dtype(dtype).itemsize == 2


def swiglu_epilogue_fits(lin, x: Float[Array, "T K"], step_tokens: int | None = None) -> bool:
    """`lin` (a `Joined` gate/up) is interleaved in the kernel's block and the step (`step_tokens`, else x's rows)
    is large enough for it."""
    from nfjax.models.grouped import swiglu_block        # the block the joiner interleaves in (models/fused.py)
    w = lin.kernel[...]
    block = swiglu_block()
    return (getattr(lin, "interleave", 0) == block and lin.bias is None
            and (step_tokens or x.shape[0]) >= SWIGLU_EPILOGUE_MIN_ROWS
            and pallas_gemm_fits(x, w) and w.shape[1] % (2 * block) == 0)


def dense_swiglu(lin, x: Float[Array, "T K"], num_ctas: int | None = None) -> Float[Array, "T F"]:
    """silu(x @ gate) * (x @ up) from `lin`'s interleaved [gate | up] weight, in the GEMM's epilogue (check
    `swiglu_epilogue_fits` first); `num_ctas` as in `dense`."""
    from pallas_kernels.persistent_gemm import persistent_gemm
    return persistent_gemm(x, lin.kernel[...], num_ctas=num_ctas, act="swiglu")
