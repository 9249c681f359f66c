"""Device time from a profiler trace (nfjax/device_trace.py): calls told apart at the largest idle gaps, each
call's span (first kernel's start to last one's end) and busy time (the union of its kernels' intervals); no GPU
events is an error, not a time."""
import jax
import jax.numpy as jnp
import pytest

from nfjax.device_trace import call_busy_ns, call_spans_ns, device_times


def test_calls_are_split_at_the_largest_gaps():
    # three calls of two kernels each, 1 ns between a call's kernels, 100+ ns between calls
    ev = [(0, 10), (11, 20), (200, 210), (211, 215), (400, 405), (406, 430)]
    assert call_spans_ns(ev, 3) == [20, 15, 30]


def test_overlapping_kernels_count_once_and_idle_inside_a_call_counts():
    # kernels of one call overlap (two streams); the idle gap inside a call is part of its span
    ev = [(0, 50), (10, 30), (60, 70), (1000, 1010)]
    assert call_spans_ns(ev, 2) == [70, 10]
    # busy: the union of the intervals, without the idle 50..60 inside the first call
    assert call_busy_ns(ev, 2) == [60, 10]


def test_fewer_events_than_calls_and_no_events():
    assert call_spans_ns([(5, 9)], 3) == [4] and call_busy_ns([(5, 9)], 3) == [4]
    assert call_spans_ns([], 3) == [] and call_busy_ns([], 3) == []


def test_a_trace_without_gpu_events_is_an_error():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU trace has device events")
    f = jax.jit(lambda x: x * 2)
    x = jnp.ones((8,))
    with pytest.raises(RuntimeError, match="no GPU events|no device trace"):
        device_times(lambda: f(x), calls=2)
