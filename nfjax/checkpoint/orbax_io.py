"""nfjax checkpoint folder: `nfjax_config.json` (ModelConfig), `params/` (Orbax), tokenizer files if any.

Loading builds the model abstractly (no weights allocated), then Orbax restores every array straight into
its target sharding.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from nfjax.config import ModelConfig
from nfjax.errors import UserError
from nfjax.models.llama import LlamaModel

CONFIG_FILE = "nfjax_config.json"
PARAMS_DIR = "params"


class CheckpointError(UserError):
    """A checkpoint folder nfjax cannot read, with the file and field named."""


def save_model(model: LlamaModel, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(model.cfg.to_json(), indent=2))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((out / PARAMS_DIR).absolute(), pure)


def load_config(path: str | Path) -> ModelConfig:
    f = Path(path) / CONFIG_FILE
    if not f.exists():
        raise CheckpointError(f"{f}: missing (is {path} an nfjax checkpoint? convert HF models with `nfjax convert`)")
    try:
        return ModelConfig.from_json(json.loads(f.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{f}: unreadable model config ({e})") from None


def abstract_model(cfg: ModelConfig) -> LlamaModel:
    from nfjax.models.opt import model_class
    return nnx.eval_shape(lambda: model_class(cfg)(cfg, nnx.Rngs(0)))


def load_model(path: str | Path, dtype: str | None = None,
               sharding_fn: Callable[[tuple[str, ...], jax.ShapeDtypeStruct], jax.sharding.Sharding] | None = None
               ) -> LlamaModel:
    """Restore a model. `sharding_fn(param_path, abstract_array) -> Sharding` places each weight (default: device 0).

    `dtype` overrides the stored dtype (weights are cast while restoring).
    """
    cfg = load_config(path)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    model = abstract_model(cfg)
    state = nnx.state(model, nnx.Param)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pure = nnx.to_pure_dict(state)

    def target(p, x):
        keys = tuple(str(getattr(k, "key", k)) for k in p)
        sh = sharding_fn(keys, x) if sharding_fn else default
        return jax.ShapeDtypeStruct(x.shape, jnp.dtype(cfg.dtype), sharding=sh)

    abstract = jax.tree_util.tree_map_with_path(target, pure)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore((Path(path) / PARAMS_DIR).absolute(), abstract)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    return model
