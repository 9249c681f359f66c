"""One set-up for every bench that builds an engine: the flags, the model and the engine (or its `Runner`).

The flags are the product's engine flags (`nfjax.engine.builder.add_engine_args`: the same names, meanings and
defaults as `nfjax serve` and `nfjax generate`) plus the random-weight model: `--shape` (a name of
`nfjax.models.random_init.SHAPES`; `smoke` is CPU-sized) and `--layers`. Settings the flags leave unset are
sized by the builder as in the product (KV pages from free device memory, 512 on a CPU; token buckets by
device; sequences per step from those). A bench adds only what its workload decides: the page-table width its
longest request needs (`context`), the buckets of its synthetic batches, or a cap on the KV pages where runs must
see the same memory (`max_pages`).

Importing this module lets JAX take 92% of GPU memory (JAX's default 75%) before any bench starts the backend;
`model_config` then sets the model's own share and allocator (nfjax/device_memory.py: MoE 0.99), unless the user
set them.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from nfjax import device_memory
from nfjax.engine.builder import add_engine_args, engine_config, overrides_from_args

# The share set here is provisional (the model's wins in `model_config`); the marker tells a bench's child processes,
# which inherit both variables, that it was not the user's.
_PROVISIONAL = "NFJAX_BENCH_PROVISIONAL_MEM_FRACTION"
if device_memory.MEM_ENV not in os.environ:
    os.environ[device_memory.MEM_ENV] = os.environ[_PROVISIONAL] = device_memory.MEM_FRACTION["dense"]


def add_bench_args(p: argparse.ArgumentParser, shape: str | None = "llama3-8b") -> None:
    """The engine flags plus the random-weight model's. `shape=None`: no shape unless given, for a bench that
    also runs a checkpoint (`--model`)."""
    add_engine_args(p)
    g = p.add_argument_group("bench model")
    g.add_argument("--shape", default=shape,
                   help="random-weight model shape: llama3-8b, llama3-70b or smoke (CPU-sized)"
                        + (f" (default {shape})" if shape else "; unset: the --model checkpoint"))
    g.add_argument("--layers", type=int, default=None, help="override the shape's layer count (quick runs)")


def _args(args) -> dict:
    return dict(vars(args) if isinstance(args, argparse.Namespace) else args)


def model_config(args):
    """The `ModelConfig` of `--shape`, with `--layers` and `--dtype` applied."""
    from nfjax.models.random_init import SHAPES
    a = _args(args)
    if a.get("shape") not in SHAPES:
        raise SystemExit(f"--shape: expected one of {', '.join(SHAPES)}, got {a.get('shape')!r}")
    cfg = SHAPES[a["shape"]]
    if os.environ.get(_PROVISIONAL) == os.environ.get(device_memory.MEM_ENV):   # every bench reads its shape
        os.environ.pop(device_memory.MEM_ENV, None)                              # before it touches a device
    device_memory.for_model(cfg, log=print)
    if a.get("layers"):
        cfg = cfg.replace(num_layers=a["layers"])
    if a.get("dtype"):
        cfg = cfg.replace(dtype=a["dtype"])
    return cfg


def _flag_actions() -> list[argparse.Action]:
    p = argparse.ArgumentParser(add_help=False)
    add_bench_args(p, shape=None)
    return [a for a in p._actions if a.option_strings]


def engine_flags(args) -> dict:
    """The engine and model flags that were set, by name (the record of what a run asked for)."""
    a = _args(args)
    return {act.dest: a[act.dest] for act in _flag_actions() if a.get(act.dest) is not None}


def engine_argv(args) -> list[str]:
    """The engine and model flags that were set, as a command line again (for a child process)."""
    a, out = _args(args), []
    for act in _flag_actions():
        v = a.get(act.dest)
        if v is None:
            continue
        if act.nargs == 0:                               # store_const / store_true switches
            if v == act.const:
                out.append(act.option_strings[0])
            continue
        out += [act.option_strings[0], ",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)]
    return out


def _merge(base: dict, more: dict | None, only_unset: bool = False) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for section, vals in (more or {}).items():
        sec = out.setdefault(section, {})
        for k, v in vals.items():
            if not only_unset or sec.get(k) is None:
                sec[k] = v
    return out


def bench_overrides(args, *, context: int | None = None, defaults: dict | None = None,
                    extra: dict | None = None) -> dict:
    """The engine settings ({section: {field: value}}) of the flags; `defaults` fill what they leave unset,
    `extra` goes over them. `context`: the page table as wide as this many tokens (the workload's longest
    request), unless the flags size it."""
    ov = overrides_from_args(_args(args))
    cache = ov.get("cache", {})
    if context and cache.get("max_model_len") is None and cache.get("max_pages_per_seq") is None:
        ov = _merge(ov, {"cache": {"max_model_len": context}})
    return _merge(_merge(ov, defaults, only_unset=True), extra)


def setting(args, section: str, name: str):
    """One engine setting as the flags (or their --engine-config file) give it, else the built-in default
    (None for what the builder sizes), e.g. the page size a bench lays its synthetic batches out in."""
    from nfjax.engine.builder import SECTIONS
    v = (overrides_from_args(_args(args)).get(section) or {}).get(name)
    return getattr(SECTIONS[section](), name) if v is None else v


def _place(cfg, tp: int, mesh):
    """A random-weight model of `cfg` created in its TP shards and placed for a Runner on `mesh` (as `Engine`
    places a model)."""
    from nfjax.models.random_init import random_model
    from nfjax.parallel import replicate_kv_heads, shard_model, sharding_fn, tp_config
    tp_config(cfg, tp)
    model = random_model(cfg, sharding_fn=sharding_fn(mesh))
    if tp > cfg.num_kv_heads:
        replicate_kv_heads(model, tp, mesh)
    shard_model(model, mesh)
    return model


def _cap_pages(cfg, overrides: dict, max_pages: int) -> dict:
    """`overrides` with at most `max_pages` KV pages: fewer than the builder would size only where it would
    size more (the model's weights must already be on the device)."""
    from nfjax.compat import on_gpu
    from nfjax.engine.builder import resolve
    from nfjax.kv.cache import free_device_bytes
    if (overrides.get("cache") or {}).get("num_pages") is not None:
        return overrides
    fit = resolve(engine_config(cfg, overrides), free_device_bytes(), on_gpu()).cache.num_pages
    return _merge(overrides, {"cache": {"num_pages": min(fit, max_pages)}})


def bench_engine(args, *, context: int | None = None, max_pages: int | None = None, defaults: dict | None = None,
                 extra: dict | None = None, model=None, mesh=None, take_weights: bool = True,
                 progress: bool = False):
    """An `Engine` from the bench flags, built by the product's builder: a random-weight model of `--shape`
    (or `model`, made already) with a token-id tokenizer; without a shape, the `--model` checkpoint (default
    the shipped tiny model). `context`, `defaults`, `extra`: see `bench_overrides`; `max_pages`: at most this
    many KV pages (where runs must see the same memory), unless `--num-pages` says."""
    from nfjax.engine.builder import build_engine
    a = _args(args)
    overrides = bench_overrides(a, context=context, defaults=defaults, extra=extra)
    if a.get("shape") is None:
        return build_engine(a.get("model"), overrides, dtype=a.get("dtype"), progress=progress)
    if a.get("model"):
        raise SystemExit("--model and --shape: a bench runs either a checkpoint or a random-weight shape")
    from nfjax.models.random_init import random_model
    from nfjax.parallel import make_mesh, sharding_fn
    from nfjax.tokenizer.silent import SilentTokenizer
    cfg = model_config(a) if model is None else model.cfg
    mesh = mesh or make_mesh(int((overrides.get("parallel") or {}).get("tp", 1)))
    if model is None:                 # created in its shards; the Engine places it for TP (as a checkpoint)
        model = random_model(cfg, sharding_fn=sharding_fn(mesh))
    if max_pages:
        overrides = _cap_pages(cfg, overrides, max_pages)
    return build_engine(overrides=overrides, model=model, tokenizer=SilentTokenizer(cfg.vocab_size, cfg.eos_token_ids),
                        mesh=mesh, take_weights=take_weights, progress=progress)


def bench_runner(args, *, context: int | None = None, defaults: dict | None = None, extra: dict | None = None,
                 take_weights: bool = True, compile: bool = True):
    """A `Runner` (no batcher, no engine loop) on a random-weight model of `--shape`, for the benches that time
    compiled steps on synthetic batches; its resolved settings are `runner.config`. `context`, `defaults`,
    `extra`: see `bench_overrides`. `compile=False`: the caller compiles (`runner.compile_all()`)."""
    from nfjax.engine.runner import Runner
    from nfjax.parallel import make_mesh
    a = _args(args)
    overrides = bench_overrides(a, context=context, defaults=defaults, extra=extra)
    cfg = model_config(a)
    tp = int((overrides.get("parallel") or {}).get("tp", 1))
    mesh = make_mesh(tp)
    runner = Runner(_place(cfg, tp, mesh), engine_config(cfg, overrides), mesh, take_weights=take_weights)
    if compile:
        runner.compile_all()
    return runner


def config_record(config) -> dict:
    """An `EngineConfig`'s engine settings (model left out) as plain JSON-friendly values."""
    return {f.name: dataclasses.asdict(getattr(config, f.name)) for f in dataclasses.fields(config)
            if f.name != "model"}
