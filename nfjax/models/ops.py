"""Named ops: the decoder layer declares its ops once; the plain forward and the schedule layer both read them.

An op is a method tagged with `@op(resource, ins=..., outs=...)`. Values flow between ops by name through an
`env` dict. Names in `GLOBAL_VALUES` (the KV cache) are shared by all nano-batches; every other value has a
leading token axis and can be sliced per nano-batch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

import jax


class Resource(enum.Enum):
    COMPUTE = "compute"   # GEMM-bound
    MEMORY = "memory"     # bandwidth-bound
    NETWORK = "network"   # collectives


GLOBAL_VALUES = frozenset({"kv"})


@dataclass(frozen=True)
class OpSpec:
    name: str
    resource: Resource
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    fn: Callable[..., Any]  # fn(layer, ctx, *ins) -> outs (a tuple when len(outs) > 1): the op of this name of
    #                         the layer's own class (`_late_bound`), so a layer class that declares the same op
    #                         graph (OPT's, nfjax/models/opt.py) runs under every schedule recorded from Llama's

    def __call__(self, layer, ctx, env: dict) -> dict:
        res = self.fn(layer, ctx, *(env[i] for i in self.ins))
        res = res if len(self.outs) > 1 else (res,)
        return dict(zip(self.outs, res))


def _late_bound(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, or the override of op `name` in the class of the layer it is called on."""
    def call(layer, ctx, *args):
        impl = getattr(type(layer), name, fn)
        return impl(layer, ctx, *args)
    call.__name__ = name
    return call


def op(resource: Resource, ins: tuple[str, ...], outs: tuple[str, ...]):
    def deco(fn):
        fn.__opspec__ = OpSpec(fn.__name__, resource, tuple(ins), tuple(outs), _late_bound(fn.__name__, fn))
        return fn
    return deco


def collect_ops(cls) -> tuple[OpSpec, ...]:
    """The op specs of a layer class in definition order (the plain sequential order)."""
    seen, out = set(), []
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            spec = getattr(attr, "__opspec__", None)
            if spec is not None and name not in seen:
                seen.add(name)
                out.append(spec)
    return tuple(out)


def run_ops(ops, layer, ctx, env: dict) -> dict:
    """Sequential execution: every op once, in order, on the whole batch."""
    for spec in ops:
        with jax.named_scope(f"{spec.name}@0"):      # the op's name on its kernels in profiler traces
            env.update(spec(layer, ctx, env))
    return env
