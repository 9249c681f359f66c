"""V's Hadamard rotation folded into o_proj when the Runner loads the weights (int4: `FOLDED` below; kivi64 also
stores V rotated and keeps the per-step rotation).

Attention over V stored as V H gives each head's rows as o H, and o_proj wants o = (o H) H (H symmetric, H H = I):
a [T x heads, D] x [D, D] dot a layer, every step. Folded, o_proj's rows of head h become H W_o[h], and
(o H)(H W_o[h]) = o W_o[h]: the rotation is paid once at load, not per step (docs/design.md section 14). The layer
records it (`v_rotation_folded`), so attention rows meet o_proj in its frame whatever cache the layer is run over
(`nfjax.kv.attention.outputs_for_o_proj`)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

from nfjax.parallel import TP_AXIS
from pallas_kernels.kv_quant import rotate


# The formats folded at load: int4, where the per-step rotation cost GPU time (docs/design.md section 14). kivi64
# also stores V rotated but has no GPU kernel, and its figure of merit is accuracy: on SmolLM2 the fold's bfloat16
# rounding of o_proj moved it from +1.16% / 93.06% top-1 to +1.65% / 92.38% (int4: +4.76% / 87.34% -> +4.42% /
# 87.06%, no direction), so it keeps the per-step rotation.
FOLDED = ("int4",)


def folds(kv_dtype: str) -> bool:
    """The Runner folds V's rotation into o_proj for this KV format (`FOLDED`)."""
    return kv_dtype in FOLDED


def _fold_rows(w: Float[Array, "R N"], head_dim: int) -> Float[Array, "R N"]:
    """Each head's [D, N] block of rows times H (from the left; H symmetric), in f32, rounded once."""
    r, n = w.shape
    blocks = w.reshape(r // head_dim, head_dim, n).swapaxes(1, 2).astype(jnp.float32)     # [heads, N, D]
    return rotate(blocks).swapaxes(1, 2).reshape(r, n).astype(w.dtype)


@functools.lru_cache(maxsize=None)
def _folder(mesh: Mesh, head_dim: int):
    """One compiled fold per (mesh, head_dim), reused by every layer; each device folds its own heads' rows (the
    row-parallel o_proj's shard holds whole heads: no communication)."""
    spec = P(TP_AXIS, None)
    return jax.jit(jax.shard_map(functools.partial(_fold_rows, head_dim=head_dim), mesh=mesh, in_specs=(spec,),
                                 out_specs=spec), out_shardings=NamedSharding(mesh, spec))


def fold_v_rotation(layer: nnx.Module, mesh: Mesh, head_dim: int) -> None:
    """`layer`'s o_proj rows folded with V's rotation, in place (the old weight deleted once replaced)."""
    var = layer.o_proj.kernel
    old = var[...]
    var.set_value(_folder(mesh, head_dim)(old))
    old.delete()
    layer.v_rotation_folded = True
