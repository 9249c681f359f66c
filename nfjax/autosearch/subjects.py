"""What the profiler times: one layer of a model, its op graph, and inputs for every op at a given size.

`LlamaSubject`: the Llama decoder layer (ops declared with `@op`), one layer of random weights of a model
shape, with a paged KV cache and real attention metadata: token-count cases (one prefill chunk of n tokens),
decode cases (d sequences at context c, one token each) and prefill cases (one chunk of c tokens continuing a
sequence at position s). `TracedSubject`: any layer whose ops are declared by `mark` / `partition`
(nfjax.schedule.annotate): every op is timed against its token count. Inputs are random (GEMMs run faster on zeros).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nfjax.models.ops import GLOBAL_VALUES, Resource, run_ops


class Case(NamedTuple):
    ctx_args: object                 # arrays the op's context is built from inside the jitted function
    env: dict                        # an input array for every value the ops read
    tokens: int                      # the token count of the case


def _random_like(shape_dtype, key):
    if jnp.issubdtype(shape_dtype.dtype, jnp.floating):
        return (jax.random.normal(key, shape_dtype.shape, jnp.float32) * 0.5).astype(shape_dtype.dtype)
    return jnp.zeros(shape_dtype.shape, shape_dtype.dtype)


class TracedSubject:
    """A layer traced by `trace_graph`: token-count cases only (no attention metadata)."""
    kinds: dict = {}
    attention_ops = ()

    def __init__(self, traced, layer, name: str = "custom"):
        self.traced, self.layer, self.graph, self.model = traced, layer, traced.graph, name
        self.shape = {"input": {k: [list(v.shape[1:]), str(v.dtype)] for k, v in traced.example.items()}}

    def kind(self, op: str) -> str:
        return "tokens"

    def make_ctx(self, ctx_args, num_ctas):
        return None

    def token_case(self, n: int) -> Case:
        ex = {k: jax.ShapeDtypeStruct(v.shape if k in GLOBAL_VALUES else (n,) + tuple(v.shape[1:]), v.dtype)
              for k, v in self.traced.example.items()}
        shapes = jax.eval_shape(lambda e: run_ops([n.spec for n in self.graph], self.layer, None, dict(e)), ex)
        keys = jax.random.split(jax.random.key(n), len(shapes))
        return Case(None, {k: _random_like(s, kk) for (k, s), kk in zip(sorted(shapes.items()), keys)}, n)

    def join_free(self) -> list[str]:
        return [n.name for n in self.graph if n.resource is Resource.MEMORY]


class LlamaSubject:
    """One random-weight Llama decoder layer of `cfg`'s shape, with a paged KV cache. `join`: q/k/v and gate/up
    joined into one weight each, as the Runner serves them by default (`execution.join_projections`); run 7's
    profile timed the separate weights (three and two GEMMs) while its steps ran the joined ones."""
    attention_ops = ("attn_decode", "attn_prefill")

    def __init__(self, cfg, page_size: int, max_seqs: int, max_pages: int, max_prefill_seqs: int = 16, seed: int = 0,
                 join: bool = True, swiglu_epilogue: bool = True):
        from nfjax.config import CacheConfig
        from nfjax.kv.cache import KVCache
        from nfjax.models.llama import ForwardOptions
        from nfjax.models.random_init import random_model
        from nfjax.models.rope import inv_frequencies
        from nfjax.schedule.graph import layer_graph
        from nfjax.autosearch.profile import model_name, shape_of
        self.cfg = cfg.replace(num_layers=1)
        self.model = model_name(cfg)
        self.graph = layer_graph()
        m = random_model(self.cfg, seed=seed)
        gd, st = nnx.split(m.layers)
        self.layer = nnx.merge(gd, jax.tree.map(lambda a: a[0], st))
        if join:
            from nfjax.models.fused import join_projections
            from nfjax.parallel import make_mesh
            # gate/up interleaved for the SwiGLU epilogue where the engine runs it (docs/design.md section 20): in a
            # step of >= 128 tokens Sequential's up_gate is then the Pallas GEMM with SwiGLU, as the pair kernel's
            # GEMM half is. Profiled with XLA's dot instead (H200, docs/design.md section 12), Sequential's up_gate
            # read 0.72 ms at 2,048 tokens against ~0.6 in the step, and plans modelled ~5% ahead of a Sequential
            # they measured 2% behind.
            join_projections(self.layer, make_mesh(1), swiglu_epilogue=swiglu_epilogue)
        self.projections = "joined" if join else "separate"
        # what the profile records: whether the weight was interleaved (a CPU, or weights the kernel does not take,
        # keep XLA's dot whatever was asked)
        self.swiglu_epilogue = bool(getattr(getattr(self.layer, "gate_up_proj", None), "interleave", 0))
        self.inv_freq = jnp.asarray(inv_frequencies(self.cfg), jnp.float32)
        self.page_size, self.max_seqs, self.max_pages = page_size, max_seqs, max_pages
        self.opts = ForwardOptions(max_prefill_seqs=max_prefill_seqs)
        kv = KVCache.create(self.cfg, CacheConfig(page_size=page_size, num_pages=max_pages))
        self.kv = jax.tree.map(lambda a: _random_like(a, jax.random.key(7)) if a.ndim == 5 else a, kv)
        self.shape = shape_of(cfg)

    def kind(self, op: str) -> str:
        return {"attn_decode": "decode", "attn_prefill": "prefill"}.get(op, "tokens")

    def make_ctx(self, meta, num_ctas):
        from nfjax.models.llama import LayerContext
        return LayerContext(jnp.int32(0), meta, self.inv_freq, num_ctas=num_ctas, opts=self.opts)

    def _meta(self, seqs, tokens: int, num_decode: int):
        from nfjax.kv.metadata import build_metadata
        ps, nxt, specs = self.page_size, 1, []
        width = max(-(-(start + n) // ps) for start, n in seqs) if seqs else 1
        for start, n in seqs:
            npg = -(-(start + n) // ps)
            if nxt + npg > self.max_pages:
                raise ValueError(f"profile case needs more than {self.max_pages} KV pages")
            specs.append((list(range(nxt, nxt + npg)), start, n))
            nxt += npg
        meta = build_metadata(specs, tokens, min(self.max_seqs, max(tokens, len(seqs))), width, ps,
                              num_decode=num_decode)
        return jax.tree.map(jnp.asarray, meta)

    def _case(self, meta, tokens: int) -> Case:
        env0 = {"x": jax.ShapeDtypeStruct((tokens, self.cfg.hidden_size), jnp.dtype(self.cfg.dtype)),
                "kv": self.kv, "positions": meta.positions, "slots": meta.slot_mapping}
        ctx = self.make_ctx(meta, None)
        shapes = jax.eval_shape(lambda e: run_ops([n.spec for n in self.graph], self.layer, ctx, dict(e)), env0)
        keys = jax.random.split(jax.random.key(tokens), len(shapes))
        env = {k: _random_like(s, kk) for (k, s), kk in zip(sorted(shapes.items()), keys)
               if k not in ("kv", "positions", "slots")}
        env.update(kv=self.kv, positions=meta.positions, slots=meta.slot_mapping)
        return Case(meta, env, tokens)

    def token_case(self, n: int) -> Case:
        return self._case(self._meta([(0, n)], n, 0), n)

    def decode_case(self, d: int, ctx: int, tokens: int) -> Case:
        """`d` decodes at context `ctx` in a `tokens`-token nano-batch (rows past d: padding)."""
        return self._case(self._meta([(ctx, 1)] * d, tokens, d), tokens)

    def mixed_case(self, tokens: int, decodes: int, ctx: int, chunks: int = 2) -> Case:
        """A step as the engine lays it out: `decodes` decodes at context `ctx`, then the rest of the `tokens` as
        `chunks` equal first chunks of prefill (the search's batch class)."""
        p = tokens - decodes
        n = min(chunks, p) if p > 0 else 0
        cuts = [p * i // n for i in range(n + 1)] if n else [0]
        seqs = [(ctx, 1)] * decodes + [(0, b - a) for a, b in zip(cuts, cuts[1:])]
        return self._case(self._meta(seqs, tokens, decodes), tokens)

    def prefill_case(self, chunk: int, start: int = 0) -> Case:
        """One prefill chunk of `chunk` rows continuing a sequence at position `start`."""
        return self._case(self._meta([(start, chunk)], chunk, 0), chunk)

    def join_free(self) -> list[str]:
        """XLA fusions that read a merged value's pieces in place: the memory-bound ops that are not kernels."""
        return [n.name for n in self.graph if n.resource is Resource.MEMORY and self.kind(n.name) == "tokens"]


def value_bytes(case: Case) -> dict:
    """Bytes per token of every token-axis value of a case."""
    out = {}
    for k, v in case.env.items():
        if k in GLOBAL_VALUES or not hasattr(v, "shape") or not v.shape:
            continue
        out[k] = float(np.prod(v.shape[1:]) * jnp.dtype(v.dtype).itemsize)
    return out
