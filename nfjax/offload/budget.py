"""What a policy needs in each tier, checked against the caps before anything is loaded.

  gpu:  weights the policy keeps there; the embedding, positions, final norm and head (always there); the
        off-GPU weights of up to three layers in flight (loading, ready, computing), plus one layer decompressed;
        the KV blocks kept there and two loaded ones (the one computing and the next); the activations kept
        there; and the working buffers of one prefill computation (attention scores in float32, the MLP's
        intermediate, the block's logits): an estimate, stated as such in the error.
  cpu:  the weights, KV blocks and activations the policy puts in host memory.
  disk: the same on disk.
The KV cache is sized for `max_len` positions a sequence (the engine's context), activations for a prefill of
`max_len` tokens.
"""
from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nfjax.config import ModelConfig
from nfjax.offload.compress import compressible, packed_bytes
from nfjax.offload.policy import Policy, PolicyError
from nfjax.offload.store import index_tiers, kv_tiers, weight_tiers
from pallas_kernels import kv_quant

GB = 1e9
# Without a cpu_memory_gb cap, a policy may plan this share of the host's available memory: the process holds more
# than the tiers' bytes (on the H100 host, OPT-30B, session 20: peak RSS 100.8 GB with 80.7 GB in the host tier,
# 120.0 GB with 83.2 GB and CPU attention; two runs planned at 107 GB of a 128 GiB host were killed for memory).
# Session 21 (docs/design.md section 11): XLA's pinned host pool had grown to its 64 GiB default limit (RssShmem 69.8 GB
# for 59.2 GB of pinned weights), ~6 GB of the process is the runtime's own, and CPU attention's threads held
# ~16 GB more.
HOST_HEADROOM = 0.7
CAP_FIELDS = {"gpu": "gpu_memory_gb", "cpu": "cpu_memory_gb", "disk": "disk_gb"}


@dataclass(frozen=True)
class Need:
    tier: str
    what: str
    bytes: int


@functools.lru_cache(maxsize=32)          # the cost model and the policy search ask for it many times
def layer_shapes(cfg: ModelConfig) -> tuple[list[str], list[tuple[int, ...]]]:
    """Names and shapes of one decoder layer's weights, in the pytree order the stores use."""
    import jax
    from flax import nnx

    from nfjax.checkpoint.orbax_io import abstract_model
    from nfjax.engine.step_programs import split_layers
    _, _, _, stacked = split_layers(abstract_model(cfg.replace(num_layers=1)))
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(stacked))[0]
    return (["/".join(str(getattr(k, "key", k)) for k in p) for p, _ in flat],
            [tuple(x.shape[1:]) for _, x in flat])


def needs(cfg: ModelConfig, policy: Policy, max_len: int) -> list[Need]:
    item = 2 if cfg.dtype == "bfloat16" else 4
    _, shapes = layer_shapes(cfg)
    sizes = [int(np.prod(s)) * item for s in shapes]
    tiers = weight_tiers(sizes, policy.weights)
    stored = [packed_bytes(s) if policy.compress_weights and t != "gpu" and compressible(s) else n
              for s, t, n in zip(shapes, tiers, sizes)]
    out: list[Need] = []
    L, bs, nb = cfg.num_layers, policy.gpu_batch_size, policy.num_gpu_batches
    d, v = cfg.hidden_size, cfg.vocab_size
    for t in ("gpu", "cpu", "disk"):
        w = L * sum(n for n, tt in zip(stored, tiers) if tt == t)
        if w:
            out.append(Need(t, f"weights ({t} share)", w))
    rest = (v * d * (1 if cfg.tie_word_embeddings else 2) + 2 * d
            + (cfg.max_position_embeddings + 2) * d * (cfg.model_type == "opt")) * item
    out.append(Need("gpu", "embedding, final norm and head", rest))
    off = sum(n for n, tt in zip(stored, tiers) if tt != "gpu")
    if off:
        out.append(Need("gpu", "3 layers of off-GPU weights in flight + 1 decompressed",
                        3 * off + sum(n for n, tt in zip(sizes, tiers) if tt != "gpu")))
    kv_block = bs * max_len * cfg.num_kv_heads * (
        kv_quant.token_head_bytes("int4", cfg.head_dim, None) if policy.compress_cache else 2 * cfg.head_dim * item)
    kv_where = kv_tiers(L, nb, policy.cache)
    for t in ("gpu", "cpu", "disk"):
        n = kv_where.count(t)
        if n:
            out.append(Need(t, f"KV cache ({n} of {L * nb} layer x batch blocks)", n * kv_block))
    if any(t != "gpu" for t in kv_where):
        out.append(Need("gpu", "2 KV blocks loaded", 2 * kv_block))
    act = bs * max_len * d * item
    for t in ("gpu", "cpu", "disk"):
        n = index_tiers(nb, policy.activations).count(t)
        if n:
            out.append(Need(t, f"activations ({n} of {nb} batches)", n * act))
    work = (bs * cfg.num_heads * max_len * max_len * 4 + 2 * bs * max_len * cfg.intermediate_size * item
            + 3 * bs * max_len * d * 4 + bs * nb * v * 4)
    out.append(Need("gpu", "working buffers of a prefill (estimate)", work))
    return out


def caps(policy: Policy, device=None, offload_dir: Path | None = None) -> dict[str, float | None]:
    """Bytes each tier may use: the policy's caps, else what the machine has (host memory: `HOST_HEADROOM` of what
    is available; None: no statistics)."""
    out: dict[str, float | None] = {}
    for t, f in CAP_FIELDS.items():
        v = getattr(policy, f)
        out[t] = None if v is None else v * GB
    if out["gpu"] is None and device is not None:
        stats = device.memory_stats() or {}
        out["gpu"] = stats.get("bytes_limit") if device.platform != "cpu" else None
    if out["cpu"] is None:
        import psutil
        out["cpu"] = HOST_HEADROOM * float(psutil.virtual_memory().available)
    if out["disk"] is None and offload_dir is not None and policy.uses_disk():
        p = Path(offload_dir)
        while not p.exists():
            p = p.parent
        out["disk"] = float(shutil.disk_usage(p).free)
    return out


def check_model(cfg: ModelConfig) -> None:
    """FlexGen mode runs the dense layer's ops (nfjax/offload/compute.py): a MoE model is a PolicyError."""
    if cfg.num_experts:
        raise PolicyError(f"--offload: mixture-of-experts models (model_type {cfg.model_type}, num_experts="
                          f"{cfg.num_experts}) are not supported in FlexGen mode; run them without --offload")


def check(cfg: ModelConfig, policy: Policy, max_len: int, limits: dict[str, float | None]) -> dict[str, int]:
    """Bytes per tier; a tier over its cap is a PolicyError naming the cap's field and what fills the tier."""
    check_model(cfg)
    if policy.compress_cache and cfg.head_dim % kv_quant.GROUP:
        raise PolicyError(f"policy compress_cache: the int4 KV format groups head_dim in {kv_quant.GROUP}s; "
                          f"this model's head_dim is {cfg.head_dim}")
    ns = needs(cfg, policy, max_len)
    total = {t: sum(n.bytes for n in ns if n.tier == t) for t in CAP_FIELDS}
    for t, f in CAP_FIELDS.items():
        cap = limits.get(t)
        if cap is not None and total[t] > cap:
            parts = "; ".join(f"{n.what} {n.bytes / GB:.3f}" for n in ns if n.tier == t)
            src = f"{f}={getattr(policy, f):g}" if getattr(policy, f) is not None else f"{f} unset: the machine's "
            raise PolicyError(f"policy: the {t} tier needs {total[t] / GB:.3f} GB but has {cap / GB:.3f} GB ({src}"
                              f"{'free space' if getattr(policy, f) is None else ''}); in GB: {parts}. Move a "
                              f"share of weights/cache/activations off the {t} tier, shrink gpu_batch_size or "
                              f"num_gpu_batches, or raise {f}")
    return total


def host_cap_gb(cpu_memory_gb: float | None) -> float:
    """The host tier's cap in GB: `cpu_memory_gb`, else `HOST_HEADROOM` of the machine's memory (what the pinned
    pool is sized for: nfjax/pinned_pool.py)."""
    if cpu_memory_gb is not None:
        return cpu_memory_gb
    import psutil
    return HOST_HEADROOM * psutil.virtual_memory().total / GB
