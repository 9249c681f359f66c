"""One typed config tree: model, cache, batcher, execution, parallel, server. Plain frozen dataclasses, JSON-friendly."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nfjax.errors import UserError


class ConfigError(UserError):
    """A config that nfjax cannot run, with a message naming the offending field."""


def read_json(path: str | Path, error: type[UserError] = ConfigError, what: str = "file") -> Any:
    """The parsed JSON of a file; a missing file or invalid JSON raises `error` naming the file."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise error(f"{p}: no such {what}") from None
    except json.JSONDecodeError as e:
        raise error(f"{p}: not valid JSON ({e})") from None


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling (`rope_type: llama3`); `linear` is also accepted."""
    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "opt", "mixtral", "qwen2_moe")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5        # the norms' epsilon (OPT: its LayerNorms')
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 4096
    model_type: str = "llama"        # "opt": learned positions, LayerNorm, ReLU MLP, biases (nfjax/models/opt.py)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # parameter and activation dtype: float32 | bfloat16
    # Mixture of experts (nfjax/models/moe.py; num_experts 0: the dense MLP of intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0              # top-k experts per token
    moe_intermediate_size: int = 0            # each expert's FFN width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert, gated by sigmoid(h @ w) (0: none)
    norm_topk_prob: bool = True               # the top-k router probabilities renormalised to sum to 1

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts="
                              f"{self.num_experts}] and moe_intermediate_size ({self.moe_intermediate_size}) > 0")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        d, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        if self.model_type == "opt":          # biases everywhere, two LayerNorms, fc1/fc2, learned positions
            layer = 4 * d * d + 4 * d + 2 * d * i + i + d + 4 * d
            head = 0 if self.tie_word_embeddings else d * v
            return self.num_layers * layer + v * d + (self.max_position_embeddings + 2) * d + 2 * d + head
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d
        bias = (self.q_size + 2 * self.kv_size) if self.qkv_bias else 0
        layer = attn + bias + self._mlp_params(self.num_experts) + 2 * d
        head = 0 if self.tie_word_embeddings else d * v
        return self.num_layers * layer + v * d + head + d

    def _mlp_params(self, experts: int) -> int:
        d = self.hidden_size
        if not self.num_experts:
            return 3 * d * self.intermediate_size
        shared = 3 * d * self.shared_expert_intermediate_size + d if self.shared_expert_intermediate_size else 0
        return d * self.num_experts + experts * 3 * d * self.moe_intermediate_size + shared    # router + experts

    def num_active_params(self) -> int:
        """Parameters one token reads: num_params with only its top-k experts of each MoE layer."""
        unused = self._mlp_params(self.num_experts) - self._mlp_params(self.num_experts_per_tok)
        return self.num_params() - self.num_layers * unused if self.num_experts else self.num_params()

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- HF interop -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, src: str | Path | dict) -> "ModelConfig":
        """Build from an HF `config.json` (a path to the file, its folder, or the parsed dict)."""
        if not isinstance(src, dict):
            p = Path(src)
            src = read_json(p / "config.json" if p.is_dir() else p)
        hf = src
        mt = hf.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"config.json: unsupported model_type {mt!r}; nfjax supports "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        if mt == "opt":
            from nfjax.checkpoint.opt_names import opt_config_fields
            return cls(**opt_config_fields(hf))
        moe = {}
        if mt in ("mixtral", "qwen2_moe"):
            from nfjax.checkpoint.moe_names import moe_config_fields
            moe = moe_config_fields(hf)
        try:
            d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
            kw = dict(vocab_size=int(hf["vocab_size"]), hidden_size=d,
                      intermediate_size=int(hf["intermediate_size"]),
                      num_layers=int(hf["num_hidden_layers"]), num_heads=h)
        except KeyError as e:
            raise ConfigError(f"config.json: missing field {e.args[0]!r}") from None
        if mt in ("mistral", "mixtral") and hf.get("sliding_window") not in (None, 0):
            if hf["sliding_window"] < hf.get("max_position_embeddings", 0):
                raise ConfigError(f"config.json: sliding_window={hf['sliding_window']} is not supported yet "
                                  "(nfjax attends to the full context); set it to null to run full attention")
        if mt in ("qwen2", "qwen2_moe") and hf.get("use_sliding_window"):
            raise ConfigError("config.json: use_sliding_window=true is not supported yet")
        for flag in ("mlp_bias",) + (("attention_bias",) if mt not in ("qwen2", "qwen2_moe") else ()):
            if hf.get(flag):
                raise ConfigError(f"config.json: {flag}=true is not supported (o_proj/MLP biases)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = "bfloat16" if hf.get("torch_dtype", hf.get("dtype")) == "bfloat16" else "float32"
        return cls(**{**dict(
            **kw,
            num_kv_heads=int(hf.get("num_key_value_heads") or h),
            head_dim=int(hf.get("head_dim") or d // h),
            rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling_from_hf(hf),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", mt == "qwen2")),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            model_type=mt, bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids, dtype=dtype), **moe})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def _rope_scaling_from_hf(hf: dict) -> RopeScaling | None:
    rs = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind == "llama3":
        return RopeScaling("llama3", float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
                           float(rs.get("high_freq_factor", 4.0)),
                           int(rs.get("original_max_position_embeddings", 8192)))
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported (llama3, linear)")


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages of `page_size` positions that hold `num_tokens` positions: the one rule (`CacheConfig.pages_for`)."""
    return -(-num_tokens // page_size)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int | None = None           # device KV pages, page 0 a scratch page (None: what fits, see below)
    max_pages_per_seq: int | None = None   # page-table width (None: the model's context, see max_model_len)
    max_model_len: int | None = None       # longest sequence, prompt + output (None: the model's maximum)
    kv_memory_fraction: float | None = None    # automatic num_pages: this share of device memory left after the
                                               # weights (None: by model, nfjax/device_memory.py: 0.9, MoE 0.97)
    kv_dtype: str = "bfloat16"             # bfloat16 (model dtype) | fp8 | int8 | int4 | kivi64 | fp8r (kv_quant.py)
    prefix_cache: bool = True              # reuse cached full pages of equal prefixes (nfjax/kv/allocator.py)
    host_cache_gb: float = 0.0             # host-memory tier for pages evicted from the GPU prefix cache (0: none)
    disk_cache_dir: str | None = None      # disk tier below the host tier (nfjax/kv/tiers.py; None: none)
    disk_cache_gb: float = 0.0             # the disk tier's size

    def __post_init__(self):
        from pallas_kernels.kv_quant import ALL_KV_DTYPES, KV_DTYPES, has_tail
        if self.kv_dtype not in ALL_KV_DTYPES:
            raise ConfigError(f"cache.kv_dtype (--kv-dtype) {self.kv_dtype!r} is not a KV format; choices: "
                              f"{', '.join(KV_DTYPES)}")
        if has_tail(self.kv_dtype) and self.page_size != 64:
            raise ConfigError(f"--kv-dtype {self.kv_dtype} needs pages of 64 positions (a page is one of its K "
                              f"groups): cache.page_size (--page-size) is {self.page_size}; choices: "
                              f"{', '.join(KV_DTYPES)}")
        for f in ("page_size", "num_pages", "max_pages_per_seq", "max_model_len"):
            v = getattr(self, f)
            if v is not None and v < (2 if f == "num_pages" else 1):
                raise ConfigError(f"cache.{f} must be >= {2 if f == 'num_pages' else 1}, got {v}")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ConfigError(f"cache.kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        for f in ("host_cache_gb", "disk_cache_gb"):
            if getattr(self, f) < 0:
                raise ConfigError(f"cache.{f} must be >= 0, got {getattr(self, f)}")
        if (self.host_cache_gb or self.disk_cache_dir) and not self.prefix_cache:
            raise ConfigError("cache.host_cache_gb / disk_cache_dir (--host-cache-gb, --disk-cache-dir) hold the "
                              "prefix cache's evicted pages: they need the prefix cache (drop --no-prefix-cache)")
        if bool(self.disk_cache_dir) != (self.disk_cache_gb > 0):
            raise ConfigError("cache.disk_cache_dir and cache.disk_cache_gb (--disk-cache-dir, --disk-cache-gb) "
                              "go together")

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` positions."""
        return pages_for(num_tokens, self.page_size)


PREFILL_TOKENS_PER_CHUNK = 128     # the prefill bucket's chunk cap: one chunk per this many of its tokens


@dataclass(frozen=True)
class BatcherConfig:
    token_buckets: tuple[int, ...] | None = None  # dense token budgets, one compiled step each (None: by device)
    max_seqs: int | None = None                   # sequences per step (None: sized from the buckets and KV pages)
    max_prefill_seqs: int = 16                    # prefill chunks per step (bounds the prefill kernel's tiles)
    predict_memory: bool = True                   # NanoFlow admission control; off = admit while pages are free
    # tokens of a step that holds no decode: a burst of prompts with nothing decoding beside them is prefilled in
    # one step (docs/design.md section 19). None: by device (8192 on GPU, none on CPU); 0: none
    prefill_bucket: int | None = None

    def __post_init__(self):
        if self.token_buckets is not None:
            b = tuple(sorted({int(x) for x in self.token_buckets}))
            if not b or b[0] < 1:
                raise ConfigError(f"batcher.token_buckets must be positive integers, got {self.token_buckets}")
            object.__setattr__(self, "token_buckets", b)
        for f in ("max_seqs", "max_prefill_seqs"):
            v = getattr(self, f)
            if v is not None and v < 1:
                raise ConfigError(f"batcher.{f} must be >= 1, got {v}")
        pb = self.prefill_bucket
        if pb is not None and (pb < 0 or (pb and self.token_buckets is not None and pb <= self.token_buckets[-1])):
            raise ConfigError(f"batcher.prefill_bucket must be 0 (none) or above the largest token bucket "
                              f"({self.token_buckets[-1] if self.token_buckets else '?'}), got {pb}")

    def seqs_for(self, bucket: int) -> int:
        """Sequence rows of a step compiled for `bucket` tokens: each sequence brings at least one token."""
        return min(self.max_seqs, bucket)

    @property
    def all_buckets(self) -> tuple[int, ...]:
        """Every compiled bucket: the token buckets, then the prefill bucket if any (after `resolve`)."""
        return self.token_buckets + ((self.prefill_bucket,) if self.prefill_bucket else ())

    def formation_budget(self, bucket: int) -> int:
        """The token budget whose limits a step that runs in `bucket` keeps: the prefill bucket's own, else the
        largest token bucket's (after `resolve`). A step formed under the prefill bucket's budget runs in a token
        bucket only within that bucket's limits (`BucketFit._fit_bucket`)."""
        return bucket if self.prefill_bucket and bucket == self.prefill_bucket else self.token_buckets[-1]

    def prefill_seqs_for(self, bucket: int) -> int:
        """Prefill chunks a step of `bucket` tokens may hold: `max_prefill_seqs`, or in the prefill bucket one per
        PREFILL_TOKENS_PER_CHUNK of it (a burst of short prompts fills it)."""
        if self.prefill_bucket and bucket == self.prefill_bucket:
            return max(self.max_prefill_seqs, bucket // PREFILL_TOKENS_PER_CHUNK)
        return self.max_prefill_seqs


def prefill_copy_pages(config: "EngineConfig", budget: int) -> int:
    """KV pages the prefill rows of one step may read when the step is formed under a token `budget` (the largest
    token bucket, or the prefill bucket): the size of `execution.prefill_dequant_first`'s bfloat16 copy, and the
    batcher's limit on the sum over a step's prefill rows of the pages up to each chunk's end; 0 where there is no
    copy (the option off, or a cache the kernels read as it is). fp8r (`V_TAIL_FORMATS`) always reads its prefill
    through the copy (its tail rows spliced in, nfjax/kv/tail_attention.py). One sequence's whole table fits, so
    every chunk can be scheduled alone; the rest is room for the budget's other chunks. After `resolve`."""
    from pallas_kernels._kv_dequant import QUANT_KERNEL_FORMATS
    from pallas_kernels.kv_quant import V_TAIL_FORMATS
    cache, sched = config.cache, config.batcher
    if not ((config.execution.prefill_dequant_first and cache.kv_dtype in QUANT_KERNEL_FORMATS)
            or cache.kv_dtype in V_TAIL_FORMATS):
        return 0
    return cache.max_pages_per_seq + pages_for(budget, cache.page_size) + sched.prefill_seqs_for(budget)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000                  # 0 = any free port (the server prints the address it bound)
    max_queue: int = 256              # requests waiting for a batch slot; more -> HTTP 429
    served_model_name: str | None = None   # None: the checkpoint folder's name ("nfjax-tiny" for the default)
    max_body_bytes: int = 8 << 20     # larger request bodies -> HTTP 413
    shutdown_timeout_s: float = 30.0  # SIGTERM: in-flight requests may finish this long, then are aborted
    log_level: str = "info"
    request_timeout_s: float = 15.0   # a request body not fully received this long after its headers -> HTTP 408

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.shutdown_timeout_s < 0:
            raise ConfigError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1          # tensor-parallel degree (devices on the `tp` mesh axis)
    # BENCHMARK ONLY: compile the steps without the row-parallel all-reduces. Every token is wrong; the step
    # times show what the collectives cost (bench/tp.py). Never set it for serving.
    skip_collectives: bool = False


# The names of nfjax.schedule.strategies.STRATEGIES (kind -> class), kept here so the config imports no JAX code;
# tests/schedule/test_api.py checks that the two agree.
STRATEGY_KINDS = ("sequential", "nanobatch", "comm_overlap", "dual_batch", "fused_reduce_norm", "nanoflow")


@dataclass(frozen=True)
class StrategyConfig:
    """One precompiled step variant (see nfjax/schedule/strategies.py for the kinds)."""
    kind: str = "sequential"
    split: tuple[float, ...] = (1, 1)   # relative nano-batch sizes (not for nanoflow: its plan sets them)
    align: int = 8                      # nano-batch boundaries on multiples of this many tokens
    plan: str | None = None             # nanoflow: a plan file, or the name of a plan shipped in nfjax/plans/
    min_bucket: int = 0                 # compiled only for token buckets >= this
    min_tokens: int = 0                 # chosen only for batches with at least this many real tokens
    min_decode: int = 0                 # ... and at least this many decode tokens
    name: str | None = None             # label in stats and `Runner.pin_strategy` (default: derived)

    def __post_init__(self):
        if self.kind not in STRATEGY_KINDS:
            raise ConfigError(f"execution.strategies: kind must be one of {', '.join(STRATEGY_KINDS)}, "
                              f"got {self.kind!r}")
        if (self.plan is None) == (self.kind == "nanoflow"):
            raise ConfigError(f"execution.strategies[{self.label}]: plan is required for kind nanoflow and only "
                              "for it")
        if not self.split or any(w <= 0 for w in self.split):
            raise ConfigError(f"execution.strategies[{self.label}]: split weights must be positive, got {self.split}")
        if self.kind == "dual_batch" and len(self.split) != 2:
            raise ConfigError(f"execution.strategies[{self.label}]: dual_batch needs a split of 2, got {self.split}")
        for f in ("align",):
            if getattr(self, f) < 1:
                raise ConfigError(f"execution.strategies[{self.label}]: {f} must be >= 1")
        for f in ("min_bucket", "min_tokens", "min_decode"):
            if getattr(self, f) < 0:
                raise ConfigError(f"execution.strategies[{self.label}]: {f} must be >= 0")

    @classmethod
    def from_spec(cls, spec: str, **kw) -> "StrategyConfig":
        """A variant from its label syntax: "sequential", "<kind>:<split>" (e.g. "dual_batch:1-1") or
        "nanoflow:<plan name or path>"; `kw` sets the other fields."""
        kind, _, arg = spec.strip().partition(":")
        if kind == "nanoflow":
            return cls(kind, plan=arg or None, **kw)
        if not arg:
            return cls(kind, **kw)
        try:
            split = tuple(float(w) for w in arg.split("-"))
        except ValueError:
            raise ConfigError(f"strategy {spec!r}: the split after ':' must be weights like 1-1, got {arg!r}") from None
        return cls(kind, split=split, **kw)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.kind == "sequential":
            return "sequential"
        if self.kind == "nanoflow":
            return f"nanoflow:{Path(str(self.plan)).stem}"
        return f"{self.kind}:" + "-".join(f"{w:g}" for w in self.split)


@dataclass(frozen=True)
class ExecutionConfig:
    """How a step's layers run: variants compiled per bucket, chosen per batch (first eligible in order;
    `sequential` is always compiled as the fallback)."""
    strategies: tuple[StrategyConfig, ...] = ()
    layers_per_program: int = 4         # decoder layers per compiled program (a step launches L / this of them)
    command_buffers: bool = True        # XLA's CUDA-graph command buffers (False: plain kernel launches)
    # Copy each step's inputs into the same device buffers before the step's programs read them: a command
    # buffer whose buffers moved is re-recorded before it launches (+0.3 ms a 4-layer program, docs/design.md s3)
    stable_inputs: bool = True
    # JAX's persistent compilation cache (a folder): a later engine of the same model and settings loads its
    # compiled programs instead of compiling them (8B on an H200: ready in 16 s against 53 s). Process-wide.
    compile_cache_dir: str | None = None
    # Each layer's q/k/v and gate/up weights joined into one weight each when the Runner loads them: one plain
    # GEMM apiece (docs/design.md section 17). False: the checkpoint's separate weights (A/B measurement).
    join_projections: bool = True
    # The joined gate/up weight's gate and up columns interleaved for the persistent Pallas GEMM's SwiGLU epilogue
    # (GPU, 16-bit weights; steps of at least `models.dense.SWIGLU_EPILOGUE_MIN_ROWS` tokens): no [T, 2F] array is
    # written and read back (docs/design.md section 20). False: XLA's dot and a separate SwiGLU (A/B measurement).
    swiglu_epilogue: bool = True
    # XLA's rematerialization pass, off by default: it misreads the in-place KV pool as twice its size and recomputes
    # what it can to fit (nfjax/compat.py NO_REMAT; neutral end to end). True: XLA's default pipeline (A/B).
    xla_remat: bool = False
    # Lower each Pallas kernel once a process and reuse it in every program that calls it the same way
    # (pallas_kernels/_lowering_cache.py): 2-2.6x less lowering on the CPU host, but on the H200 builds no faster
    # beyond their spread (int4 122 -> 115.5 s, fp8 62.9 -> 73.3 s; docs/design.md section 1), so off.
    kernel_lowering_cache: bool = False
    # On a quantized KV cache (fp8 / int8 / int4), a step's prefill attention first dequantizes the pages its
    # prefill rows read into a bfloat16 copy (static size `prefill_copy_pages`; the batcher keeps each step's rows
    # within it) and runs the bfloat16 prefill kernel over the copy, in place of the kernel dequantizing every block
    # once per 32-token query tile. H200: 1.36-1.85x at kernel level, +0.3-1.5% end to end at 1024/512, so off
    # (docs/design.md section 14): the copy is its whole static size in every layer of every step with a prefill
    # row, however few pages are live: ~16 MB of bfloat16 a layer for an 8B model at a
    # 1,536-token context, ~0.55 GB at 128k (one sequence's whole table is in it), and it is not in the KV sizing.
    prefill_dequant_first: bool = False
    # On an int4 cache (V stored Hadamard-rotated), the rotation folded into o_proj's weight at load instead of
    # rotating attention's rows back every layer of every step (nfjax/models/rotation_fold.py, which says why not
    # kivi64; docs/design.md section 14). False: the per-step rotation (A/B measurement).
    fold_v_rotation: bool = True

    def __post_init__(self):
        labels = [s.label for s in self.strategies]
        dup = next((x for x in labels if labels.count(x) > 1), None)
        if dup:
            raise ConfigError(f"execution.strategies: two variants are labelled {dup!r}; set name= on one")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
