"""Workloads and model shapes handed from the nfjax side to a peer engine's process, as plain JSON.

The nfjax side writes the exact (prompt token ids, output length) pairs that bench/workloads.py drew and its
engine ran; the peer reads them back and builds its requests from them, so both engines see the same ids and
lengths (nothing is re-drawn). Pure Python: importable without vLLM, torch or JAX.
"""
from __future__ import annotations

import hashlib
import json
import os

Work = list[tuple[list[int], int]]           # (prompt token ids, output tokens) per request

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "opt": "OPTForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def write_workload(path: str, work: Work) -> None:
    """`work` as a JSON list of [ids, output_len]; written to a temporary name, then renamed."""
    doc = [[[int(t) for t in ids], int(n)] for ids, n in work]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)


def read_workload(path: str) -> Work:
    with open(path) as f:
        doc = json.load(f)
    work = []
    for i, item in enumerate(doc):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], list) and item[0]
                and isinstance(item[1], int) and item[1] >= 1):
            raise ValueError(f"{path}: request {i} is not [non-empty token id list, output length >= 1]")
        work.append(([int(t) for t in item[0]], item[1]))
    return work


def digest(work: Work) -> str:
    """sha256 of the ids and lengths (both sides report it: equal digests, equal requests)."""
    h = hashlib.sha256()
    for ids, n in work:
        h.update(json.dumps([list(ids), int(n)], separators=(",", ":")).encode())
    return h.hexdigest()


def stats(work: Work) -> dict:
    return {"requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
            "output_tokens": sum(n for _, n in work), "digest": digest(work)}


def vllm_requests(work: Work) -> list[tuple[dict, int]]:
    """vLLM's token-id prompt dicts and each request's max_tokens, in order."""
    return [({"prompt_token_ids": list(ids)}, int(n)) for ids, n in work]


def requests_work(reqs: list[tuple[dict, int]]) -> Work:
    """The (ids, output length) pairs a list of vLLM requests carries (what the peer actually sends)."""
    return [(list(p["prompt_token_ids"]), n) for p, n in reqs]


def hf_config(model: dict) -> dict:
    """An HF `config.json` dict for an nfjax ModelConfig given as `ModelConfig.to_json()` (what a peer loads
    with dummy weights); `ModelConfig.from_hf` of it gives the same config back."""
    if model["model_type"] == "opt":
        return _opt_hf_config(model)
    cfg = {"architectures": [HF_ARCHITECTURES[model["model_type"]]], "model_type": model["model_type"],
           "vocab_size": model["vocab_size"], "hidden_size": model["hidden_size"],
           "intermediate_size": model["intermediate_size"], "num_hidden_layers": model["num_layers"],
           "num_attention_heads": model["num_heads"], "num_key_value_heads": model["num_kv_heads"],
           "head_dim": model["head_dim"], "rope_theta": model["rope_theta"], "rms_norm_eps": model["rms_norm_eps"],
           "max_position_embeddings": model["max_position_embeddings"], "hidden_act": "silu",
           "attention_bias": model["qkv_bias"], "mlp_bias": False,
           "tie_word_embeddings": model["tie_word_embeddings"], "torch_dtype": model["dtype"],
           "eos_token_id": list(model["eos_token_ids"]), "bos_token_id": model["bos_token_id"], "use_cache": True}
    if model.get("rope_scaling"):
        cfg["rope_scaling"] = dict(model["rope_scaling"])
    if model["model_type"] == "mixtral":        # the experts' width is Mixtral's intermediate_size
        cfg.update(num_local_experts=model["num_experts"], num_experts_per_tok=model["num_experts_per_tok"],
                   intermediate_size=model["moe_intermediate_size"], sliding_window=None, router_jitter_noise=0.0)
        del cfg["attention_bias"], cfg["mlp_bias"]
    elif model["model_type"] == "qwen2_moe":
        cfg.update(num_experts=model["num_experts"], num_experts_per_tok=model["num_experts_per_tok"],
                   moe_intermediate_size=model["moe_intermediate_size"], norm_topk_prob=model["norm_topk_prob"],
                   shared_expert_intermediate_size=model["shared_expert_intermediate_size"],
                   qkv_bias=model["qkv_bias"], decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    return cfg


def _opt_hf_config(model: dict) -> dict:
    """OPT's config.json fields (pre-norm, ReLU, biases, learned positions: what nfjax's OPT runs)."""
    return {"architectures": [HF_ARCHITECTURES["opt"]], "model_type": "opt", "vocab_size": model["vocab_size"],
            "hidden_size": model["hidden_size"], "word_embed_proj_dim": model["hidden_size"],
            "ffn_dim": model["intermediate_size"], "num_hidden_layers": model["num_layers"],
            "num_attention_heads": model["num_heads"], "max_position_embeddings": model["max_position_embeddings"],
            "do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True,
            "layer_norm_elementwise_affine": True, "tie_word_embeddings": model["tie_word_embeddings"],
            "torch_dtype": model["dtype"], "eos_token_id": list(model["eos_token_ids"]),
            "bos_token_id": model["bos_token_id"], "pad_token_id": 1, "use_cache": True}
