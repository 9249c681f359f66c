"""The offload trace's watcher (nfjax/offload/trace.py): it times programs whose outputs a later program donated,
and a failure to wait on one reaches flush() instead of leaving flush() waiting forever (a CI hang under load:
the watcher fell behind, a GPU-held cache block was donated to the next pass, and its wait raised)."""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import pytest

from nfjax.offload.trace import Trace


def _flush_within(tr: Trace, seconds: float = 30.0):
    err: list = []
    t = threading.Thread(target=lambda: _catch(tr.flush, err), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "flush() did not return"
    return err


def _catch(fn, err):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        err.append(e)


def test_a_donated_output_is_timed_and_flush_returns():
    step = jax.jit(lambda c: c + 1, donate_argnums=0)
    cache = jnp.zeros(8)
    out = step(cache)
    tr = Trace()
    tr.computed("L0 B0", (out, jnp.ones(2)))
    step(out)                                        # the next pass consumes it before the watcher looks
    if not out.is_deleted():
        pytest.skip("this backend did not donate the buffer")
    tr.computed("L0 B1", jnp.ones(3))
    assert _flush_within(tr) == []
    assert [e.label for e in tr.events if e.lane == "compute"] == ["L0 B0", "L0 B1"]
    tr.close()


def test_a_wait_that_fails_reaches_flush_and_the_watcher_goes_on():
    class Broken:
        def block_until_ready(self):
            raise RuntimeError("device lost")

        def is_deleted(self):
            return False

    tr = Trace()
    tr.computed("bad", [Broken()])
    err = _flush_within(tr)
    assert len(err) == 1 and "device lost" in str(err[0])
    tr.error = None
    tr.computed("good", jnp.ones(2))                # the watcher is still alive
    assert _flush_within(tr) == []
    assert [e.label for e in tr.events] == ["bad", "good"]
    tr.close()
