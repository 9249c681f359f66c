"""`nfjax train-tiny`: train the tiny byte-level Llama that ships in `nfjax/assets/tiny/`.

Data: the text of CPython's `pydoc_data/topics.py` (the `topics` dict's values in key order, joined by a blank
line, UTF-8 encoded); the last `--heldout-frac` (5%) of the bytes is the fixed held-out split.
Every training window is `[BOS] + 256 bytes` drawn at a random offset of the training split; held-out
perplexity is per byte, over consecutive non-overlapping windows of the held-out split (each starts with BOS).

Optimiser: AdamW (b1 0.9, b2 0.95, weight decay on matrices only) after global-norm gradient clipping, with a
linear warmup then a cosine decay to `--min-lr-ratio`. The decay follows `progress = max(step / --steps,
elapsed / --seconds)`, so a wall-clock cap still ends the schedule at its low learning rate.

Training forward: the reference forward (`nfjax.models.reference.logits`): the model's own decoder-layer ops
(`LAYER_OPS`: norms, projections, RoPE, MLP, residuals) over the whole batch, only attention swapped for one dense
causal attention (no paged cache). So training and paged inference share the same math (a test checks their
logits agree); `sample` decodes with the same forward.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nfjax.config import ModelConfig
from nfjax.errors import UserError
from nfjax.models import reference
from nfjax.models.llama import LlamaModel
from nfjax.tokenizer import ByteTokenizer, Tokenizer, save_byte_tokenizer
from nfjax.tokenizer.byte import BOS_ID, EOS_ID

DEFAULT_OUT = Path(__file__).parent / "assets" / "tiny"


# ---- data ---------------------------------------------------------------------------------------------------
def load_corpus() -> bytes:
    import pydoc_data.topics as topics
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


def corpus_source() -> str:
    import pydoc_data.topics as topics
    return topics.__file__


def split_corpus(data: bytes, heldout_frac: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    arr = np.frombuffer(data, np.uint8).astype(np.int32)
    cut = int(len(arr) * (1.0 - heldout_frac))
    return arr[:cut], arr[cut:]


def train_batch(train: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int) -> np.ndarray:
    """[B, seq_len + 1] rows `[BOS] + seq_len bytes` (inputs = row[:-1], targets = row[1:])."""
    starts = rng.integers(0, len(train) - seq_len, size=batch_size)
    rows = np.stack([train[s:s + seq_len] for s in starts])
    return np.concatenate([np.full((batch_size, 1), BOS_ID, np.int32), rows], axis=1)


def heldout_windows(held: np.ndarray, seq_len: int, max_windows: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive windows covering the held-out bytes: rows [W, seq_len + 1] and a target mask [W, seq_len]."""
    n = math.ceil(len(held) / seq_len)
    if max_windows is not None:
        n = min(n, max_windows)
    rows = np.full((n, seq_len + 1), EOS_ID, np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    rows[:, 0] = BOS_ID
    for w in range(n):
        chunk = held[w * seq_len:(w + 1) * seq_len]
        rows[w, 1:1 + len(chunk)] = chunk
        mask[w, :len(chunk)] = 1.0
    return rows, mask


# ---- model --------------------------------------------------------------------------------------------------
def tiny_model_config(**overrides) -> ModelConfig:
    kw = dict(vocab_size=EOS_ID + 1, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
              num_kv_heads=2, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
              max_position_embeddings=1024, model_type="llama", bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,),
              dtype="float32")
    kw.update(overrides)
    return ModelConfig(**kw)


def sequence_nll(model: LlamaModel, rows, mask=None) -> tuple[jax.Array, jax.Array]:
    """(sum of target NLL, number of targets) for rows [B, T + 1]."""
    logits = reference.logits(model, rows[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, rows[:, 1:, None], axis=-1)[..., 0]
    if mask is None:
        mask = jnp.ones(nll.shape, jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(mask)


def heldout_perplexity(model: LlamaModel, held: np.ndarray, seq_len: int = 256, max_windows: int | None = None,
                       batch_size: int = 8) -> float:
    """Per-byte perplexity of `model` on the held-out bytes (windows of `seq_len`, each after a BOS)."""
    rows, mask = heldout_windows(held, seq_len, max_windows)
    graphdef, state = nnx.split(model)

    @jax.jit
    def nll(state, r, m):
        return sequence_nll(nnx.merge(graphdef, state), r, m)

    tot, cnt = 0.0, 0.0
    for i in range(0, len(rows), batch_size):
        r, m = rows[i:i + batch_size], mask[i:i + batch_size]
        pad = batch_size - len(r)
        if pad:   # keep one compiled shape
            r = np.concatenate([r, np.repeat(r[-1:], pad, 0)])
            m = np.concatenate([m, np.zeros((pad,) + m.shape[1:], m.dtype)])
        s, c = nll(state, jnp.asarray(r), jnp.asarray(m))
        tot, cnt = tot + float(s), cnt + float(c)
    return math.exp(tot / cnt)


# ---- training -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    seconds: float | None = None     # wall-clock cap on the training loop (the schedule follows it)
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 60
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    heldout_frac: float = 0.05
    seed: int = 0
    eval_every: int = 0              # 0: evaluate only at the end
    log_every: int = 25


def learning_rate(tc: TrainConfig, step: int, progress: float) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def _decay_mask(params):
    """Weight decay on projection matrices only (not norms, not the embedding)."""
    def leaf(path, _):
        return str(getattr(path[-1], "key", path[-1])) == "kernel"
    return jax.tree_util.tree_map_with_path(leaf, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.inject_hyperparams(optax.adamw, static_args=("mask",))(learning_rate=tc.lr, b1=0.9, b2=0.95, eps=1e-8,
                                              weight_decay=tc.weight_decay, mask=_decay_mask))


def train(tc: TrainConfig, mc: ModelConfig, log: Callable[[str], None] = print,
          data: bytes | None = None) -> tuple[LlamaModel, dict]:
    """Train a fresh model; returns it and a history dict (losses, final held-out perplexity, timings)."""
    data = load_corpus() if data is None else data
    train_split, held = split_corpus(data, tc.heldout_frac)
    if len(train_split) <= tc.seq_len or len(held) == 0:
        raise UserError(f"corpus of {len(data)} bytes is too small for --seq-len {tc.seq_len}")
    model = LlamaModel(mc, nnx.Rngs(tc.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(tc)
    opt_state = tx.init(params)

    def loss_fn(params, rows):
        s, c = sequence_nll(nnx.merge(graphdef, params), rows)
        return s / c

    @jax.jit
    def step_fn(params, opt_state, rows):
        loss, grads = jax.value_and_grad(loss_fn)(params, rows)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    rng = np.random.default_rng(tc.seed)
    hist = {"loss": [], "steps": 0, "tokens": 0}
    log(f"model: {mc.num_params() / 1e6:.2f}M params; corpus {len(data)} bytes "
        f"(train {len(train_split)}, held-out {len(held)}); {tc.batch_size}x{tc.seq_len} bytes per step")
    t0 = time.perf_counter()
    t_compiled = None
    step = 0
    while step < tc.steps:
        elapsed = time.perf_counter() - t0
        if tc.seconds is not None and elapsed >= tc.seconds:
            log(f"wall-clock cap of {tc.seconds:.0f}s reached at step {step}")
            break
        progress = step / tc.steps
        if tc.seconds is not None:
            progress = max(progress, elapsed / tc.seconds)
        lr = learning_rate(tc, step, progress)
        opt_state[1].hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        rows = jnp.asarray(train_batch(train_split, rng, tc.batch_size, tc.seq_len))
        params, opt_state, loss, gnorm = step_fn(params, opt_state, rows)
        step += 1
        if t_compiled is None:
            loss.block_until_ready()
            t_compiled = time.perf_counter()
            log(f"compiled + first step in {t_compiled - t0:.1f}s")
        if step % tc.log_every == 0 or step == 1:
            lv = float(loss)
            hist["loss"].append((step, lv))
            log(f"step {step:5d}  loss {lv:.4f}  ({lv / math.log(2):.3f} bits/byte)  gnorm {float(gnorm):.2f}  "
                f"lr {lr:.2e}  {time.perf_counter() - t0:.0f}s")
        if tc.eval_every and step % tc.eval_every == 0:
            nnx.update(model, params)
            log(f"step {step:5d}  held-out ppl {heldout_perplexity(model, held, tc.seq_len):.3f}")
    jax.block_until_ready(params)
    hist["steps"] = step
    hist["tokens"] = step * tc.batch_size * tc.seq_len
    hist["train_seconds"] = time.perf_counter() - t0
    nnx.update(model, params)
    return model, hist


# ---- checkpoint & sampling ---------------------------------------------------------------------------------
def save_tiny(model: LlamaModel, out_dir: str | Path, dtype: str = "bfloat16") -> None:
    """Save weights (cast to `dtype`) with `save_model`, plus the byte tokenizer marker file."""
    from nfjax.checkpoint.orbax_io import save_model
    out = Path(out_dir)
    if model.cfg.dtype != dtype:
        cast = nnx.eval_shape(lambda: LlamaModel(model.cfg.replace(dtype=dtype), nnx.Rngs(0)))
        state = nnx.state(cast, nnx.Param)
        pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        pure = jax.tree.map(lambda a: jnp.asarray(a, jnp.dtype(dtype)), pure)
        nnx.replace_by_pure_dict(state, pure)
        nnx.update(cast, state)
        model = cast
    if (out / "params").exists():      # `run` only lets this happen to an earlier train-tiny output
        import shutil
        shutil.rmtree(out / "params")
    save_model(model, out)
    save_byte_tokenizer(out)


def sample(model: LlamaModel, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 300,
           temperature: float = 0.0, seed: int = 0) -> str:
    """Generate with the reference forward (the one training used), stopping at EOS."""
    out = reference.generate(model, tokenizer.encode(prompt), max_new_tokens, temperature=temperature, seed=seed,
                             stop_ids=tokenizer.eos_token_ids)
    return tokenizer.decode(out)


# ---- CLI ----------------------------------------------------------------------------------------------------
def add_parser(sub, name: str) -> None:
    d = TrainConfig()
    p = sub.add_parser(name, help="train the tiny byte-level Llama on pydoc_data/topics.py and save it",
                       description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, metavar="DIR",
                   help=f"checkpoint folder (required: no default, so the shipped model, {DEFAULT_OUT}, is "
                        "replaced only when named)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=None, help="wall-clock cap on training")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--clip-norm", type=float, default=d.clip_norm)
    p.add_argument("--heldout-frac", type=float, default=d.heldout_frac)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--log-every", type=int, default=d.log_every)
    m = tiny_model_config()
    p.add_argument("--hidden-size", type=int, default=m.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=m.intermediate_size)
    p.add_argument("--num-layers", type=int, default=m.num_layers)
    p.add_argument("--num-heads", type=int, default=m.num_heads)
    p.add_argument("--num-kv-heads", type=int, default=m.num_kv_heads)
    p.add_argument("--head-dim", type=int, default=m.head_dim)
    p.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the saved weights (default: %(default)s)")
    p.add_argument("--sample-prompt", default="Once upon a time",
                   help="prompt for the greedy sample printed at the end ('' to skip)")
    p.add_argument("--sample-tokens", type=int, default=300)
    p.add_argument("--summary-json", default=None,
                   help="where to write the run summary (default: OUT/training_summary.json)")


def run(args) -> int:
    for flag in ("steps", "batch_size", "seq_len", "warmup_steps", "hidden_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "intermediate_size"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if not 0 < args.heldout_frac < 1:
        raise UserError(f"--heldout-frac must be in (0, 1), got {args.heldout_frac}")
    if args.seconds is not None and args.seconds <= 0:
        raise UserError(f"--seconds must be positive, got {args.seconds}")
    tc = TrainConfig(steps=args.steps, seconds=args.seconds, batch_size=args.batch_size, seq_len=args.seq_len,
                     lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps,
                     weight_decay=args.weight_decay, clip_norm=args.clip_norm, heldout_frac=args.heldout_frac,
                     seed=args.seed, eval_every=args.eval_every, log_every=args.log_every)
    mc = tiny_model_config(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                           num_layers=args.num_layers, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                           head_dim=args.head_dim, max_position_embeddings=max(1024, args.seq_len))
    out = Path(args.out)
    if (out / "params").exists() and not (out / "nfjax_tokenizer.json").exists():
        raise UserError(f"--out {out} holds a checkpoint that train-tiny did not write; refusing to overwrite it")
    log = lambda s: print(s, flush=True)   # noqa: E731
    data = load_corpus()
    model, hist = train(tc, mc, log, data)
    save_tiny(model, out, args.save_dtype)
    log(f"saved {out}")

    from nfjax.checkpoint.orbax_io import load_model
    shipped = load_model(out, dtype="float32")          # the saved (possibly bf16-rounded) weights
    _, held = split_corpus(data, tc.heldout_frac)
    ppl = heldout_perplexity(shipped, held, tc.seq_len)
    log(f"held-out perplexity (per byte, saved weights): {ppl:.4f}  ({math.log2(ppl):.4f} bits/byte)")
    summary = {"heldout_ppl_per_byte": ppl, "bits_per_byte": math.log2(ppl), "steps": hist["steps"],
               "train_seconds": round(hist["train_seconds"], 1), "train_bytes_seen": hist["tokens"],
               "final_train_loss": hist["loss"][-1][1] if hist["loss"] else None,
               "corpus_source": corpus_source(), "corpus_bytes": len(data),
               "corpus_sha256": hashlib.sha256(data).hexdigest(), "train_config": asdict(tc),
               "model_config": mc.to_json(), "save_dtype": args.save_dtype, "jax": jax.__version__}
    if args.sample_prompt:
        text = sample(shipped, ByteTokenizer(), args.sample_prompt, args.sample_tokens)
        summary["sample_greedy"] = args.sample_prompt + text
        log(f"greedy sample: {args.sample_prompt + text!r}")
    summary_path = Path(args.summary_json) if args.summary_json else out / "training_summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    log(f"summary: {summary_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m nfjax.train_tiny ...`: the same as `nfjax train-tiny ...`."""
    import argparse
    import sys
    from nfjax.cli import run_command
    parser = argparse.ArgumentParser(prog="nfjax")
    add_parser(parser.add_subparsers(dest="command", required=True), "train-tiny")
    args = parser.parse_args(["train-tiny", *(sys.argv[1:] if argv is None else argv)])
    return run_command(run, args, "nfjax train-tiny")


if __name__ == "__main__":
    raise SystemExit(main())
