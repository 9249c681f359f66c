"""Every step program run once at start, on batches that hold no sequence.

A compiled program's first launch costs more than the later ones: XLA records and instantiates its command
buffers (CUDA graphs) then, and the runtime loads its kernels. Without a warm-up the first request to land in each
token bucket paid that inside its step (an 8B engine on an H100: TTFT 25-49 ms for the first lone 128-token prompt
after a warm-up that used other buckets, against ~11 ms once warm; docs/design.md section 18).
The batches are all padding, so nothing reaches the KV cache (padding writes nothing: docs/design.md section 9),
the penalty state (its rows name no slot) or the previous samples (restored afterwards).
"""
from __future__ import annotations

import time

import jax

from nfjax.engine.step_input import pack
from nfjax.engine.step_programs import HEAD_MODES


def warm_up(runner) -> float:
    """Run each bucket's embed, every layer program of every variant (with and without the prefill kernel), every
    head and the full head once; returns the seconds it took."""
    t0 = time.perf_counter()
    rest, prev = runner._rest_leaves, runner._prev
    for b in sorted(runner._embed):
        inp = runner.put_input(b, runner.empty_input(b))
        full = jax.device_put(pack(runner._full_like(b)), runner.replicated)
        labels = sorted({k[1] for k in runner._steps if k[0] == b})
        x = None
        for label in labels:
            for decode_only in (False, True) if (b, label) in runner._decode_steps else (False,):
                x = runner._embed[b](rest, prev, inp)
                for i0, n, prog in runner.layer_programs(b, label, decode_only):
                    x, runner.kv = prog(runner.group_args(i0, n), runner.kv, x, inp.meta, runner._layer_ids[i0])
        for mode in HEAD_MODES:
            runner._head[(b, mode)](rest, x, inp)
        if b in runner._full_head:                  # none in the prefill bucket
            _, _, runner.penalty_state = runner._full_head[b](rest, x, inp, full, runner.penalty_state)
    runner._prev = prev
    jax.block_until_ready((runner.kv, runner.penalty_state))
    return time.perf_counter() - t0
