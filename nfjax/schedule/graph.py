"""The op graph of one decoder layer, read from the model's own `@op` declarations (never a second copy).

Nodes are the layer's ops in definition order (that order is the plain sequential forward). An op's data
dependencies are the latest earlier ops producing its inputs; inputs nobody produced earlier come from the
layer's input env (`x`, `kv`, `positions`, `slots`). Values in `GLOBAL_VALUES` (the KV cache) are shared by
all nano-batches; every other value has a leading token axis.

Dependency rule per nano-batch (token ranges [lo, hi), nano-batches in token order):
  * a token-local input needs its producer done on the same tokens;
  * a global input (the cache) needs its producer done on every nano-batch of the layer. Causality alone
    would only need the tokens before hi (a token reads K/V of tokens at or before it), but the cache is
    updated in place: a write that follows a read of the previous version makes XLA copy the whole cache
    (measured on CPU, jax 0.10.2: a `copy` of the KV array per write, which an optimization_barrier does not
    prevent). So every cache read of a layer waits for all of its cache writes.
"""
from __future__ import annotations

from dataclasses import dataclass

from nfjax.models.ops import GLOBAL_VALUES, OpSpec, Resource


@dataclass(frozen=True)
class OpNode:
    spec: OpSpec
    index: int                                   # position in the sequential order
    deps: tuple[tuple[str, str | None], ...]     # (input value, producing op name or None = layer input)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def resource(self) -> Resource:
        return self.spec.resource

    @property
    def writes_global(self) -> bool:
        return any(v in GLOBAL_VALUES for v in self.spec.outs)

    @property
    def main_stream_only(self) -> bool:
        """Cache writers and collectives stay on stream 0 (`MAIN_STREAM_ONLY` says why): the one home of the rule,
        read by `Strategy.execute`, plan validation and the strategies that pick streams."""
        return self.writes_global or self.resource is Resource.NETWORK


# Why cache writers and collectives stay on stream 0: in-place cache writes must stay ordered on one stream, and
# XLA already runs collectives asynchronously.
MAIN_STREAM_ONLY = "it writes the KV cache in place, or is a collective, which XLA already runs asynchronously"


class OpGraph:
    """Ops of one layer with their data dependencies (see the module docstring)."""

    def __init__(self, specs: tuple[OpSpec, ...], inputs: tuple[str, ...] = ("x", "kv", "positions", "slots"),
                 output: str = "out"):
        self.inputs = tuple(inputs)
        self.output = output
        producer: dict[str, str] = {}
        nodes = []
        for i, spec in enumerate(specs):
            deps = []
            for v in spec.ins:
                if v not in producer and v not in self.inputs:
                    raise ValueError(f"op {spec.name!r} reads {v!r}, which no earlier op produces")
                deps.append((v, producer.get(v)))
            nodes.append(OpNode(spec, i, tuple(deps)))
            for v in spec.outs:
                producer[v] = spec.name
        if output not in producer:
            raise ValueError(f"no op produces the layer output {output!r}")
        self.nodes: tuple[OpNode, ...] = tuple(nodes)
        self._by_name = {n.name: n for n in nodes}
        if len(self._by_name) != len(nodes):
            raise ValueError("op names must be unique")

    def __getitem__(self, name: str) -> OpNode:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no op named {name!r}; the layer's ops are {', '.join(self.names)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    def by_resource(self, resource: Resource) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes if n.resource is resource)

    def stages(self) -> tuple[tuple[str, ...], ...]:
        """The layer cut after each cache write and each network op (a trailing tail joins the last stage):
        for the Llama layer (attn_norm … rope_append), (attn_decode … attn_reduce), (ffn_norm … residual)."""
        out, cur = [], []
        for n in self.nodes:
            cur.append(n.name)
            if n.resource is Resource.NETWORK or n.writes_global:
                out.append(tuple(cur))
                cur = []
        if cur:
            if out:
                out[-1] = out[-1] + tuple(cur)
            else:
                out.append(tuple(cur))
        return tuple(out)


def layer_graph(cfg=None) -> OpGraph:
    """The graph of `nfjax.models.llama.DecoderLayer`, or of the decoder layer of model config `cfg` (a MoE
    layer's: nfjax/models/moe.py)."""
    from nfjax.models.moe import layer_ops
    from nfjax.models.llama import LAYER_OPS
    return OpGraph(LAYER_OPS if cfg is None else layer_ops(cfg))
