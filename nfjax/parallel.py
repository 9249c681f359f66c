"""Tensor parallelism: a 1-D `tp` mesh, a PartitionSpec for every weight, KV pages sharded by KV head.

Layout (Megatron style): q/k/v and gate/up are column-parallel (output features split), o and down are
row-parallel (input features split) and followed by an explicit `psum` inside the per-layer shard_map body.
The embedding is replicated: a lookup is a gather, and splitting it would cost an all-reduce per step for
little memory (0.5 GiB at 8B). lm_head is split over the vocabulary and runs outside the shard_map, so only
the S sampled rows' logits are gathered. When tp > num_kv_heads, each KV head is replicated so that every
device holds exactly one (the k/v projection weights are repeated at load time).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from nfjax.config import ModelConfig
from nfjax.errors import UserError

TP_AXIS = "tp"

# MoE layers (nfjax/models/moe.py): each expert's FFN columns split like the dense MLP's (experts_* kernels are
# [L, E, in, out]); the shared expert likewise; router_proj and shared_expert_gate replicated
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "experts_gate", "experts_up", "shared_gate_proj",
           "shared_up_proj", "qkv_proj", "gate_up_proj", "shared_gate_up_proj", "experts_gate_up"}  # last 4: fused.py
_ROW = {"o_proj", "down_proj", "experts_down", "shared_down_proj"}


def make_mesh(tp: int) -> Mesh:
    devs = jax.devices()
    if tp < 1 or tp > len(devs):
        raise UserError(f"tp={tp} needs {tp} devices; {len(devs)} {devs[0].platform} device(s) are visible")
    # Auto axes: GSPMD propagates shardings outside the explicit shard_map bodies
    return jax.make_mesh((tp,), (TP_AXIS,), axis_types=(AxisType.Auto,), devices=devs[:tp])


def check_tp(cfg: ModelConfig, tp: int) -> None:
    if cfg.num_heads % tp:
        raise UserError(f"tp={tp} must divide num_attention_heads={cfg.num_heads}")
    ffn = (("moe_intermediate_size", cfg.moe_intermediate_size),
           ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)) if cfg.num_experts else (
        ("intermediate_size", cfg.intermediate_size),)
    for name, size in ffn:
        if size % tp:
            raise UserError(f"tp={tp} must divide {name}={size}")
    kvh = cfg.num_kv_heads
    if kvh % tp and tp % kvh:
        raise UserError(f"tp={tp} and num_key_value_heads={kvh}: one must divide the other")


def tp_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the sharded model runs with (KV heads replicated up to tp when needed)."""
    check_tp(cfg, tp)
    return cfg.replace(num_kv_heads=tp) if tp > cfg.num_kv_heads else cfg


def param_spec(keys: tuple[str, ...], shape: tuple[int, ...], tp: int) -> P:
    """PartitionSpec of one weight, from its path in the model state (e.g. ('layers', 'q_proj', 'kernel'))."""
    owner, leaf = (keys[-2], keys[-1]) if len(keys) >= 2 else ("", keys[-1])
    ndim = len(shape)
    if owner in _COLUMN:
        return P(*([None] * (ndim - 1)), TP_AXIS)              # kernel [L, D, out] / bias [L, out]
    if owner in _ROW and leaf == "kernel":
        return P(*([None] * (ndim - 2)), TP_AXIS, None)        # kernel [L, in, D]
    if owner == "lm_head" and leaf == "kernel" and shape[-1] % tp == 0:
        return P(None, TP_AXIS)                                 # [D, V]; replicated if V does not split
    return P()


def kv_spec() -> P:
    return P(None, None, None, TP_AXIS, None)                   # [L, pages, page_size, kv_heads, head_dim]


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path if not hasattr(k, "name"))


def state_specs(state, tp: int) -> object:
    return jax.tree_util.tree_map_with_path(lambda path, x: param_spec(_keys(path), x.shape, tp), state)


def sharding_fn(mesh: Mesh):
    """For `load_model(..., sharding_fn=...)`: each weight restored straight into its shard layout."""
    tp = mesh.shape[TP_AXIS]
    return lambda keys, x: NamedSharding(mesh, param_spec(keys, tuple(x.shape), tp))


def replicate_kv_heads(model, tp: int, mesh: Mesh) -> None:
    """Repeat each KV head's k/v projection so the model has `tp` KV heads (needs tp % num_kv_heads == 0)."""
    cfg = model.cfg
    rep = tp // cfg.num_kv_heads
    hd = cfg.head_dim
    for name in ("k_proj", "v_proj"):
        lin = getattr(model.layers, name)
        for leaf in ("kernel", "bias"):
            var = getattr(lin, leaf, None)
            if var is None:
                continue
            w = np.asarray(jax.device_get(var[...]))
            shp = w.shape[:-1]
            w = np.repeat(w.reshape(*shp, cfg.num_kv_heads, hd), rep, axis=-2).reshape(*shp, tp * hd)
            keys = ("layers", name, leaf)
            var.set_value(jax.device_put(jnp.asarray(w), NamedSharding(mesh, param_spec(keys, w.shape, tp))))
    model.cfg = cfg.replace(num_kv_heads=tp)
    for layer_cfg_holder in (model.layers,):
        layer_cfg_holder.cfg = model.cfg


def shard_model(model, mesh: Mesh) -> None:
    """Move every weight of an in-memory model to its TP sharding (tests, random-weight benches)."""
    state = nnx.state(model, nnx.Param)
    specs = state_specs(state, mesh.shape[TP_AXIS])
    nnx.update(model, jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs))


def unstack_layers(stacked, layer_specs, mesh: Mesh, release: bool = False) -> list:
    """Per-layer weight pytrees (each array in its shard layout) from the stacked [L, ...] layer state.
    `release`: delete each stacked array once it is split (its owner must not use it again), so the peak
    memory is one stacked weight more than the weights, not twice the weights."""
    leaves, treedef = jax.tree_util.tree_flatten(stacked)
    spec_leaves = treedef.flatten_up_to(layer_specs)
    per_leaf = []
    for a, sp in zip(leaves, spec_leaves):
        n = a.shape[0]
        split = jax.jit(lambda a: tuple(a[i] for i in range(n)), out_shardings=(NamedSharding(mesh, sp),) * n)
        per_leaf.append(list(split(a)))                  # one compiled split per leaf, not one per slice
        if release:
            a.delete()
    return [jax.tree_util.tree_unflatten(treedef, [pl[i] for pl in per_leaf]) for i in range(len(per_leaf[0]))]
