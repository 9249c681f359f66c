"""One way to build an engine: flags (CLI) or a JSON file -> `EngineConfig` -> `Engine`.

Every entry point (`nfjax generate`, `nfjax serve`, `Engine.from_pretrained`, the benches) goes through here, so
a flag means the same thing everywhere. Settings left unset (None) are sized here, in one place, once the
weights sit on the device (`resolve`): the KV pages from free device memory, the page-table width from the
context length, the token buckets by device, and the sequences per step from the buckets and the pages.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from nfjax.config import (BatcherConfig, CacheConfig, ConfigError, EngineConfig, ExecutionConfig, ModelConfig,
                          ParallelConfig, StrategyConfig, read_json)
from nfjax.device_memory import KV_MEMORY_FRACTION, is_moe, kv_memory_fraction
from pallas_kernels.kv_kivi64 import GROUP as TAIL_GROUP
from pallas_kernels.kv_quant import KV_DTYPES, has_tail

SECTIONS: dict[str, type] = {"cache": CacheConfig, "batcher": BatcherConfig, "execution": ExecutionConfig,
                             "parallel": ParallelConfig}
# Token budgets compiled when none are given. A GPU step's cost follows its padded token count, so decode
# batches get buckets close to their size: an 8B decode step of 32 sequences takes 9.8 ms in a 32-token
# bucket where one sequence takes 7.8 ms in a 1-token one (H100, bench/results/profile_step-20261124.json),
# and the long tail of a ShareGPT-shaped run is such steps.
GPU_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 1024, 2048)
# On a CPU a step costs what its padded tokens cost: one stream decodes at 18.7 ms a token in a 1-token bucket
# against 82 ms in a 64-token one (the tiny model, 2 cores).
CPU_BUCKETS = (1, 16, 256)
# A step with no decode may take this many prompt tokens on a GPU: a burst of prompts arriving with nothing
# decoding is prefilled in one step instead of four, so its first requests do not decode through the later
# prefills (batch-64 TPOT, docs/design.md section 19). Off on CPU (tests set it).
GPU_PREFILL_BUCKET = 8192
# MoE on a GPU: a 3,072-token step too (each expert's grouped GEMM sees only top_k / experts of a step's tokens, so
# larger steps reach the GEMM rate) and no 8,192-token prefill step (its scratch is the MoE's largest, and the slice
# the weights leave is thin); Mixtral 1024/512 on an H200: 54.0% of optimal against 49.0% (docs/design.md
# section 15).
GPU_MOE_BUCKETS = GPU_BUCKETS + (3072,)
CPU_NUM_PAGES = 512           # without device memory statistics (CPU), the pool is this size unless set
MAX_AUTO_SEQS = 1024


def _ints(s: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags (every one defaults to None: unset flags leave the config file's or the built-in value)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="nfjax checkpoint folder (default: the shipped tiny model)")
    g.add_argument("--engine-config", metavar="FILE", default=None,
                   help="JSON with sections cache, batcher, execution, parallel (flags override it)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="weights and activations")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (devices)")
    g.add_argument("--page-size", type=int, default=None,
                   help="positions per KV page (default 16; 64 for kivi64 and fp8r, whose groups are pages)")
    g.add_argument("--num-pages", type=int, default=None,
                   help="KV pages (default: what fits in --kv-memory-fraction of free GPU memory; 512 on CPU)")
    g.add_argument("--kv-dtype", choices=list(KV_DTYPES), default=None,
                   help="KV cache format: bfloat16 (unquantized, the default), fp8 (e4m3, a scale per token and kv "
                        "head), int8 (groups of 64 with a scale and center each: fp8's bytes, closer to bfloat16), "
                        "int4 (the same groups, two values a byte), kivi64 (K per channel, pages of 64) or fp8r (fp8 "
                        "with each sequence's newest group of 64 keys kept in bfloat16, pages of 64)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_const", const=False, default=None,
                   help="do not reuse the KV pages of equal prompt prefixes (the prefix cache is on by default)")
    g.add_argument("--host-cache-gb", type=float, default=None,
                   help="host memory for pages evicted from the GPU prefix cache, reloaded on a hit (default 0)")
    g.add_argument("--disk-cache-dir", default=None, help="folder of the disk tier below the host tier")
    g.add_argument("--disk-cache-gb", type=float, default=None, help="size of the disk tier (with --disk-cache-dir)")
    g.add_argument("--kv-memory-fraction", type=float, default=None,
                   help=f"share of device memory left after the weights that the KV pages take (default "
                        f"{KV_MEMORY_FRACTION['dense']}; MoE models {KV_MEMORY_FRACTION['moe']})")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt + output (default: the model's maximum)")
    g.add_argument("--max-pages-per-seq", type=int, default=None, help="page-table width (default: from the context)")
    g.add_argument("--token-buckets", type=_ints, default=None, metavar="N,N,...",
                   help=f"dense token budgets, one compiled step each (default GPU {','.join(map(str, GPU_BUCKETS))}, MoE "
                        f"models also 3072; "
                        f"CPU {','.join(map(str, CPU_BUCKETS))})")
    g.add_argument("--max-seqs", type=int, default=None,
                   help=f"sequences per step (default: the largest bucket, at most {MAX_AUTO_SEQS} and the KV pages)")
    g.add_argument("--max-prefill-seqs", type=int, default=None, help="prefill chunks per step (default 16)")
    g.add_argument("--prefill-bucket", type=int, default=None, metavar="N",
                   help=f"tokens of a step that holds no decode, a bucket of its own above --token-buckets (default "
                        f"GPU {GPU_PREFILL_BUCKET}, CPU none; 0: none)")
    g.add_argument("--no-predict-memory", dest="predict_memory", action="store_const", const=False, default=None,
                   help="admit while pages are free instead of by predicted peak memory")
    g.add_argument("--strategies", default=None, metavar="SPEC,...",
                   help="step strategies tried before Sequential, e.g. nanoflow:llama3-8b_h100_tp1_beside_mact or "
                        "dual_batch:1-1 (default: Sequential only)")
    g.add_argument("--plan", default=None, help="a NanoFlow plan (shipped name or JSON file): --strategies nanoflow:PLAN; "
                        "auto: the shipped plans for this model shape, device and TP degree (Sequential if none)")
    g.add_argument("--strategy-min-decode", type=int, default=None,
                   help="use the strategies only for batches with at least this many decode tokens")
    g.add_argument("--strategy-min-tokens", type=int, default=None,
                   help="use the strategies only for batches with at least this many tokens")
    g.add_argument("--layers-per-program", type=int, default=None, help="decoder layers per compiled program")
    g.add_argument("--no-command-buffers", dest="command_buffers", action="store_const", const=False, default=None,
                   help="XLA CUDA-graph command buffers off")
    g.add_argument("--separate-projections", dest="join_projections", action="store_const", const=False,
                   default=None, help="keep q/k/v and gate/up as separate weights (for comparison; joined by default)")
    g.add_argument("--no-swiglu-epilogue", dest="swiglu_epilogue", action="store_const", const=False, default=None,
                   help="the MLP's gate/up as XLA's dot and a separate SwiGLU (for comparison; by default SwiGLU runs "
                        "in the Pallas GEMM's epilogue on a GPU)")
    g.add_argument("--xla-remat", dest="xla_remat", action="store_const", const=True, default=None,
                   help="keep XLA's rematerialization pass in the step programs (for comparison; off by default: it "
                        "counts the in-place KV pool twice and recomputes values to fit)")
    g.add_argument("--kernel-lowering-cache", dest="kernel_lowering_cache", action="store_const", const=True,
                   default=None, help="lower each Pallas kernel once and reuse it in every program calling it the "
                                      "same way (off by default: on an H200 it saved less than the builds' "
                                      "spread, docs/design.md section 1)")
    g.add_argument("--prefill-dequant-first", dest="prefill_dequant_first", action="store_const", const=True,
                   default=None, help="on a quantized KV cache (fp8, int8, int4), dequantize the pages a step's "
                                      "prefill rows read into a bfloat16 copy and run the bfloat16 prefill kernel "
                                      "over it (off by default: faster at kernel level, not yet timed end to end)")
    g.add_argument("--no-fold-v-rotation", dest="fold_v_rotation", action="store_const", const=False, default=None,
                   help="on int4 KV, rotate attention's outputs back every step instead of folding V's rotation "
                        "into o_proj's weight at load (for comparison; folded by default)")
    g.add_argument("--fresh-inputs", dest="stable_inputs", action="store_const", const=False, default=None,
                   help="each step's inputs in new device buffers (for comparison)")
    g.add_argument("--compile-cache", dest="compile_cache_dir", metavar="DIR", default=None,
                   help="keep compiled programs in DIR (JAX's persistent cache): a restart with the same model and "
                        "settings loads them instead of compiling")
    g.add_argument("--offload", metavar="POLICY.json|auto", default=None,
                   help="FlexGen mode for models larger than the GPU: weights, KV cache and activations placed "
                        "across GPU, host memory and disk by the policy file (nfjax/offload/policy.py), or by the "
                        "policy an LP over the measured cost model finds best for the caps below (auto)")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="--offload: the GPU memory the engine may use (default: the device's)")
    g.add_argument("--cpu-memory-gb", type=float, default=None,
                   help="--offload: the host memory it may use (default: what is free)")
    g.add_argument("--disk-gb", type=float, default=None, help="--offload: the disk it may use (default: what is free)")
    g.add_argument("--offload-dir", default=None, help="--offload: the disk tier's folder (default $NFJAX_CACHE/offload)")
    g.add_argument("--remeasure-hardware", action="store_const", const=True, default=None,
                   help="--offload auto: measure this machine's rates again instead of using the cached ones")


# flag -> (section, field); the flags not listed here (strategies, plan, dtype) are handled by name below
_FLAT = {"page_size": "cache", "num_pages": "cache", "kv_memory_fraction": "cache", "max_model_len": "cache",
         "kv_dtype": "cache", "prefix_cache": "cache", "host_cache_gb": "cache", "disk_cache_dir": "cache",
         "disk_cache_gb": "cache",
         "max_pages_per_seq": "cache", "token_buckets": "batcher", "max_seqs": "batcher",
         "max_prefill_seqs": "batcher", "prefill_bucket": "batcher", "predict_memory": "batcher",
         "layers_per_program": "execution",
         "join_projections": "execution", "swiglu_epilogue": "execution", "command_buffers": "execution",
         "xla_remat": "execution", "kernel_lowering_cache": "execution", "prefill_dequant_first": "execution",
         "fold_v_rotation": "execution", "stable_inputs": "execution",
         "compile_cache_dir": "execution", "tp": "parallel"}


SETTINGS = frozenset(_FLAT) | {"engine_config", "strategies", "plan", "strategy_min_decode", "strategy_min_tokens"}
"""Every name `overrides_from_args` reads."""


def overrides_from_args(args: argparse.Namespace | dict) -> dict:
    """The engine settings a command line (or a dict of the same names) gives, as {section: {field: value}}:
    the `--engine-config` file first, then every flag that was set (other names are not read)."""
    a = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    out = load_engine_file(a["engine_config"]) if a.get("engine_config") else {}
    for name, section in _FLAT.items():
        if a.get(name) is not None:
            out.setdefault(section, {})[name] = a[name]
    specs = [s for s in (a.get("strategies") or "").split(",") if s.strip()]
    if a.get("plan"):
        specs.insert(0, f"nanoflow:{a['plan']}")
    limits = {k: a[f"strategy_{k}"] for k in ("min_decode", "min_tokens") if a.get(f"strategy_{k}") is not None}
    if specs:
        out.setdefault("execution", {})["strategies"] = [StrategyConfig.from_spec(s, **limits) for s in specs]
    elif limits:
        raise ConfigError("--strategy-min-decode / --strategy-min-tokens need --strategies or --plan")
    return out


def load_engine_file(path: str | Path) -> dict:
    p = Path(path)
    d = read_json(p, what="engine config file")
    if not isinstance(d, dict):
        raise ConfigError(f"{p}: expected a JSON object with sections {', '.join(SECTIONS)}")
    return d


def _strategy(v: Any) -> StrategyConfig:
    if isinstance(v, StrategyConfig):
        return v
    if isinstance(v, str):
        return StrategyConfig.from_spec(v)
    if isinstance(v, dict):
        try:
            return StrategyConfig(**{k: tuple(x) if isinstance(x, list) else x for k, x in v.items()})
        except TypeError as e:
            raise ConfigError(f"execution.strategies: {e}") from None
    raise ConfigError(f"execution.strategies: each entry is a spec string or an object, got {v!r}")


def engine_config(model: ModelConfig, overrides: dict | None = None) -> EngineConfig:
    """`EngineConfig` for `model` with `overrides` ({section: {field: value}}) over the built-in defaults.
    Automatic sizes stay None until `resolve`."""
    overrides = dict(overrides or {})
    bad = sorted(set(overrides) - set(SECTIONS))
    if bad:
        raise ConfigError(f"engine config: unknown section {bad[0]!r}; sections are {', '.join(SECTIONS)}")
    parts = {}
    for name, cls in SECTIONS.items():
        vals = dict(overrides.get(name) or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(vals) - known)
        if unknown:
            raise ConfigError(f"engine config: unknown field {name}.{unknown[0]}; fields are {', '.join(sorted(known))}")
        if name == "cache" and vals.get("page_size") is None and has_tail(vals.get("kv_dtype", "")):
            vals["page_size"] = TAIL_GROUP      # kivi64's and fp8r's groups are pages: the page size they take
        if "strategies" in vals:
            vals["strategies"] = tuple(_strategy(v) for v in vals["strategies"])
        if vals.get("token_buckets") is not None:
            vals["token_buckets"] = tuple(vals["token_buckets"])
        try:
            parts[name] = cls(**vals)
        except TypeError as e:
            raise ConfigError(f"engine config: {name}: {e}") from None
    from nfjax.schedule.auto import resolve_auto
    parts["execution"], auto = resolve_auto(parts["execution"], model, parts["parallel"].tp)   # --plan auto
    if auto:
        print(f"[{auto}]", file=sys.stderr, flush=True)
    return EngineConfig(model, **parts)


def resolve(config: EngineConfig, free_bytes: int | None, on_gpu: bool) -> EngineConfig:
    """Every automatic (None) size made concrete. `free_bytes`: device memory free after the weights (None
    when the device keeps no statistics, as on CPU)."""
    from nfjax.kv.attention import check_kv_format
    from nfjax.engine.batcher import check_chunk_budget
    from nfjax.engine.penalties import num_penalty_slots, state_bytes
    from nfjax.kv import kivi64
    from nfjax.kv.cache import bytes_per_token
    from nfjax.kv.tail_slots import tail_rows
    from pallas_kernels.kv_quant import V_TAIL_FORMATS, has_tail
    m, c, b = config.model, config.cache, config.batcher
    tp = config.parallel.tp
    moe = is_moe(m)
    buckets = b.token_buckets or ((GPU_MOE_BUCKETS if moe else GPU_BUCKETS) if on_gpu else CPU_BUCKETS)
    seqs_bound = b.max_seqs or min(MAX_AUTO_SEQS, max(buckets))        # max_seqs before the pages bound it
    check_kv_format(m, c.kv_dtype, on_gpu)          # a format no kernel here serves: an error before any array
    check_chunk_budget(c.kv_dtype, buckets)         # kivi64's, fp8r's chunks end at groups (nfjax/engine/batcher.py)
    c = dataclasses.replace(c, kv_memory_fraction=c.kv_memory_fraction or kv_memory_fraction(m))
    num_pages = c.num_pages
    if num_pages is None:
        if free_bytes is None:
            num_pages = CPU_NUM_PAGES
        else:
            local = m.replace(num_kv_heads=max(m.num_kv_heads, tp) // tp)     # KV heads each device holds
            per_page = bytes_per_token(local, kv_dtype=c.kv_dtype) * c.page_size     # compressed bytes + scales
            # the penalty slots' token counts (nfjax/engine/penalties.py, on every device) come out of the KV share
            kv_bytes = int(free_bytes * c.kv_memory_fraction) - state_bytes(num_penalty_slots(seqs_bound),
                                                                             m.vocab_size)
            if has_tail(c.kv_dtype):        # its tail rows (nfjax/kv/kivi64.py) come out of the KV share too
                kv_bytes -= kivi64.tail_bytes(m.num_layers, tail_rows(seqs_bound), local.num_kv_heads, m.head_dim) \
                    * (2 if c.kv_dtype in V_TAIL_FORMATS else 1)                 # K's, and fp8r's V too
            num_pages = max(2, int(kv_bytes // per_page))
    max_len = min(c.max_model_len or m.max_position_embeddings, m.max_position_embeddings)
    per_seq = c.max_pages_per_seq or c.pages_for(max_len)
    cache = dataclasses.replace(c, num_pages=num_pages, max_pages_per_seq=per_seq,
                                max_model_len=min(max_len, per_seq * c.page_size))
    max_seqs = min(seqs_bound, num_pages - 1) if b.max_seqs is None else b.max_seqs
    prefill = b.prefill_bucket
    if prefill is None:
        prefill = GPU_PREFILL_BUCKET if on_gpu and not moe and GPU_PREFILL_BUCKET > max(buckets) else 0
    batcher = dataclasses.replace(b, token_buckets=buckets, max_seqs=max_seqs, prefill_bucket=prefill)
    return dataclasses.replace(config, cache=cache, batcher=batcher)


def build_engine(model_dir: str | Path | None = None, overrides: dict | None = None, *, dtype: str | None = None,
                 progress: bool = False, model=None, tokenizer=None, mesh=None, take_weights: bool = True):
    """An `Engine` from a checkpoint folder (None: the shipped tiny model), or from an in-memory `model`
    (random weights in the benches) with its `tokenizer`."""
    from nfjax.engine.engine import TINY_MODEL, Engine
    from nfjax.errors import UserError
    from nfjax.parallel import make_mesh, sharding_fn, tp_config
    overrides = dict(overrides or {})
    tp = int((overrides.get("parallel") or {}).get("tp", 1))
    if model is None:
        from nfjax.checkpoint.orbax_io import load_config, load_model
        from nfjax.tokenizer import load_tokenizer
        from nfjax.checkpoint.models import resolve
        model_dir = resolve(model_dir)              # a model name (smollm2): converted once into the cache
        path = Path(model_dir) if model_dir is not None else TINY_MODEL
        if not path.is_dir():
            raise UserError(f"{path}: no such model folder")
        cfg = load_config(path)
        tp_config(cfg, tp)                           # a clear error before any weight is read
        from nfjax import device_memory              # before the mesh starts the GPU client
        device_memory.for_model(cfg, log=lambda m: print(f"nfjax: {m}", file=sys.stderr))
        mesh = mesh or make_mesh(tp)
        model = load_model(path, dtype=dtype, sharding_fn=sharding_fn(mesh))
        tokenizer = tokenizer or load_tokenizer(path, token_ids_only=True)   # no tokenizer files: ids only
    if tokenizer is None:
        raise UserError("build_engine: an in-memory model needs its tokenizer")
    return Engine(model, tokenizer, engine_config(model.cfg, overrides), progress=progress, mesh=mesh,
                  take_weights=take_weights)


def from_flags(args: argparse.Namespace, *, progress: bool = False, **kw):
    """`build_engine` from parsed `add_engine_args` flags (plus `--model`, if the parser has it); prints what the
    engine holds (KV capacity, context, sequences, buckets) to stderr."""
    if getattr(args, "offload", None):
        from nfjax.offload.engine import from_flags as offload_engine
        engine = offload_engine(args, progress=progress)
    else:
        engine = build_engine(getattr(args, "model", None), overrides_from_args(args), dtype=args.dtype,
                              progress=progress, **kw)
    print(f"[{engine.capacity_line()}]", file=sys.stderr, flush=True)
    tiers = getattr(engine, "tier_line", lambda: None)()
    if tiers:                        # which prefix-cache tiers beat recomputing here, and by what rates
        print(f"[prefix tiers: {tiers}]", file=sys.stderr, flush=True)
    return engine
