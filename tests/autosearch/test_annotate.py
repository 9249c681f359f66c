"""DynaFlow annotations beyond `@op`: a toy model declared by a module-level `@partition` and `mark()` blocks.
Its traced op graph, ops that run at any token count, a profile of it, a searched plan for it, and that plan run by
the executor giving the plain forward's output."""
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from toy import forward, toy
from nfjax.autosearch.profiler import Grid, profile
from nfjax.autosearch.search import SearchOptions, search
from nfjax.autosearch.subjects import TracedSubject
from nfjax.models.ops import Resource, run_ops
from nfjax.schedule.annotate import AnnotationError, mark, trace_graph
from nfjax.schedule.api import ScheduleContext
from nfjax.schedule.executor import run_layer_schedule
from nfjax.schedule.strategies import NanoFlow


@pytest.fixture(scope="module")
def traced():
    layer = toy()
    x = jax.random.normal(jax.random.key(0), (32, 32))
    return layer, trace_graph(layer, forward, {"x": x})


def test_the_graph_has_the_declared_ops(traced):
    _, tg = traced
    g = tg.graph
    assert g.names == ("norm", "up", "act", "down", "mix", "residual")
    assert [g[n].resource for n in g.names] == [Resource.MEMORY, Resource.COMPUTE, Resource.MEMORY,
                                                 Resource.COMPUTE, Resource.COMPUTE, Resource.MEMORY]
    deps = {n.name: {p for _, p in n.deps} for n in g}
    assert deps == {"norm": {None}, "up": {"norm"}, "act": {"up"}, "down": {"act"}, "mix": {"norm", "down"},
                    "residual": {None, "mix"}}
    assert g["residual"].spec.outs == ("out",)


@pytest.mark.parametrize("n", [32, 8, 48])
def test_the_ops_run_the_forward_at_any_token_count(traced, n):
    layer, tg = traced
    x = jax.random.normal(jax.random.key(n), (n, 32))
    env = run_ops(tg.specs, layer, None, {"x": x})
    np.testing.assert_allclose(np.asarray(env["out"]), np.asarray(layer(x)), rtol=1e-6, atol=1e-6)


def test_annotation_errors():
    layer = toy()
    x = jnp.ones((8, 32))
    with pytest.raises(AnnotationError, match="no marked op"):
        trace_graph(layer, lambda lay, env: {"out": env["x"] * 2}, {"x": x})

    def twice(lay, env):
        with mark("a"):
            y = env["x"] * 2
        with mark("b"):
            y = y + 1
        with mark("a"):
            y = y * 3
        return {"out": y}
    with pytest.raises(AnnotationError, match="'a' is marked in two places"):
        trace_graph(layer, twice, {"x": x})
    with pytest.raises(AnnotationError, match="identifier"):
        with mark("not a name"):
            pass


@dataclass(frozen=True)
class _Ctx:                      # what the executor reads of a layer context
    meta: object = None
    num_ctas: int | None = None


def test_profile_search_plan_run_on_the_toy_model(traced):
    """The profiler times every declared op; the search (forced to split, since on a CPU splitting only costs)
    writes a plan over the toy's graph; the executor runs that plan to the plain forward's output."""
    layer, tg = traced
    prof = profile(TracedSubject(tg, layer, "toy"), Grid(tokens=(16, 32, 64), reps=2, target_ms=2.0),
                   device="cpu", device_name="cpu", num_sms=0, align=16, log=lambda m: None)
    assert set(prof["tokens"]) == set(tg.graph.names) and not prof["errors"]
    assert prof["value_bytes"]["x"] == 32 * 4
    (r,) = search(tg.graph, prof, [64], [1], 0, 1, SearchOptions(nano_batches=(2,), min_gain=-1.0, time_limit=30))
    assert r.plan is not None and len(r.structure.bounds) == 3
    ls = NanoFlow(r.plan, graph=tg.graph).record(ScheduleContext(64, tg.graph))
    assert len(ls.nano_batches) == 2
    x = jax.random.normal(jax.random.key(3), (64, 32))
    out = run_layer_schedule(ls, layer, _Ctx(), {"x": x})["out"]
    out = jnp.concatenate(out) if isinstance(out, tuple) else out
    np.testing.assert_allclose(np.asarray(out), np.asarray(layer(x)), rtol=1e-5, atol=1e-5)
