"""DynaFlow partition annotations beyond `@op`: declare a layer's op graph without rewriting its forward.

Three ways to name the ops of a layer, all giving the same `OpGraph` that strategies, plans, the profiler and the
plan search read:
  * `@op(resource, ins=..., outs=...)` on methods (nfjax.models.ops; the Llama layer): the forward is written as
    named ops over an env;
  * a module-level annotation, `@partition(norm=Resource.MEMORY, mlp=Resource.COMPUTE)` on an `nnx.Module`
    class: every call of the submodule in that attribute is the op of that name;
  * a `with mark("name", resource):` block inside a forward: the code in the block is that op.

The last two are found by tracing the forward once (`trace_graph`): its jaxpr's equations are cut by the marks
(a mark is a `jax.named_scope`, so every equation carries it; nested marks: the outermost names the op). An
equation outside every mark joins the next marked op (trailing ones the last). An op's inputs are the values it
reads from the layer's inputs or from earlier ops; its outputs the values later ops or the forward's result
read. The values are named `"<op>.<k>"`, the forward's inputs by their names and its result `output`. Each op
runs as its own equations (`OpSpec.fn`), re-traced once per token count so nano-batches of any size run.
Every value but those in `GLOBAL_VALUES` must have the token axis first.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable

import jax
from flax import nnx

from nfjax.compat import bind_params
from nfjax.errors import UserError
from nfjax.models.ops import GLOBAL_VALUES, OpSpec, Resource
from nfjax.schedule.graph import OpGraph

_SCOPE = "nfjax_op"
_lock = threading.Lock()


class AnnotationError(UserError):
    """A forward whose annotations do not make an op graph (names the op or value at fault)."""


@contextlib.contextmanager
def mark(name: str, resource: Resource = Resource.COMPUTE):
    """The code in this block is the op `name` (bound by `resource`). Costs nothing when not traced by
    `trace_graph`: a named scope, which also labels the op's kernels in profiler traces."""
    if not name.isidentifier():
        raise AnnotationError(f"mark({name!r}): an op name must be an identifier")
    with jax.named_scope(f"{_SCOPE}={name}={Resource(resource).value}"):
        yield


def partition(cls=None, /, **ops: Resource):
    """Module-level annotation: `@partition(attr=resource, ...)` on an nnx.Module class, or
    `partition(cls, attr=resource, ...)`: each call of the submodule held in `attr` is the op `attr`."""
    def deco(c):
        for a, r in ops.items():
            Resource(r)
            if not a.isidentifier():
                raise AnnotationError(f"partition: {a!r} is not an attribute name")
        c.__nfjax_partition__ = {**getattr(c, "__nfjax_partition__", {}), **ops}
        return c
    return deco if cls is None else deco(cls)


@contextlib.contextmanager
def _marked_submodules(layer):
    """While tracing: calls of the `partition`-declared submodules of `layer` run inside `mark(attr)`."""
    decl = getattr(type(layer), "__nfjax_partition__", {})
    targets = {}
    for attr, res in decl.items():
        sub = getattr(layer, attr, None)
        if sub is None or not callable(sub):
            raise AnnotationError(f"partition: {type(layer).__name__}.{attr} is not a callable submodule")
        targets[id(sub)] = (attr, res)
    classes = {type(getattr(layer, a)) for a in decl}
    saved = {c: c.__dict__.get("__call__") for c in classes}

    def wrap(orig):
        def call(self, *a, **k):
            t = targets.get(id(self))
            if t is None:
                return orig(self, *a, **k)
            with mark(*t):
                return orig(self, *a, **k)
        return call
    try:
        for c in classes:
            c.__call__ = wrap(c.__call__)
        yield
    finally:
        for c, orig in saved.items():
            if orig is None:
                del c.__call__
            else:
                c.__call__ = orig


def _op_of(eqn) -> tuple[str, Resource] | None:
    for part in str(eqn.source_info.name_stack).split("/"):
        if part.startswith(_SCOPE + "="):
            _, name, res = part.split("=")
            return name, Resource(res)
    return None


@dataclass(frozen=True)
class _Cut:
    """One trace of the forward, cut into ops."""
    names: tuple[str, ...]
    resources: dict
    eqns: dict                   # op -> its equations
    ins: dict                    # op -> [(value name, var)]
    outs: dict                   # op -> [(value name, var)]
    params: list                 # the jaxpr's parameter invars (the layer's state leaves), in order
    consts: dict                 # constvar -> value


def _cut(closed, n_params: int, input_names: list[str], output: str) -> _Cut:
    jaxpr = closed.jaxpr
    params, inputs = jaxpr.invars[:n_params], jaxpr.invars[n_params:]
    owner, order, res = [], [], {}
    for eqn in jaxpr.eqns:
        t = _op_of(eqn)
        owner.append(t[0] if t else None)
        if t:
            if t[0] in res and order[-1] != t[0]:
                raise AnnotationError(f"op {t[0]!r} is marked in two places of the forward; give each block its "
                                      "own name")
            if t[0] not in res:
                order.append(t[0])
                res[t[0]] = t[1]
    if not order:
        raise AnnotationError("the forward has no marked op (use mark(...) blocks or @partition)")
    nxt = None                   # unmarked equations join the next marked op; trailing ones the last
    for i in range(len(owner) - 1, -1, -1):
        if owner[i] is None:
            owner[i] = nxt or order[-1]
        else:
            nxt = owner[i]
    eqns = {n: [] for n in order}
    defined = {}
    for o, eqn in zip(owner, jaxpr.eqns):
        eqns[o].append(eqn)
        for v in eqn.outvars:
            defined[v] = o
    input_of = dict(zip(inputs, input_names))
    is_var = lambda v: type(v).__name__ not in ("Literal", "DropVar")            # noqa: E731
    used_by: dict = {}
    for o in order:
        for eqn in eqns[o]:
            for v in filter(is_var, eqn.invars):
                if defined.get(v) not in (None, o):
                    used_by.setdefault(v, set()).add(o)
    final = jaxpr.outvars[0]
    outs, ins = {o: [] for o in order}, {o: [] for o in order}
    for o in order:
        exported = [v for eqn in eqns[o] for v in eqn.outvars if is_var(v) and (v in used_by or v is final)]
        k = 0
        for v in dict.fromkeys(exported):
            if v is final:
                outs[o].append((output, v))
            else:
                outs[o].append((f"{o}.{k}", v))
                k += 1
    name_of = {v: n for o in order for n, v in outs[o]}
    name_of.update(input_of)
    pset = set(params)
    for o in order:
        seen = []
        for eqn in eqns[o]:
            for v in filter(is_var, eqn.invars):
                if v in pset or v in closed.jaxpr.constvars or defined.get(v) == o or v in seen:
                    continue
                seen.append(v)
        ins[o] = [(name_of[v], v) for v in seen]
    return _Cut(tuple(order), res, eqns, ins, outs, list(params),
                dict(zip(jaxpr.constvars, closed.consts)))


def _eval(eqns, env: dict) -> None:
    def read(v):
        return v.val if type(v).__name__ == "Literal" else env[v]
    for eqn in eqns:
        subfuns, params = bind_params(eqn.primitive, eqn.params)
        outs = eqn.primitive.bind(*subfuns, *[read(v) for v in eqn.invars], **params)
        for v, x in zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]):
            if type(v).__name__ != "DropVar":
                env[v] = x


class TracedGraph:
    """The op graph of a forward declared with `mark` / `partition`, and ops that run its own equations.

    `forward(layer, env) -> dict` (or the output array): the layer's plain forward over named inputs.
    `example`: one input env; every value but those in GLOBAL_VALUES has the token axis first."""

    def __init__(self, layer, forward: Callable, example: dict, output: str = "out"):
        self.forward, self.output = forward, output
        self.input_names = list(example)
        self.example = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in example.items()}
        self.graphdef = nnx.graphdef(layer)
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.state(layer))
        self._leaves, self._treedef = jax.tree.flatten(shapes)
        self._cuts: dict[int, _Cut] = {}
        self._base = base = self._cut_at(self._tokens(example))
        self.specs = tuple(OpSpec(name, base.resources[name], tuple(n for n, _ in base.ins[name]),
                                  tuple(n for n, _ in base.outs[name]), self._op_fn(name)) for name in base.names)
        try:
            self.graph = OpGraph(self.specs, inputs=tuple(self.input_names), output=output)
        except ValueError as e:
            raise AnnotationError(f"the marked ops do not make an op graph: {e}") from None

    def _tokens(self, env) -> int:
        for k, v in env.items():
            if k not in GLOBAL_VALUES:
                return int(v.shape[0])
        raise AnnotationError("the forward has no token-axis input")

    def _cut_at(self, n: int) -> _Cut:
        if n in self._cuts:
            return self._cuts[n]
        example = [jax.ShapeDtypeStruct(s.shape if k in GLOBAL_VALUES else (n,) + tuple(s.shape[1:]), s.dtype)
                   for k, s in self.example.items()]
        gd, treedef, names, out = self.graphdef, self._treedef, self.input_names, self.output

        def f(leaves, *ins):
            layer = nnx.merge(gd, jax.tree.unflatten(treedef, leaves))
            with _marked_submodules(layer):
                r = self.forward(layer, dict(zip(names, ins)))
            return r[out] if isinstance(r, dict) else r
        with _lock:
            closed = jax.make_jaxpr(f)(self._leaves, *example)
        cut = _cut(closed, len(self._leaves), names, out)
        base = getattr(self, "_base", None)
        if base is not None and (cut.names != base.names or any(
                [a for a, _ in cut.ins[o]] != [a for a, _ in base.ins[o]] for o in cut.names)):
            raise AnnotationError(f"the forward's ops at {n} tokens differ from those at {self._tokens(self.example)}")
        self._cuts[n] = cut
        return cut

    def _op_fn(self, name: str):
        def fn(layer, ctx, *ins):
            n = next((int(x.shape[0]) for (v, _), x in zip(self._base.ins[name], ins) if v not in GLOBAL_VALUES),
                     None)
            cut = self._base if n is None else self._cut_at(n)
            env = dict(cut.consts)
            env.update(zip(cut.params, jax.tree.leaves(nnx.state(layer))))
            env.update((var, x) for (_, var), x in zip(cut.ins[name], ins))
            _eval(cut.eqns[name], env)
            outs = tuple(env[v] for _, v in cut.outs[name])
            return outs if len(outs) > 1 else outs[0]
        fn.__name__ = name
        return fn


def trace_graph(layer, forward: Callable, example: dict, output: str = "out") -> TracedGraph:
    """Trace `forward(layer, env)` once on `example` and cut it into the ops its annotations declare."""
    return TracedGraph(layer, forward, example, output)
