"""`nfjax convert`: a Hugging Face safetensors checkpoint -> an nfjax checkpoint folder.

The output holds `nfjax_config.json`, `params/` (Orbax, loadable with `nfjax.checkpoint.orbax_io.load_model`),
the tokenizer / generation files when present, and the original `config.json` as `hf_config.json`.

Everything is checked (config, tensor names, shapes, dtypes) before anything is written. The output is built in
a temporary folder next to `--out` and renamed into place at the end, so a failure leaves nothing behind.
Tensors are streamed one at a time from the safetensors files (memory-mapped) into per-parameter stacks
([L, ...] for per-layer weights) that live in memory-mapped staging files, so host memory stays small.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from nfjax.checkpoint import hf_names
from nfjax.config import ModelConfig
from nfjax.errors import UserError
from nfjax.interrupts import Terminated, pid_alive, rmtree_quietly, sigterm_interrupts

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HF_CONFIG_COPY = "hf_config.json"
# Copied verbatim into the output when present.
AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
             "tokenizer.model", "chat_template.jinja")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
DTYPES = ("bfloat16", "float32")


class ConversionError(UserError):
    """An HF checkpoint nfjax cannot convert, naming the file or tensor at fault."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str                  # safetensors dtype tag: F32, BF16, ...


# ---- CLI --------------------------------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="convert a Hugging Face safetensors checkpoint to an nfjax checkpoint",
                       description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", type=Path, metavar="DIR",
                     help="HF model folder (config.json + model.safetensors or a sharded index)")
    src.add_argument("--gguf", type=Path, metavar="FILE",
                     help="a llama GGUF file (tensors dequantized; tokenizer and chat template from its metadata; "
                          "needs `pip install gguf`)")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder (created)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="parameter dtype (default: bfloat16 if config.json says so, else float32)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        with sigterm_interrupts():
            if getattr(args, "gguf", None) is not None:
                from nfjax.checkpoint.gguf_convert import convert_gguf
                cfg = convert_gguf(args.gguf, args.out, dtype=args.dtype, force=args.force,
                                   progress=False if args.no_progress else None)
            else:
                cfg = convert(args.hf, args.out, dtype=args.dtype, force=args.force,
                              progress=False if args.no_progress else None)
    except KeyboardInterrupt as e:
        sig = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
        print(f"nfjax convert: interrupted ({sig}); the partial output was removed, {args.out} is unchanged",
              file=sys.stderr)
        return 143 if sig == "SIGTERM" else 130
    print(f"wrote {args.out}: {cfg.model_type}, {cfg.num_params() / 1e6:.2f}M params, {cfg.dtype}")
    return 0


# ---- conversion -------------------------------------------------------------------------------------------------
def convert(hf_dir: str | Path, out_dir: str | Path, dtype: str | None = None, force: bool = False,
            progress: bool | None = None) -> ModelConfig:
    """Convert `hf_dir` into `out_dir`; returns the written ModelConfig. `progress=None`: a bar on a terminal."""
    hf_dir, out = Path(hf_dir), Path(out_dir)
    if not hf_dir.is_dir():
        raise ConversionError(f"--hf {hf_dir}: not a directory")
    cfg = read_hf_config(hf_dir)
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConversionError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        cfg = cfg.replace(dtype=dtype)
    check_output(hf_dir, out, force)
    tensors = index_tensors(hf_dir)
    params = _abstract_params(cfg)
    groups = plan(cfg, tensors, params)
    with _atomic_output(out) as tmp:
        try:
            _write_params(cfg, tensors, groups, params, tmp, progress)
            _write_metadata(cfg, hf_dir, tmp)
            check_output(hf_dir, out, force)     # again: --out may have appeared while converting
        except OSError as e:
            raise ConversionError(f"writing {out}: {e}") from e
    return cfg


def read_hf_config(hf_dir: Path) -> ModelConfig:
    """ModelConfig from `config.json`, with `generation_config.json`'s eos token ids merged in."""
    cfg = ModelConfig.from_hf(hf_dir / "config.json")
    gen = hf_dir / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ConversionError(f"{gen}: not a valid generation config ({e})") from None
        ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        try:
            merged = tuple(dict.fromkeys([*map(int, cfg.eos_token_ids), *map(int, ids)]))
        except (TypeError, ValueError):
            raise ConversionError(f"{gen}: eos_token_id must be an int or a list of ints, got {eos!r}") from None
        cfg = cfg.replace(eos_token_ids=merged)
    return cfg


def check_output(hf_dir: Path, out: Path, force: bool) -> None:
    o, h = out.resolve(), hf_dir.resolve()
    if o == h or o in h.parents:
        raise ConversionError(f"--out {out} would replace the input folder --hf {hf_dir}")
    if out.is_symlink() or out.exists():
        if force:
            return
        if not out.is_dir():
            raise ConversionError(f"--out {out} exists and is not a directory; pass --force to replace it")
        if any(out.iterdir()):
            raise ConversionError(f"--out {out} exists and is not empty; pass --force to replace it")


def index_tensors(hf_dir: Path) -> dict[str, TensorInfo]:
    """Name -> (file, shape, dtype) for every tensor of the checkpoint, reading only the safetensors headers."""
    from safetensors import SafetensorError, safe_open

    index = hf_dir / INDEX_FILE
    weight_map = None
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        paths = [hf_dir / f for f in files]
        for p in paths:
            if not p.is_file():
                raise ConversionError(f"{index}: shard {p.name} is missing from {hf_dir}")
    elif (hf_dir / SINGLE_FILE).is_file():
        paths = [hf_dir / SINGLE_FILE]
    else:
        paths = sorted(hf_dir.glob("*.safetensors"))
        if not paths:
            hint = (" (it has PyTorch .bin weights only: re-save them with "
                    "save_pretrained(..., safe_serialization=True))") if any(hf_dir.glob("*.bin")) else ""
            raise ConversionError(f"--hf {hf_dir}: no *.safetensors weights found{hint}")

    tensors: dict[str, TensorInfo] = {}
    for p in paths:
        try:
            with safe_open(str(p), framework="numpy") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    if name in tensors:
                        raise ConversionError(f"tensor {name} is stored twice: in {tensors[name].file.name} "
                                              f"and in {p.name}")
                    tensors[name] = TensorInfo(p, tuple(int(d) for d in sl.get_shape()), str(sl.get_dtype()))
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"{p}: not a readable safetensors file, truncated or corrupt? ({e})") from None
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in tensors:
                raise ConversionError(f"{index}: tensor {name} is listed in shard {fname} but not stored there")
    return tensors


def _abstract_params(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Flat {param path: shape} of the nfjax model for `cfg`, without allocating weights."""
    import jax
    from flax import nnx

    from nfjax.checkpoint.orbax_io import abstract_model

    pure = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
    flat = jax.tree_util.tree_flatten_with_path(pure)[0]
    return {tuple(str(getattr(k, "key", k)) for k in p): tuple(x.shape) for p, x in flat}


def _names_list(names: list[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def plan(cfg: ModelConfig, tensors: dict[str, TensorInfo], params: dict[tuple[str, ...], tuple[int, ...]]
         ) -> dict[tuple[str, ...], list[tuple[str, hf_names.Target]]]:
    """Check the checkpoint against `cfg` (whose nfjax param shapes are `params`) and group HF tensors by the
    nfjax parameter they fill.

    Raises ConversionError naming the first unexpected, missing, mis-shaped or non-float tensor(s).
    """
    names = hf_names.for_model(cfg)
    expected = names.expected_names(cfg)
    expected_set = set(expected)
    tied_head = cfg.tie_word_embeddings and names.LM_HEAD in tensors

    unexpected, hints = [], set()
    for name in tensors:
        if name in expected_set or names.is_ignored(name) or (tied_head and name == names.LM_HEAD):
            continue
        unexpected.append(name)
        t = names.parse(name)
        if t is not None and t.layer is not None and t.layer >= cfg.num_layers:
            hints.add(f"config.json has num_hidden_layers={cfg.num_layers}")
        elif t is not None and t.path[-1] == "bias":
            hints.add("config.json has attention_bias=false")
    if unexpected:
        hint = f" ({'; '.join(sorted(hints))})" if hints else ""
        s = "s" if len(unexpected) > 1 else ""
        raise ConversionError(f"unexpected tensor{s} {_names_list(sorted(unexpected))} in "
                              f"{tensors[unexpected[0]].file.name}: nfjax's {cfg.model_type} model has no such "
                              f"parameter{s}{hint}")

    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ConversionError(f"missing tensor{'s' if len(missing) > 1 else ''} {_names_list(missing)} "
                              f"({len(missing)} of the {len(expected)} "
                              f"tensors a {cfg.model_type} model with this config.json needs are not in the "
                              "checkpoint)")

    groups: dict[tuple[str, ...], list[tuple[str, hf_names.Target]]] = {p: [] for p in params}
    for name in expected + ([names.LM_HEAD] if tied_head else []):
        info = tensors[name]
        if info.dtype not in FLOAT_DTYPES:
            raise ConversionError(f"tensor {name} in {info.file.name} has dtype {info.dtype}; nfjax converts "
                                  f"floating-point weights only ({', '.join(FLOAT_DTYPES)})")
        t = names.parse(name)
        if name == names.LM_HEAD and tied_head:
            want = tensors[names.EMBED].shape
        else:
            if t is None or t.path not in params:
                raise AssertionError(f"hf_names and the nfjax model disagree about {name}")
            want = hf_names.hf_shape(t, params[t.path])
            groups[t.path].append((name, t))
        if info.shape != want:
            raise ConversionError(f"tensor {name} in {info.file.name} has shape {list(info.shape)}, expected "
                                  f"{list(want)} from config.json")
    for p, members in groups.items():
        experts = cfg.num_experts if p[0] == "layers" and p[1].startswith("experts_") else 1
        if len(members) != (cfg.num_layers if p[0] == "layers" else 1) * experts:
            raise AssertionError(f"hf_names and the nfjax model disagree about {'.'.join(p)}")
    if tied_head:
        _check_tied_head(tensors, names)
    return groups


class _Reader:
    """Reads tensors as numpy arrays, keeping each safetensors file open (memory-mapped) once."""

    def __init__(self, stack: contextlib.ExitStack):
        self._stack, self._files = stack, {}

    def get(self, name: str, info: TensorInfo):
        import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy reader needs)
        from safetensors import SafetensorError, safe_open

        try:
            f = self._files.get(info.file)
            if f is None:
                f = self._files[info.file] = self._stack.enter_context(safe_open(str(info.file), framework="numpy"))
            return f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"{info.file}: cannot read tensor {name} ({e})") from None


def _check_tied_head(tensors: dict[str, TensorInfo], names=hf_names) -> None:
    import numpy as np

    with contextlib.ExitStack() as stack:
        r = _Reader(stack)
        same = np.array_equal(r.get(names.LM_HEAD, tensors[names.LM_HEAD]),
                              r.get(names.EMBED, tensors[names.EMBED]))
    if not same:
        raise ConversionError(f"config.json has tie_word_embeddings=true but tensor {names.LM_HEAD} differs from "
                              f"{names.EMBED}; set tie_word_embeddings=false if the model has its own head")


def _write_params(cfg: ModelConfig, tensors: dict[str, TensorInfo],
                  groups: dict[tuple[str, ...], list[tuple[str, hf_names.Target]]],
                  params: dict[tuple[str, ...], tuple[int, ...]], tmp: Path, progress: bool | None) -> None:
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from nfjax.checkpoint.orbax_io import PARAMS_DIR

    dt = np.dtype(jnp.dtype(cfg.dtype))
    staging = tmp / ".staging"
    staging.mkdir()
    pure: dict = {}
    total = sum(len(m) for m in groups.values())
    with contextlib.ExitStack() as stack, tqdm(total=total, desc="convert", unit="tensor",
                                               disable=None if progress is None else not progress) as bar:
        reader = _Reader(stack)
        for path, members in groups.items():
            arr = np.lib.format.open_memmap(staging / ("-".join(path) + ".npy"), mode="w+", dtype=dt,
                                            shape=params[path])
            for name, t in members:
                x = reader.get(name, tensors[name])
                x = (x.T if t.transpose else x).astype(dt, copy=False)
                arr[t.index] = x
                bar.update()
            node = pure
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = arr
        bar.set_postfix_str("saving")
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save((tmp / PARAMS_DIR).absolute(), pure)
    del pure, arr
    shutil.rmtree(staging)


def _write_metadata(cfg: ModelConfig, hf_dir: Path, tmp: Path) -> None:
    from nfjax.checkpoint.orbax_io import CONFIG_FILE

    (tmp / CONFIG_FILE).write_text(json.dumps(cfg.to_json(), indent=2))
    shutil.copyfile(hf_dir / "config.json", tmp / HF_CONFIG_COPY)
    for name in AUX_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, tmp / name)


@contextlib.contextmanager
def _atomic_output(out: Path) -> Iterator[Path]:
    """Yield a fresh temp folder next to `out`; on success it replaces `out`, on any error it is removed
    (along with parent folders this created)."""
    parent = out.absolute().parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]     # deepest first
    _remove_stale_temps(parent, out.name)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()                          # not mkdtemp: the output keeps the usual (umask) permissions
        (tmp / TMP_MARKER).touch()
    except OSError as e:
        raise ConversionError(f"--out {out}: cannot create a folder in {parent} ({e})") from None
    try:
        yield tmp
        (tmp / TMP_MARKER).unlink()
        _replace(tmp, out)
    except BaseException:
        rmtree_quietly(tmp)
        for p in created:
            try:
                p.rmdir()
            except OSError:
                break
        raise


def _replace(tmp: Path, out: Path) -> None:
    if not (out.is_symlink() or out.exists()):
        os.rename(tmp, out)
        return
    old = tmp.with_name(tmp.name.replace(".tmp-", ".old-", 1))
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


# ---- interrupts and leftovers of interrupted runs -----------------------------------------------------------------
TMP_MARKER = ".nfjax-convert-in-progress"   # inside a temp folder while it is being written; removed before rename


def _remove_stale_temps(parent: Path, name: str) -> None:
    """Remove temp folders that an earlier, interrupted or killed conversion to `parent/name` left behind.

    Only folders named as `_atomic_output` names them (`.NAME.tmp-PID-XXXXXXXX`), whose process is gone, and which
    hold the converter's marker or nothing but files the converter writes, are removed: never anything else."""
    if not parent.is_dir():
        return
    pat = re.compile(rf"\.{re.escape(name)}\.tmp-(\d+)-[0-9a-f]{{8}}")
    known = {TMP_MARKER, ".staging", "params", "nfjax_config.json", HF_CONFIG_COPY, *AUX_FILES}
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for d in entries:
        m = pat.fullmatch(d.name)
        if not m or d.is_symlink() or not d.is_dir() or int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))):
            continue
        try:
            inside = {c.name for c in d.iterdir()}
        except OSError:
            continue
        if TMP_MARKER in inside or inside <= known:
            shutil.rmtree(d, ignore_errors=True)
            print(f"nfjax convert: removed {d}, left by an interrupted conversion", file=sys.stderr)
