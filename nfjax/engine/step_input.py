"""A step's inputs, and how they reach the device: one host->device copy into buffers that never move.

The host packs every field's bits into one int32 vector (all fields are 4-byte types), so a step crosses to the
device in one transfer instead of one per field (copying the 15 arrays took 1.4-1.9 ms a step on the H100 host,
docs/design.md section 3; on a CPU one copy took 0.09 ms against 0.30 for the tree; not yet timed on the
device). A small program then writes the fields over the previous step's input buffers, which it takes donated,
so the step programs read the same device addresses every step and XLA's command buffers (CUDA graphs) launch
without being re-recorded (0.86 -> 0.55 ms to enqueue a 4-layer program on an H100).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int, UInt32

from nfjax.kv.metadata import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclass
class StepInput:
    tokens: Int[Array, "T"]          # token ids known on the host (prompt chunks, decode inputs already read)
    token_src: Int[Array, "T"]       # >= 0: take the token from that row of the previous step's samples
    meta: AttentionMetadata
    temperature: Float[Array, "S"]
    top_k: Int[Array, "S"]
    top_p: Float[Array, "S"]
    seeds: UInt32[Array, "S"]
    counters: Int[Array, "S"]        # outputs generated before this sample: the per-request key's step


def pack(inp: StepInput) -> np.ndarray:
    """Every field of a host `StepInput`, in tree order, as the bits of one int32 vector."""
    parts = []
    for a in jax.tree.leaves(inp):
        a = np.ascontiguousarray(a)
        if a.dtype.itemsize != 4:
            raise TypeError(f"step input field of dtype {a.dtype}: only 4-byte types can be packed")
        parts.append(a.reshape(-1).view(np.int32))
    return np.concatenate(parts)


def unpack(like, packed: Int[Array, "N"]):
    """`pack`'s vector as a tree of `like`'s structure, shapes and dtypes (any tree of arrays: `StepInput`, the
    full head's `FullInput`)."""
    leaves, treedef = jax.tree.flatten(like)
    out, off = [], 0
    for o in leaves:
        out.append(lax.bitcast_convert_type(packed[off:off + o.size], o.dtype).reshape(o.shape))
        off += o.size
    if off != packed.shape[0]:
        raise ValueError(f"packed step input has {packed.shape[0]} words, the fields take {off}")
    return treedef.unflatten(out)


def unpack_into(old: StepInput, packed: Int[Array, "N"]) -> StepInput:
    """`pack`'s vector written over `old`'s (donated) buffers, field by field."""
    return jax.tree.map(lambda o, n: lax.dynamic_update_slice(o, n, (0,) * o.ndim), old, unpack(old, packed))


def stage(old: StepInput, new: StepInput) -> StepInput:
    """A device `StepInput`'s values written over `old`'s (donated) buffers. (Returning `new` itself would not do:
    jax forwards an output that is an input, and drops the unused donated one.)"""
    return jax.tree.map(lambda o, n: lax.dynamic_update_slice(o, n, (0,) * o.ndim), old, new)
