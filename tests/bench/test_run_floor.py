"""bench.run_floor: the weight bytes a step reads, the decodes' KV reads, the tokens each step computed (with and
without `prefill_tokens` in the record) and a run's serial floor, each on small cases worked out by hand."""
from __future__ import annotations

import pytest

from bench.run_floor import decode_kv_bytes, run_floor, step_tokens, weight_bytes
from nfjax.config import ModelConfig

# One layer: attention 4*(4 + 2*2) + 4*4 = 48, MLP 3*4*8 = 96, two norms 8 -> 152 a layer; embedding 10*4 = 40,
# LM head 40 (untied), final norm 4 -> 236 params (196 tied).
CFG = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=2)
# KV a token: 1 layer x 1 kv head x (K + V) x 2 values x 4 bytes (float32, the model's dtype) = 16 bytes.
BPT = 16
# Decodes: request 1 (3 prompt, 3 out) attends over 3+1 and 3+2 = 9 positions; request 2 (2 prompt, 4 out) over
# 2+1, 2+2, 2+3 = 12; 21 in all. Tokens: 6 + 6 = 12; the longest output 4.
WORK = [([1, 2, 3], 3), ([7, 7], 4)]


def test_weight_bytes_leaves_out_the_gathered_embedding_unless_tied():
    assert CFG.num_params() == 236
    assert weight_bytes(CFG) == (236 - 40) * 4
    tied = CFG.replace(tie_word_embeddings=True)
    assert tied.num_params() == 196
    assert weight_bytes(tied) == 196 * 4                 # the table is the LM head: read whole
    assert weight_bytes(tied.replace(dtype="bfloat16")) == 196 * 2


def test_decode_kv_bytes_by_hand():
    assert decode_kv_bytes(WORK, 10.0) == 21 * 10
    assert decode_kv_bytes([([1] * 5, 1)], 10.0) == 0           # one output: its prefill made it
    assert decode_kv_bytes([], 10.0) == 0


def test_step_tokens_with_and_without_prefill_tokens():
    kind = ["decode@16", "prefill@256", "decode+prefill@16"]
    rec = {"kind": kind, "decode_tokens": [4, 0, 2], "prefill_tokens": [0, 100, 14]}
    assert step_tokens(rec) == [4, 100, 16]
    old = {"kind": kind, "decode_tokens": [4, 0, 2]}               # before prefill_tokens: the bucket
    assert step_tokens(old) == [4, 256, 16]


def _per_step(tokens):
    return {"kind": [f"decode@{n}" for n in tokens], "decode_tokens": list(tokens)}


def test_run_floor_weight_read_side():
    """w = 784 B / 784 B/s = 1 s a step; c = 2 x 236 / 1888 FLOP/s = 0.25 s a token. Steps of 1, 4, 8 tokens:
    max(1, 0.25) + max(1, 1) + max(1, 2) = 4 s (the weight read, a tie, the FLOPs); KV 21 x 16 B / 784 B/s."""
    f = run_floor(_per_step([1, 4, 8]), WORK, CFG, "bfloat16", gemm_tflops=1888e-12, copy_bytes_per_s=784.0)
    attn = 21 * BPT / 784
    assert f["weight_read_ms"] == pytest.approx(1e3) and f["gemm_us_per_token"] == pytest.approx(0.25e6)
    assert f["steps_s"] == pytest.approx(4.0) and f["attention_s"] == pytest.approx(attn)
    assert f["floor_s"] == pytest.approx(4.0 + attn)
    assert (f["total_tokens"], f["max_out"], f["steps"]) == (12, 4, 3)
    # any schedule: max(4 decodes x 1 s, 12 tokens x 0.25 s) = 4 s, the weight read side
    assert f["any_schedule_s"] == pytest.approx(4.0 + attn)
    assert f["floor_tok_s"] == pytest.approx(12 / (4.0 + attn))
    assert f["any_schedule_tok_s"] == pytest.approx(12 / (4.0 + attn))


def test_run_floor_flops_side_and_the_kv_format():
    """c = 0.5 s a token: steps max(1, 0.5) + max(1, 2) + max(1, 4) = 7 s; any schedule max(4, 12 x 0.5) = 6 s,
    the FLOPs side. An fp8 cache: 1 byte a value (2 x 2) plus a 16-byte scale row (8 bf16) = 20 B a token."""
    f = run_floor(_per_step([1, 4, 8]), WORK, CFG, "fp8", gemm_tflops=944e-12, copy_bytes_per_s=784.0)
    attn = 21 * 20 / 784
    assert f["steps_s"] == pytest.approx(7.0) and f["attention_s"] == pytest.approx(attn)
    assert f["floor_s"] == pytest.approx(7.0 + attn)
    assert f["any_schedule_s"] == pytest.approx(6.0 + attn)
    assert f["any_schedule_tok_s"] > f["floor_tok_s"]


def test_run_floor_counts_prefill_tokens():
    rec = {"kind": ["prefill@8", "decode+prefill@16"], "decode_tokens": [0, 1], "prefill_tokens": [5, 12]}
    f = run_floor(rec, WORK, CFG, "bfloat16", gemm_tflops=1888e-12, copy_bytes_per_s=784.0)
    assert f["steps_s"] == pytest.approx(max(1, 5 * 0.25) + max(1, 13 * 0.25))


def test_run_floor_none_for_moe():
    moe = CFG.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    assert run_floor(_per_step([1]), WORK, moe, "bfloat16", 1.0, 1.0) is None
