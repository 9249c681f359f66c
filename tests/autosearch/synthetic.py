"""A synthetic profile of the Llama-3-8B layer on an H100, built from a roofline (GEMMs: the larger of 700 TFLOP/s
compute and 2.8 TB/s weight reads; norms and elementwise ops: their bytes at 2.8 TB/s) and, for decode attention,
its shares and the fused kernel's interference, from the measurements in bench/NOTES.md (session 5: 256 decodes at
context 1280 beside the 1792-token gate/up). Not a measurement: it lets the CPU tests check the search's logic on
a device-like cost model."""

TOKENS = [64, 128, 256, 512, 1024, 2048]
D, I, Q, KV = 4096, 14336, 4096, 1024


def _gemm(k, n):
    return [round(max(t * 2 * k * n / 700e9, 2 * k * n / 2.8e9) + 0.006, 6) for t in TOKENS]


def _mem(bytes_per_token):
    return [round(t * bytes_per_token / 2.8e9 + 0.004, 6) for t in TOKENS]


def h100_like(device: str = "h100", model: str = "llama3-8b", tp: int = 1) -> dict:
    from nfjax.autosearch.profile import shape_of
    from nfjax.models.random_init import SHAPES
    return {
        "format": 1, "kind": "nfjax-op-profile", "command": "synthetic (tests/autosearch/synthetic.py)",
        "date": "2026-11-24T00:00:00+00:00", "device": device, "device_name": "synthetic", "num_sms": 132,
        "model": model, "shape": shape_of(SHAPES["llama3-8b"]), "tp": tp, "align": 64, "graph": {},
        "grid": {"tokens": TOKENS, "share_decodes": 256},
        "tokens": {"attn_norm": {"tokens": TOKENS, "ms": _mem(4 * D)},
                   "kqv": {"tokens": TOKENS, "ms": _gemm(D, Q + 2 * KV)},
                   "rope_append": {"tokens": TOKENS, "ms": _mem(4 * (Q + 2 * KV))},
                   "o_proj_op": {"tokens": TOKENS, "ms": _gemm(Q, D)},
                   "attn_reduce": {"tokens": TOKENS, "ms": [0.001] * 6},
                   "ffn_norm": {"tokens": TOKENS, "ms": _mem(8 * D)},
                   "up_gate": {"tokens": TOKENS, "ms": _gemm(D, 2 * I)},
                   "act": {"tokens": TOKENS, "ms": _mem(6 * I)},
                   "down": {"tokens": TOKENS, "ms": _gemm(I, D)},
                   "mlp_reduce": {"tokens": TOKENS, "ms": [0.001] * 6},
                   "residual": {"tokens": TOKENS, "ms": _mem(6 * D)}},
        "decode": {"op": "attn_decode", "ctx": [1280], "decodes": [0, 64, 128, 256, 512],
                   "ms": [[0.01, 0.14, 0.27, 0.51, 1.0]]},
        "prefill": {"op": "attn_prefill", "chunks": [256, 1024, 2048], "starts": [0, 1024],
                    "ms": [[0.02, 0.08, 0.25], [0.04, 0.16, 0.45]], "empty_ms": 0.012},
        "shares": {"attn_decode": {"at": {"size": 256, "ctx": 1280}, "share": [0.2, 0.25, 0.3, 1.0],
                                   "ms": [0.779, 0.656, 0.600, 0.51]},
                   "up_gate": {"at": {"tokens": 1792}, "share": [0.7, 0.75, 0.8, 1.0],
                               "ms": [0.715, 0.649, 0.664, 0.58]}},
        "pairs": [{"kernel": "decode_beside_up_gate", "ops": ["attn_decode", "up_gate"], "sizes": [256, 1792],
                   "share": s, "fused_ms": f, "a_ms": a, "b_ms": b}
                  for s, f, a, b in [(0.2, 0.893, 0.779, 0.664), (0.25, 0.803, 0.656, 0.649),
                                     (0.3, 0.874, 0.600, 0.715)]],
        "pair_min_tokens": {"decode_beside_up_gate": 128},
        "value_bytes": {v: 2 * w for v, w in dict(x=D, h=D, q=Q, k=KV, v=KV, q_rot=Q, attn_d=Q, attn=Q, o_partial=D,
                                                   o=D, x2=D, h2=D, gate=I, up=I, a=I, d_partial=D, d=D,
                                                   out=D).items()},
        "floor_ms": {"tokens": 0.0, "kernels": 0.0},           # roofline times: nothing host-bound
        "copy_bytes_per_ms": 2.9e9, "join_free": ["attn_norm", "rope_append", "ffn_norm", "act", "residual"]}
