"""nfjax/pinned_pool.py: XLA's pinned host pool (64 GB by default) is raised from the flags before JAX starts, for
an offload run's host tier and for the prefix cache's host tier; never lowered, a user's value kept, and after
JAX has started nothing changes and it is said."""
from __future__ import annotations

import argparse
import os

import pytest

import nfjax.compat
from nfjax import pinned_pool


@pytest.fixture
def fresh(before_jax_starts):
    before_jax_starts.delenv(pinned_pool.ENV, raising=False)
    return before_jax_starts


def test_an_offload_host_tier_raises_the_cap(fresh):
    assert pinned_pool.for_args(argparse.Namespace(offload="auto", cpu_memory_gb=80.0)) == "90"
    assert os.environ[pinned_pool.ENV] == "90"


def test_the_prefix_cache_host_tier_raises_the_cap_in_gib(fresh):
    assert pinned_pool.for_args(argparse.Namespace(offload=None, host_cache_gb=100.0)) == "121"


def test_small_tiers_keep_the_default_and_nothing_else_sets_it(fresh):
    assert pinned_pool.size_for(40.0) is None
    assert pinned_pool.for_args(argparse.Namespace(command="generate")) is None
    assert pinned_pool.ENV not in os.environ


def test_a_users_value_is_kept(fresh):
    fresh.setenv(pinned_pool.ENV, "33")
    assert pinned_pool.size_for(500.0) == "33"


def test_after_jax_started_it_changes_nothing_and_says_so(fresh):
    fresh.setattr(nfjax.compat, "backends_started", lambda: True)
    said = []
    assert pinned_pool.size_for(200.0, log=said.append) is None
    assert pinned_pool.ENV in said[0] and pinned_pool.ENV not in os.environ


def test_the_offload_cap_defaults_to_the_budgets_share_of_the_machine(fresh):
    import psutil

    from nfjax.offload.budget import GB, HOST_HEADROOM
    got = pinned_pool.for_args(argparse.Namespace(offload="auto", cpu_memory_gb=None))
    want = -(-(HOST_HEADROOM * psutil.virtual_memory().total / GB * pinned_pool.MARGIN + pinned_pool.EXTRA_GB) // 1)
    assert got == (None if want <= pinned_pool.DEFAULT_GB else str(int(want)))
