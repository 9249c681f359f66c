"""The serial floor of a measured offline run: the lowest time its own steps could take on this device, so a
headline such as "ShareGPT-512 at 36% of optimal" can be read against what its schedule allows.

Two device ceilings, both measured in the run's process (bench/common.py): the copy bandwidth and the bf16
GEMM rate. Each step reads every weight once, whatever its token count (one GEMM a weight over all the step's
tokens), so a step costs at least max(weight read, its tokens' GEMM FLOPs): a run of many small steps pays the
weight read many times. Each decode also reads its request's KV at the copy rate. The floor is serial: that
KV read is added, not hidden under the GEMMs, since nothing in a step's floor runs beside it.

`any_schedule_s` bounds every schedule of the same requests: the longest request's decodes are one step each
(each a weight read), and all tokens' GEMM FLOPs at the measured rate. It counts every prompt token as
computed, so a run whose prefix cache supplied prompt tokens (their steps record fewer) can have a floor
above it.

Mixture-of-experts models get None: a step's weight read depends on which experts its tokens pick.
Pure functions; nfjax.kv.cache (and with it JAX) is imported only when a floor is computed.
"""
from __future__ import annotations

Work = list[tuple[list[int], int]]           # (prompt token ids, output tokens) per request

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def weight_bytes(cfg) -> float:
    """Bytes of weights one step reads: the active params less the input embedding table, of which a step
    gathers only its tokens' rows, unless it is tied to the LM head (then the head reads all of it)."""
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return float((cfg.num_active_params() - embed) * ITEMSIZE[cfg.dtype])


def decode_kv_bytes(work: Work, kv_bytes_per_token: float) -> float:
    """KV bytes every decode step of `work` reads: a request's first output token comes from its prefill, and
    its decode j (1..out-1) attends over the prompt plus j positions already generated."""
    positions = 0.0
    for prompt, out in work:
        d = max(out - 1, 0)
        positions += d * len(prompt) + d * (d + 1) / 2
    return positions * kv_bytes_per_token


def step_tokens(per_step: dict) -> list[int]:
    """Tokens each step computed. Records from before `prefill_tokens` was kept: a step with a prefill part
    counts its whole bucket (a mixed step fills it), a decode-only step its decode tokens."""
    if "prefill_tokens" in per_step:
        return [d + p for d, p in zip(per_step["decode_tokens"], per_step["prefill_tokens"])]
    return [int(k.rpartition("@")[2]) if "prefill" in k else d
            for k, d in zip(per_step["kind"], per_step["decode_tokens"])]


def run_floor(per_step: dict, work: Work, cfg, kv_dtype: str, gemm_tflops: float,
              copy_bytes_per_s: float) -> dict | None:
    """Seconds of this run's steps each at its floor plus the decodes' KV reads (`floor_s`), and the bound no
    schedule of `work` passes (`any_schedule_s`), with the tok/s each allows. None for a MoE model."""
    if cfg.num_experts > 0:
        return None
    from nfjax.kv.cache import bytes_per_token
    w = weight_bytes(cfg) / copy_bytes_per_s                    # s a step spends reading its weights
    c = 2 * cfg.num_active_params() / (gemm_tflops * 1e12)      # s of GEMM FLOPs per token
    attn = decode_kv_bytes(work, bytes_per_token(cfg, kv_dtype=kv_dtype)) / copy_bytes_per_s
    tokens = step_tokens(per_step)
    steps_s = sum(max(w, n * c) for n in tokens)
    floor_s = steps_s + attn
    max_out = max(o for _, o in work)
    total = sum(len(p) + o for p, o in work)
    any_s = max(max_out * w, total * c) + attn
    return {"floor_s": floor_s, "steps_s": steps_s, "attention_s": attn, "any_schedule_s": any_s,
            "weight_read_ms": w * 1e3, "gemm_us_per_token": c * 1e6, "total_tokens": total, "max_out": max_out,
            "steps": len(tokens), "floor_tok_s": total / floor_s, "any_schedule_tok_s": total / any_s}
