"""Top-K sparse attention (policy attention_topk) on the real model: SmolLM2-135M-Instruct (`--model smollm2`),
float32, one window of 256 tokens of bench/data/kv_heldout.txt (held-out prose) through the offload engine's
layer programs. Keeping every score through the Top-K path (99.99%) is dense attention; keeping half of them stays
close (stated tolerance: perplexity within 8%, top-1 agreement with dense >= 88%; measured here 45.13 -> 45.27
and 93.3%, and 2.8% / 93.3% on 4 x 512 tokens, bench/sparse_attention.py). The full K sweep is that bench's."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from nfjax.offload import Policy
from tests.offload.common import need_smollm2

ROOT = Path(__file__).resolve().parents[2]


def test_topk_sparse_attention_accuracy_on_smollm2():
    need_smollm2()
    from nfjax.checkpoint import models
    import jax
    from jax.sharding import SingleDeviceSharding

    from nfjax.checkpoint.orbax_io import load_model
    from nfjax.offload.engine import OffloadEngine
    from nfjax.tokenizer import load_tokenizer
    path = models.resolve("smollm2")
    tok = load_tokenizer(path)
    ids = tok.encode((ROOT / "bench" / "data" / "kv_heldout.txt").read_text(), add_special_tokens=False)[:256]
    host = SingleDeviceSharding(jax.devices("cpu")[0])
    m = load_model(path, dtype="float32", sharding_fn=lambda k, x: host)
    out = {}
    for k in (100.0, 99.99, 50.0):
        with OffloadEngine.from_model(m, tok, Policy(attention_topk=k), max_model_len=256) as eng:
            out[k] = eng.token_logprobs([ids], argmax=True)[0]
    (lp, top), (lp_all, top_all), (lp_half, top_half) = out[100.0], out[99.99], out[50.0]
    ppl = float(np.exp(-lp.mean()))
    assert 10 < ppl < 200, ppl                       # a real model on English prose
    np.testing.assert_allclose(lp_all, lp, atol=1e-4)
    assert (top_all == top).all()
    half = float(np.exp(-lp_half.mean()))
    assert ppl < half <= 1.08 * ppl, (ppl, half)
    assert (top_half == top).mean() >= 0.88
