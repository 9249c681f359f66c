"""Shared by the TP tests: each prompt's last-token logits through an engine's own (sharded) forward."""
import numpy as np

from nfjax.kv.metadata import build_metadata


def prompt_logits(engine, prompts: list[list[int]], bucket: int) -> np.ndarray:
    """[len(prompts), V]: every prompt prefilled in one `bucket`-token step over fresh pages (page 0 is scratch),
    through `Runner.logits` (cache writes discarded)."""
    cache, max_seqs = engine.config.cache, engine.config.batcher.max_seqs
    seqs, page = [], 1
    for p in prompts:
        n = cache.pages_for(len(p))
        seqs.append((list(range(page, page + n)), 0, len(p)))
        page += n
    toks = np.zeros(bucket, np.int32)
    toks[:sum(map(len, prompts))] = np.concatenate(prompts)
    meta = build_metadata(seqs, bucket, max_seqs, cache.max_pages_per_seq, cache.page_size)
    return np.asarray(engine.runner.logits(toks, meta))[:len(prompts)]
