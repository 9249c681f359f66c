"""Random-weight models for offload benchmarks of shapes larger than the device: the embedding, final norm and
head made on the device, and each decoder layer generated on the device only when the engine places it (then
moved to its tier), so a 60 GB OPT-30B never has to fit anywhere but across the tiers."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from nfjax.config import ModelConfig


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


@partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _make(key, shape, dtype, kind: str, std: float):
    if kind == "scale":
        return jnp.ones(shape, dtype)
    if kind == "bias":
        return jnp.zeros(shape, dtype)
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def _fill(state, seed: int, std: float):
    """An nnx State of abstract arrays -> the same State of random arrays on the device."""
    tree = nnx.to_pure_dict(state)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for i, (path, x) in enumerate(flat):
        kind = _keys(path)[-1]
        out.append(_make(jax.random.key(seed * 100_003 + i), tuple(x.shape), jnp.dtype(x.dtype),
                         kind if kind in ("scale", "bias") else "weight", std))
    state = jax.tree.map(lambda x: x, state)           # a copy to fill
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, out))
    return state


def random_parts(cfg: ModelConfig, seed: int = 0, std: float = 0.02):
    """(rest_gd, rest_state, layer_gd, source) for `OffloadEngine(cfg, rest_state, layer_gd, source, ...,
    rest_gd=rest_gd)`: `source(j)` generates layer j's weights on the device (N(0, std); norm scales 1, biases
    0)."""
    from nfjax.engine.step_programs import split_layers
    from nfjax.models.opt import model_class
    abstract = nnx.eval_shape(lambda: model_class(cfg)(cfg, nnx.Rngs(0)))
    rest_gd, rest_abs, layer_gd, stacked_abs = split_layers(abstract)
    rest_state = _fill(rest_abs, seed, std)
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked_abs)
    return rest_gd, rest_state, layer_gd, lambda j: _fill(one, seed + 1 + j, std)
