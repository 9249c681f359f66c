"""bench/host_overhead.py drives the real scheduler through whole workloads without a model."""
from __future__ import annotations

from bench.host_overhead import drive


def test_drive_runs_every_request_to_completion_under_memory_pressure():
    roomy = drive("16x8", 24, max_seqs=8, num_pages=4096, page_size=16, buckets=(32, 64))
    # 8 usable pages hold 4 sequences of 16 + 8 tokens at their predicted ends: admission waits for room
    tight = drive("16x8", 24, max_seqs=8, num_pages=9, page_size=16, buckets=(32, 64))
    assert tight["mean_decodes"] <= 4 < roomy["mean_decodes"]
    assert tight["steps"] > roomy["steps"] >= 8          # every request's 8 tokens, fewer at a time when tight
