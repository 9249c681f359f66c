"""Hugging Face mixture-of-experts checkpoints (Mixtral `MixtralForCausalLM`, Qwen2-MoE `Qwen2MoeForCausalLM`):
config.json -> ModelConfig fields, tensor names -> nfjax parameter paths. JAX-free (nfjax.config imports it).

Attention, norms and embeddings carry the Llama names (nfjax/checkpoint/hf_names.py). The MoE block:
  Mixtral    `block_sparse_moe.gate.weight` [E, D] (the router), `block_sparse_moe.experts.{j}.w1/w3/w2.weight`
             (gate, up, down of expert j);
  Qwen2-MoE  `mlp.gate.weight`, `mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`, the shared expert
             `mlp.shared_expert.{gate,up,down}_proj.weight` and its gate `mlp.shared_expert_gate.weight` [1, D].
nfjax stacks the experts of a layer: `layers.experts_gate.kernel` [L, E, D, F] (a Target with an expert index).
(transformers 5 keeps experts fused in memory but `save_pretrained` writes these per-expert names.)
"""
from __future__ import annotations

import re

from nfjax.checkpoint.hf_names import (EMBED, LM_HEAD, Target, _BIASES, _GLOBAL, _LAYER,  # noqa: F401
                                       hf_shape, is_ignored)

_ATTN = {k: v for k, v in _LAYER.items() if not k.startswith("mlp.")}     # attention + norms, Llama's names

_MIXTRAL = {"block_sparse_moe.gate.weight": (("router_proj", "kernel"), True)}
_MIXTRAL_EXPERT = {"w1.weight": ("experts_gate", "kernel"), "w3.weight": ("experts_up", "kernel"),
                   "w2.weight": ("experts_down", "kernel")}
_QWEN = {"mlp.gate.weight": (("router_proj", "kernel"), True),
         "mlp.shared_expert.gate_proj.weight": (("shared_gate_proj", "kernel"), True),
         "mlp.shared_expert.up_proj.weight": (("shared_up_proj", "kernel"), True),
         "mlp.shared_expert.down_proj.weight": (("shared_down_proj", "kernel"), True),
         "mlp.shared_expert_gate.weight": (("shared_expert_gate", "kernel"), True)}
_QWEN_EXPERT = {"gate_proj.weight": ("experts_gate", "kernel"), "up_proj.weight": ("experts_up", "kernel"),
                "down_proj.weight": ("experts_down", "kernel")}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(block_sparse_moe|mlp)\.experts\.(\d+)\.(.+)$")


def parse(name: str) -> Target | None:
    if name in _GLOBAL:
        path, tr = _GLOBAL[name]
        return Target(path, None, tr)
    m = _LAYER_RE.match(name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    for table in (_ATTN, _MIXTRAL, _QWEN):
        if rest in table:
            path, tr = table[rest]
            return Target(("layers",) + path, layer, tr)
    e = _EXPERT_RE.match(rest)
    table = {"block_sparse_moe": _MIXTRAL_EXPERT, "mlp": _QWEN_EXPERT}[e.group(1)] if e else {}
    if e and e.group(3) in table:
        return Target(("layers",) + table[e.group(3)], layer, True, int(e.group(2)))
    return None


def expected_names(cfg) -> list[str]:
    """Every HF tensor of a `cfg` checkpoint (globals, then layer by layer; lm_head left out when tied)."""
    names = [EMBED, "model.norm.weight"] + ([] if cfg.tie_word_embeddings else [LM_HEAD])
    mixtral = cfg.model_type == "mixtral"
    block, experts = ("block_sparse_moe", _MIXTRAL_EXPERT) if mixtral else ("mlp", _QWEN_EXPERT)
    own = list(_MIXTRAL if mixtral else _QWEN)
    for i in range(cfg.num_layers):
        names += [f"model.layers.{i}.{s}" for s in _ATTN if cfg.qkv_bias or s not in _BIASES]
        names += [f"model.layers.{i}.{s}" for s in own]
        names += [f"model.layers.{i}.{block}.experts.{j}.{s}" for j in range(cfg.num_experts) for s in experts]
    return names


def moe_config_fields(hf: dict) -> dict:
    """The MoE fields of ModelConfig (and Qwen2-MoE's qkv bias) from a Mixtral / Qwen2-MoE config.json; a
    routing or layer-layout feature nfjax does not run is a ConfigError naming the field."""
    from nfjax.config import ConfigError
    mt = hf.get("model_type")
    try:
        if mt == "mixtral":
            out = dict(num_experts=int(hf["num_local_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                       moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
        else:
            out = dict(num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                       moe_intermediate_size=int(hf["moe_intermediate_size"]),
                       shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       qkv_bias=bool(hf.get("qkv_bias", hf.get("attention_bias", True))))
    except KeyError as e:
        raise ConfigError(f"config.json: missing field {e.args[0]!r} (model_type {mt})") from None
    if not 0 < out["num_experts_per_tok"] <= out["num_experts"]:
        raise ConfigError(f"config.json: num_experts_per_tok={out['num_experts_per_tok']} must be in [1, "
                          f"{out['num_experts']}] (the number of experts)")
    if mt == "qwen2_moe":
        if int(hf.get("decoder_sparse_step", 1)) != 1:
            raise ConfigError(f"config.json: decoder_sparse_step={hf['decoder_sparse_step']} is not supported "
                              "(nfjax runs every layer as MoE: decoder_sparse_step=1)")
        if hf.get("mlp_only_layers"):
            raise ConfigError(f"config.json: mlp_only_layers={hf['mlp_only_layers']} is not supported (nfjax "
                              "runs every layer as MoE, no dense-MLP layers)")
        if out["shared_expert_intermediate_size"] < 1:
            raise ConfigError("config.json: shared_expert_intermediate_size must be >= 1 (Qwen2-MoE's shared "
                              "expert)")
        if "sliding_attention" in (hf.get("layer_types") or ()):
            raise ConfigError("config.json: layer_types has sliding_attention layers, which are not supported "
                              "(nfjax attends to the full context)")
    return out
