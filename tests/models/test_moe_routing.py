"""The MoE token layout (nfjax/models/moe_routing.py) against a per-token loop in numpy: sorting by expert with
per-expert padding (align 1 on the CPU path, the GPU kernel's 128 and others), the grouped GEMM over the sorted
rows, and the weighted un-sort give sum_j w[t, j] * h[t] @ W[e[t, j]] for every token."""
import jax.numpy as jnp
import numpy as np
import pytest

from nfjax.models.moe_routing import layout_rows, sort_by_expert, top_k_routing, unsort
from pallas_kernels.grouped_gemm_ref import grouped_gemm_ref


@pytest.mark.parametrize("t,k,e,align", [(37, 2, 4, 1), (37, 2, 4, 8), (5, 3, 6, 128), (64, 1, 8, 16)])
def test_layout_and_unsort_match_a_token_loop(t, k, e, align):
    rng = np.random.default_rng(t * 100 + align)
    h = rng.standard_normal((t, 12)).astype(np.float32)
    w_e = rng.standard_normal((e, 12, 7)).astype(np.float32)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    logits[:, e - 1] -= 50.0                                # the last expert gets no tokens: an empty group
    weights, experts = top_k_routing(jnp.asarray(logits), k, normalize=(k > 1))
    xs, sizes, dest = sort_by_expert(jnp.asarray(h), experts, e, align)
    rows = layout_rows(t, k, e, align)
    assert xs.shape == (rows, 12) and rows % align == 0
    sizes = np.asarray(sizes)
    counts = np.bincount(np.asarray(experts).reshape(-1), minlength=e)
    assert (sizes % align == 0).all() and (sizes >= counts).all() and (sizes - counts < align).all()
    assert sizes[e - 1] == 0 and sizes.sum() <= rows
    d = np.asarray(dest)
    assert len(set(d.reshape(-1).tolist())) == t * k                      # every assignment its own row
    starts = np.cumsum(sizes) - sizes
    ex = np.asarray(experts)
    assert ((d >= starts[ex]) & (d < starts[ex] + sizes[ex])).all()      # ... inside its expert's group
    np.testing.assert_array_equal(np.asarray(xs)[d], np.repeat(h[:, None], k, axis=1))

    y = np.asarray(unsort(grouped_gemm_ref(xs, jnp.asarray(w_e), jnp.asarray(sizes)), dest, weights))
    want = np.zeros((t, 7), np.float32)
    for i in range(t):
        for j in range(k):
            want[i] += float(weights[i, j]) * (h[i] @ w_e[int(experts[i, j])])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_top_k_routing():
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0]])
    p = np.exp([0.0, 2.0, 1.0, -1.0]) / np.exp([0.0, 2.0, 1.0, -1.0]).sum()
    w, e = top_k_routing(logits, 2, normalize=False)
    assert e.tolist() == [[1, 2]]
    np.testing.assert_allclose(np.asarray(w), [[p[1], p[2]]], rtol=1e-6)
    w, _ = top_k_routing(logits, 2, normalize=True)
    np.testing.assert_allclose(np.asarray(w), [[p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])]], rtol=1e-6)
