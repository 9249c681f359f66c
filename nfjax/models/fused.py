"""Projections of one input joined into one weight for serving: q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`; in a MoE layer the experts' gate/up into `experts_gate_up` and the shared expert's into
`shared_gate_up_proj`.

Why (docs/design.md section 17): XLA runs the separate q, k and v weights of one input as a dot over their
concatenation, concatenating inside the GEMM's operand load, and gate and up as two GEMMs; at decode sizes a
joined weight's plain GEMM reads faster (H200, 64 rows: q/k/v 28.3 against 21.4 us a layer, the MLP block 113
against 99.5 us; `skinny_gemm-h200-20261128.json`).

Checkpoints keep the separate weights (the format stays the HF one); the Runner joins each layer's weights as it
unstacks them. Under tensor parallelism each device joins its own column shards, so the global weight is
[q_0 k_0 v_0 | q_1 k_1 v_1 | ...] split on its last axis: a device's shard holds exactly its heads' columns and
the joining moves nothing between devices.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

from nfjax.models.dense import epilogue_runs
from nfjax.models.grouped import swiglu_block
from nfjax.parallel import TP_AXIS
from pallas_kernels.grouped_gemm_ref import deinterleave, interleave

# joined name -> the projections it joins, in column order
JOINS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "shared_gate_up_proj": ("shared_gate_proj", "shared_up_proj"),
         "experts_gate_up": ("experts_gate", "experts_up")}          # a MoE layer's [E, D, F] expert weights
INTERLEAVED = ("experts_gate_up",)       # joined by alternating column blocks (the grouped SwiGLU epilogue's layout)
EPILOGUE_INTERLEAVED = ("gate_up_proj",)  # ... where the dense GEMM's SwiGLU epilogue can run (nfjax/models/dense.py)


class Joined(nnx.Module):
    """Linear layers of one input joined along their outputs (`nnx.Linear`'s arithmetic: operands promoted to
    `dtype`, one dot, the bias added). `interleave` > 0: two parts whose columns alternate in blocks of that many
    (the experts' gate/up, for the grouped GEMM's SwiGLU epilogue: nfjax/models/grouped.py)."""

    def __init__(self, kernel, bias, parts: tuple[int, ...], dtype, interleave: int = 0):
        self.kernel = nnx.Param(kernel)                          # [D, sum(parts)] (per-shard order under TP)
        self.bias = None if bias is None else nnx.Param(bias)    # [sum(parts)]
        self.parts = tuple(parts)                                # each projection's global output width
        self.dtype = dtype
        self.interleave = interleave

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T N"]:
        y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)

    def split(self, y: Float[Array, "T N"]) -> list:
        """The projections' outputs from the joined one (local widths: each part's share of y's width)."""
        if self.interleave:
            return list(deinterleave(y, self.interleave))
        total, n = sum(self.parts), y.shape[-1]
        ends = np.cumsum([n * p // total for p in self.parts])[:-1]
        return jnp.split(y, ends, axis=-1)


@functools.lru_cache(maxsize=None)
def _joiner(mesh: Mesh, spec: P, n: int, block: int = 0):
    """One compiled join per (mesh, spec, count, interleave block), reused by every layer (a jit built per call
    compiles anew)."""
    def local(*xs):
        return interleave(*xs, block) if block else jnp.concatenate(xs, axis=-1)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * n, out_specs=spec),
                   out_shardings=NamedSharding(mesh, spec))


def _join_shards(arrays: list, mesh: Mesh, spec: P, block: int = 0):
    """Concatenate (or interleave in blocks of `block`) along the last axis shard by shard (each device its own
    pieces: no communication)."""
    return _joiner(mesh, spec, len(arrays), block)(*arrays)


def _interleave_block(name: str, lins: list, mesh: Mesh, swiglu_epilogue: bool) -> int:
    """The gate/up interleave block where every device's shard of F holds whole blocks (the experts' always, the
    dense MLP's with `swiglu_epilogue` where its kernel runs); else 0."""
    dense_epilogue = name in EPILOGUE_INTERLEAVED and swiglu_epilogue and epilogue_runs(lins[0].kernel[...].dtype)
    if name not in INTERLEAVED and not dense_epilogue:
        return 0
    f_local, block = lins[0].kernel[...].shape[-1] // mesh.shape[TP_AXIS], swiglu_block()
    return block if f_local % block == 0 else 0


def join_projections(layer: nnx.Module, mesh: Mesh, swiglu_epilogue: bool = True) -> None:
    """Replace `layer`'s joinable projections (JOINS) by their `Joined` forms, in place; the separate weights
    are deleted as they are joined (peak memory: one joined weight more). `swiglu_epilogue`: the dense gate/up
    interleaved for the GEMM's SwiGLU epilogue where it runs (`_interleave_block`)."""
    for joined, names in JOINS.items():
        lins = [getattr(layer, n, None) for n in names]
        if any(lin is None for lin in lins):
            continue
        k_spec = P(*([None] * (lins[0].kernel[...].ndim - 1)), TP_AXIS)
        block = _interleave_block(joined, lins, mesh, swiglu_epilogue)
        kernel = _join_shards([lin.kernel[...] for lin in lins], mesh, k_spec, block)
        bias = None
        if getattr(lins[0], "bias", None) is not None:       # an Experts weight has none
            bias = _join_shards([lin.bias[...] for lin in lins], mesh, P(TP_AXIS))
        parts = tuple(int(lin.kernel[...].shape[-1]) for lin in lins)
        for lin, n in zip(lins, names):
            for leaf in ("kernel", "bias"):
                v = getattr(lin, leaf, None)
                if v is not None:
                    v[...].delete()
            delattr(layer, n)
        setattr(layer, joined, Joined(kernel, bias, parts, getattr(lins[0], "dtype", None) or kernel.dtype, block))
