"""A small model whose op graph is declared without `@op`: two submodules by the module-level `@partition`
annotation, the rest by `mark(...)` blocks inside an ordinary forward."""
import jax
import jax.numpy as jnp
from flax import nnx

from nfjax.models.ops import Resource
from nfjax.schedule.annotate import mark, partition


class Norm(nnx.Module):
    def __init__(self, d):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]


@partition(norm=Resource.MEMORY, up=Resource.COMPUTE)
class ToyBlock(nnx.Module):
    def __init__(self, d: int, f: int, rngs: nnx.Rngs):
        self.norm = Norm(d)
        self.up = nnx.Linear(d, 2 * f, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(f, d, use_bias=False, rngs=rngs)
        self.mix = nnx.Linear(d, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        h = self.norm(x)                 # op "norm" (module-level annotation)
        gu = self.up(h)                  # op "up"
        with mark("act", Resource.MEMORY):
            g, u = jnp.split(gu, 2, axis=-1)
            a = jax.nn.silu(g) * u
        with mark("down"):
            y = self.down(a)
        with mark("mix"):
            z = self.mix(jnp.tanh(h)) + y
        with mark("residual", Resource.MEMORY):
            out = x + z
        return out


def forward(layer, env):
    return {"out": layer(env["x"])}


def toy(d=32, f=64, seed=0):
    return ToyBlock(d, f, nnx.Rngs(seed))
