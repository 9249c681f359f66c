"""Radix selection (nfjax/experimental/radix_select.py) against numpy, and its sort-free top-k / top-p kept set
against a float64 numpy reference of the engine's sort path's rule and against the sort path's tokens, in both
of its forms."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nfjax.engine.sampler import sample
from nfjax.experimental import radix_select as rs
from nfjax.experimental.radix_select import FORMS, radix_kept, sample_radix


def test_float_keys_keep_the_order():
    x = np.array([-np.inf, -3e38, -2.5, -1e-30, -0.0, 0.0, 1e-30, 1.0, 2.5, 3e38, np.inf], np.float32)
    k = np.asarray(rs.float_keys(jnp.asarray(x))).astype(np.int64)
    assert (np.diff(k) > 0).all()
    rng = np.random.default_rng(0)
    y = (rng.standard_normal(2000) * rng.choice([1e-3, 1.0, 1e3], 2000)).astype(np.float32)
    ky = np.asarray(rs.float_keys(jnp.asarray(y))).astype(np.int64)
    np.testing.assert_array_equal(np.argsort(y, kind="stable"), np.argsort(ky, kind="stable"))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", range(2))
def test_largest_reaching_is_the_largest_threshold_that_reaches(seed, form):
    rng = np.random.default_rng(seed)
    v = 300
    keys = rng.integers(0, 2**32, v, dtype=np.uint64).astype(np.uint32)
    keys[:40] = keys[40:80]                                       # ties
    w = rng.random(v).astype(np.float32) * (rng.random(v) < 0.7)
    f = jax.jit(lambda k, w, t: rs.largest_reaching(k, w, t, form=form))
    for target in (0.5, 3.0, float(w.sum()) * 0.6, float(w.sum()) + 1.0):
        t = int(f(jnp.asarray(keys), jnp.asarray(w), target))
        mass = lambda th: w[keys.astype(np.int64) >= th].sum(dtype=np.float64)   # noqa: E731
        if mass(0) < target:
            assert t == 0
            continue
        assert mass(t) >= target - 1e-4
        assert t == 2**32 - 1 or mass(t + 1) < target + 1e-4
    for k in (1, 7, v):                                           # unit weights: the k-th largest key
        t = int(f(jnp.asarray(keys), jnp.ones(v, jnp.float32), k))
        assert t == np.sort(keys)[::-1][k - 1]


@pytest.mark.parametrize("form", FORMS)
def test_first_ties_take_ties_in_row_order(form):
    tie = np.zeros(50, bool)
    tie[[3, 9, 10, 31, 44]] = True
    w = np.where(tie, 0.25, 0.0).astype(np.float32)
    for target, want in ((0.0, []), (0.2, [3]), (0.25, [3]), (0.3, [3, 9]), (1.0, [3, 9, 10, 31]),
                         (2.0, [3, 9, 10, 31, 44])):
        got = np.flatnonzero(np.asarray(rs.first_ties(jnp.asarray(tie), jnp.asarray(w), target, form)))
        assert got.tolist() == want, target


def reference_kept(scaled: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, float]:
    """The sort path's rule in float64: a stable sort by value (ties in token order), the first k, then the
    ranks whose mass before them (within the top-k set) is < top_p. Also the distance of top_p to the nearest
    prefix mass (a case that close is decided by rounding)."""
    order = np.argsort(-scaled.astype(np.float64), kind="stable")
    v = len(scaled)
    k = top_k if 0 < top_k < v else v
    top = order[:k]
    z = scaled[top].astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
    kept = np.zeros(v, bool)
    kept[top[before < top_p]] = True
    return kept, float(np.abs(np.cumsum(p) - top_p).min())


def _rows(rng, n, v):
    """Rows of every kind: continuous values, few distinct values (many ties), and -inf entries."""
    rows = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            x = rng.standard_normal(v) * 2
        elif kind == 1:
            x = rng.integers(-3, 3, v).astype(np.float64)
        else:
            x = rng.standard_normal(v)
            x[rng.random(v) < 0.3] = -np.inf
        rows.append(x.astype(np.float32))
    return np.stack(rows)


@pytest.mark.parametrize("form", FORMS)
def test_radix_kept_set_is_the_sort_paths_rule(form):
    rng = np.random.default_rng(1)
    v, n = 97, 240
    x = _rows(rng, n, v)
    ks = rng.choice([0, 1, 2, 5, 20, v, v + 7], n).astype(np.int32)
    ps = rng.choice([1.0, 0.95, 0.9, 0.5, 0.1, 1e-6], n).astype(np.float32)
    got = np.asarray(jax.jit(jax.vmap(lambda a, k, p: radix_kept(a, k, p, form)))(jnp.asarray(x), jnp.asarray(ks),
                                                                                    jnp.asarray(ps)))
    checked = 0
    for i in range(n):
        want, margin = reference_kept(x[i], int(ks[i]), float(ps[i]))
        if margin < 1e-5:
            continue                       # rounding decides it (the docstring's caveat)
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i} k={ks[i]} p={ps[i]}")
        checked += 1
    assert checked > 0.8 * n
    assert got.sum(1).min() >= 1                                   # the top token always survives


def test_radix_path_draws_the_sort_paths_tokens():
    """Both methods over many keys, rows, limits and temperatures: the same tokens (the same kept set and the
    same noise), away from top-p values that rounding decides."""
    rng = np.random.default_rng(2)
    v, n = 64, 300
    x = _rows(rng, n, v)
    temp = rng.choice([0.0, 0.7, 1.0, 2.0], n).astype(np.float32)
    ks = rng.choice([0, 1, 3, 10, v], n).astype(np.int32)
    ps = rng.choice([1.0, 0.9, 0.5, 0.2], n).astype(np.float32)
    args = (x, temp, ks, ps, rng.integers(0, 2**31, n).astype(np.uint32),
            rng.integers(0, 1000, n).astype(np.int32))
    by_sort = np.asarray(jax.jit(sample)(*args))
    by_radix = np.asarray(jax.jit(sample_radix)(*args))
    close = np.array([t > 0 and reference_kept(x[i] / t, int(ks[i]), float(ps[i]))[1] < 1e-5
                      for i, t in enumerate(temp)])
    np.testing.assert_array_equal(by_radix[~close], by_sort[~close])
    assert len(set(by_radix[temp > 0].tolist())) > 20


def test_radix_path_compiles_without_a_sort_or_a_conditional():
    n, v = 8, 1000
    args = (jnp.zeros((n, v)), jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.full(n, 0.9), jnp.zeros(n, jnp.uint32),
            jnp.zeros(n, jnp.int32))
    for form in FORMS:
        hlo = jax.jit(lambda *a: sample_radix(*a, form=form)).lower(*args).compile().as_text()
        assert "conditional(" not in hlo and " sort(" not in hlo
    hlo_sort = jax.jit(sample).lower(*args).compile().as_text()
    assert " sort(" in hlo_sort                                    # the check would see a sort
