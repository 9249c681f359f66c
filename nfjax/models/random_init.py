"""Random-weight models built straight on the device (benchmarks of 8B/70B shapes need no checkpoint)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nfjax.config import ModelConfig
from nfjax.models.llama import LlamaModel

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=8192, dtype="bfloat16", eos_token_ids=(128001,))
LLAMA3_70B = LLAMA3_8B.replace(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64)
SMOKE = LLAMA3_8B.replace(vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=32, dtype="float32")     # CPU smoke runs of the benches
# OPT-30B (FlexGen's model): 48 layers, hidden 7168, FFN 28672, 56 heads of 128
OPT_30B = ModelConfig(vocab_size=50272, hidden_size=7168, intermediate_size=28672, num_layers=48, num_heads=56,
                      num_kv_heads=56, head_dim=128, max_position_embeddings=2048, tie_word_embeddings=True,
                      qkv_bias=True, model_type="opt", bos_token_id=2, eos_token_ids=(2,), dtype="bfloat16")
OPT_SMOKE = OPT_30B.replace(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=2,
                            num_kv_heads=2, head_dim=64, max_position_embeddings=1024, dtype="float32")
# Mixtral-8x7B (46.7B parameters, 12.9B active: top-2 of 8 SwiGLU experts of 14336 per layer); 93 GB in bf16
MIXTRAL_8X7B = LLAMA3_8B.replace(vocab_size=32000, rope_theta=1e6, max_position_embeddings=32768,
                                 model_type="mixtral", bos_token_id=1, eos_token_ids=(2,), num_experts=8,
                                 num_experts_per_tok=2, moe_intermediate_size=14336)
MIXTRAL_SMOKE = SMOKE.replace(model_type="mixtral", vocab_size=512, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=256, max_position_embeddings=1024, rope_theta=1e6)
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "smoke": SMOKE, "opt-30b": OPT_30B,
          "opt-smoke": OPT_SMOKE, "mixtral-8x7b": MIXTRAL_8X7B, "mixtral-smoke": MIXTRAL_SMOKE}


_BIG = 1 << 31          # elements of an array drawn one leading slice at a time


def random_model(cfg: ModelConfig, seed: int = 0, std: float = 0.02, sharding_fn=None,
                 host: bool = False) -> LlamaModel:
    """A model whose weights are N(0, std) (norm scales 1), generated on the device one array at a time.

    `sharding_fn(param_path, abstract) -> Sharding` places each array (default: the default device).
    `host`: draw with numpy and copy in (CPU tests of large shapes: numpy's generator is ~4x faster than
    threefry on a CPU and compiles nothing; on a GPU the device generator is faster).
    """
    from nfjax.models.opt import model_class
    model = nnx.eval_shape(lambda: model_class(cfg)(cfg, nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(pure)
    out = []
    for i, (path, x) in enumerate(leaves):
        keys = tuple(str(getattr(k, "key", k)) for k in path)
        sh = sharding_fn(keys, x) if sharding_fn else None
        is_norm = keys[-1] == "scale"
        is_bias = keys[-1] == "bias"

        def make(k, shape=x.shape, dtype=x.dtype, norm=is_norm, bias=is_bias):
            if norm:
                return jnp.ones(shape, dtype)
            if bias:
                return jnp.zeros(shape, dtype)
            if len(shape) > 1 and np.prod(shape) > _BIG:
                # one layer at a time: bounded temporaries (Mixtral-8x7B's stacked experts are 30 GB in bf16)
                return jax.lax.map(lambda kk: (jax.random.normal(kk, shape[1:], jnp.float32) * std).astype(dtype),
                                   jax.random.split(k, shape[0]))
            return (jax.random.normal(k, shape, jnp.float32) * std).astype(dtype)

        if host:
            rng = np.random.default_rng(seed * 1000 + i)
            val = (np.ones(x.shape, np.float32) if is_norm else np.zeros(x.shape, np.float32) if is_bias
                   else rng.standard_normal(x.shape, np.float32) * np.float32(std))
            out.append(jax.device_put(val.astype(x.dtype), sh))
            continue
        out.append(jax.jit(make, out_shardings=sh)(jax.random.key(seed * 1000 + i)))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, out))
    nnx.update(model, state)
    return model
