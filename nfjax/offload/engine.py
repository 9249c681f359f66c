"""`OffloadEngine`: FlexGen mode behind the engine's `generate` API, for models larger than the GPU.

Prompts run in blocks of `gpu_batch_size x num_gpu_batches` sequences (static batching, FlexGen's setting):
the block's prefill is one pass of every layer over every GPU batch, then each generated token is another
pass (nfjax/offload/schedule.py), until every sequence of the block has finished. Weights, KV cache and
activations live in the tiers the `Policy` gives them (nfjax/offload/store.py); the budget is checked before
any weight is placed (nfjax/offload/budget.py). Tokens are sampled by the engine's sampler with the engine's
per-request seeds and counters, so a greedy or seeded request gets the tokens the paged engine gives it.
Not served here (a UserError naming the field): penalties, min_tokens, logprobs.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nfjax.engine.detok import OutputText
from nfjax.engine.outputs import RequestOutput
from nfjax.engine.prompt import encode_prompt
from nfjax.engine.request import Timings
from nfjax.engine.sampling_params import SamplingParams
from nfjax.errors import UserError
from nfjax.offload import budget
from nfjax.offload.compute import Programs
from nfjax.offload.policy import Policy
from nfjax.offload.schedule import Executor, KVStore
from nfjax.offload.store import DiskFolder, Tiers, WeightStore, check_interrupt
from nfjax.offload.trace import Trace

PREFILL_ALIGN = 16          # prefill passes are padded to a multiple of this many tokens (fewer compiles)


def default_offload_dir() -> Path:
    from nfjax.checkpoint.models import cache_dir
    return cache_dir() / "offload"


def same_placement(a: Policy, b: Policy) -> bool:
    """Policies whose weights are placed alike (split, 4-bit, host memory kind) and live off the disk (a disk
    tier's files belong to the engine that wrote them)."""
    return (a.weights == b.weights and a.compress_weights == b.compress_weights and a.host_memory == b.host_memory
            and a.weights.disk == 0)


class OffloadEngine:
    def __init__(self, cfg, rest_state, layer_gd, layer_source, tokenizer, policy: Policy, max_model_len: int | None
                 = None, rest_gd=None, trace: bool = False, progress: bool = False,
                 weights_from: "OffloadEngine | None" = None, programs: Programs | None = None):
        """`layer_source(j)` gives decoder layer j's weights (a pytree of arrays anywhere, as
        `nnx.split(layer)` has them); `rest_gd/rest_state` the model without its layers (kept on the device).
        The policy's budget is checked first: nothing is placed if it does not fit. `weights_from`: an engine
        (closed or not) of the same model whose weights were placed the same way (`same_placement`): its placed
        weights are taken as they are instead of placing them again (the benches' policy grids). `programs`: the
        compiled programs of an engine of the same model and Top-K (`Programs` depends on nothing else), so a
        bench's engines compile each shape once."""
        self.cfg, self.policy, self.tokenizer = cfg, policy, tokenizer
        self.disk = None
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.device = jax.devices()[0]
        root = Path(policy.offload_dir) if policy.offload_dir else default_offload_dir()
        self.tier_bytes = budget.check(cfg, policy, self.max_model_len, budget.caps(policy, self.device, root))
        self.disk = DiskFolder(root) if policy.uses_disk() else None
        try:
            self.tiers = Tiers(policy, self.device, self.disk)
            if weights_from is not None and same_placement(weights_from.policy, policy):
                self.rest_state = weights_from.rest_state
                self.weights = copy.copy(weights_from.weights)
                self.weights.tiers = self.tiers
            else:
                self.rest_state = jax.device_put(rest_state, self.tiers.on_device)
                first = layer_source(0)
                leaves, treedef = jax.tree_util.tree_flatten(first)
                itemsize = 2 if cfg.dtype == "bfloat16" else 4
                self.weights = WeightStore(policy, self.tiers, treedef, [tuple(x.shape) for x in leaves], itemsize)
                for j in range(cfg.num_layers):
                    check_interrupt()
                    self.weights.put(j, jax.tree_util.tree_leaves(first if j == 0 else layer_source(j)))
                    first = None
            self.programs = programs if programs is not None else \
                Programs(cfg, rest_gd, layer_gd, topk=policy.attention_topk / 100)
            self.trace = Trace() if trace else None
            self.executor = Executor(policy, self.programs, self.weights, self.trace)
        except BaseException:
            self.close()
            raise
        self._ids = 0

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_model(cls, model, tokenizer, policy: Policy, **kw) -> "OffloadEngine":
        """From an in-memory model (its layers stacked on a leading axis, any device)."""
        from nfjax.engine.step_programs import split_layers
        rest_gd, rest_state, layer_gd, stacked = split_layers(model)
        return cls(model.cfg, rest_state, layer_gd, lambda j: jax.tree.map(lambda a: a[j], stacked), tokenizer,
                   policy, rest_gd=rest_gd, **kw)

    @classmethod
    def from_pretrained(cls, path: str | Path | None, policy: Policy, dtype: str | None = None, **kw):
        """A checkpoint folder (None: the shipped tiny model), read into host memory, then placed by the policy
        (so the model needs host memory, not GPU memory, to load)."""
        from jax.sharding import SingleDeviceSharding

        from nfjax.checkpoint.models import resolve
        from nfjax.checkpoint.orbax_io import load_config, load_model
        from nfjax.engine.engine import TINY_MODEL
        from nfjax.tokenizer import load_tokenizer
        path = Path(resolve(path)) if path is not None else TINY_MODEL
        if not path.is_dir():
            raise UserError(f"{path}: no such model folder")
        cfg = load_config(path)
        if dtype is not None:
            cfg = cfg.replace(dtype=dtype)
        budget.check(cfg, policy, min(kw.get("max_model_len") or cfg.max_position_embeddings,
                                      cfg.max_position_embeddings),
                     budget.caps(policy, jax.devices()[0], Path(policy.offload_dir or default_offload_dir())))
        host = SingleDeviceSharding(jax.devices("cpu")[0])
        model = load_model(path, dtype=dtype, sharding_fn=lambda k, x: host)
        return cls.from_model(model, load_tokenizer(path, token_ids_only=True), policy, **kw)

    def close(self) -> None:
        """Stop the I/O threads, let go of the pinned KV blocks kept for the next call, and remove the disk tier's
        files."""
        ex = getattr(self, "executor", None)
        if getattr(self, "tiers", None) is not None:
            self.tiers.drop_kept()
        try:
            if ex is not None:
                ex.close()
            if getattr(self, "trace", None) is not None:
                self.trace.close()
        finally:
            if self.disk is not None:
                self.disk.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def capacity_line(self) -> str:
        p = self.policy
        tb = ", ".join(f"{t} {b / 1e9:.2f} GB" for t, b in self.tier_bytes.items() if b)
        return (f"offload: blocks of {p.gpu_batch_size} x {p.num_gpu_batches} sequences, {p.schedule}; weights "
                f"gpu/cpu/disk {p.weights.gpu:g}/{p.weights.cpu:g}/{p.weights.disk:g}%"
                f"{' (4-bit off the GPU)' if p.compress_weights else ''}, KV {p.cache.gpu:g}/{p.cache.cpu:g}/"
                f"{p.cache.disk:g}%, activations {p.activations.gpu:g}/{p.activations.cpu:g}/"
                f"{p.activations.disk:g}%; {tb}; context {self.max_model_len:,}")

    # ---- requests -----------------------------------------------------------------------------------------------
    def _encode(self, prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.cfg.vocab_size, self.max_model_len)

    @staticmethod
    def _check_params(p: SamplingParams) -> None:
        for f, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                       ("min_tokens", 0), ("logprobs", None)):
            if getattr(p, f) != off:
                raise UserError(f"{f}: not served in offload mode (--offload); leave it at {off!r}")

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion, block by block; one output per prompt, in order."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        plist_params = list(params) if isinstance(params, (list, tuple)) else [params] * len(plist)
        if len(plist_params) != len(plist):
            raise UserError(f"{len(plist_params)} sampling params for {len(plist)} prompts")
        reqs = []
        for prompt, p in zip(plist, plist_params):
            p = p or SamplingParams()
            self._check_params(p)
            seed = p.seed if p.seed is not None else int(np.random.default_rng().integers(2 ** 32))
            reqs.append((self._encode(prompt), p, seed))
        outs: list[RequestOutput] = []
        n = self.policy.block_size
        for i in range(0, len(reqs), n):
            outs += self._run_block(reqs[i:i + n])
        return outs

    def stream(self, prompt, params: SamplingParams | None = None):
        """The whole completion as one final output (offload mode generates a block at a time)."""
        yield from self.generate([prompt], params)

    # ---- one block ----------------------------------------------------------------------------------------------
    def _run_block(self, reqs) -> list[RequestOutput]:
        pol, cfg = self.policy, self.cfg
        bs, nb = pol.gpu_batch_size, pol.num_gpu_batches
        nrow = bs * nb
        lens = np.ones(nrow, np.int64)
        lens[:len(reqs)] = [len(ids) for ids, _, _ in reqs]
        limit = np.array([min(len(ids) + p.max_tokens, self.max_model_len) for ids, p, _ in reqs]
                         + [1] * (nrow - len(reqs)))
        s = int(-(-int(limit.max()) // PREFILL_ALIGN) * PREFILL_ALIGN)
        t = int(-(-int(lens.max()) // PREFILL_ALIGN) * PREFILL_ALIGN)
        tokens = np.zeros((nrow, t), np.int32)
        for r, (ids, _, _) in enumerate(reqs):
            tokens[r, :len(ids)] = ids
        temp = np.zeros(nrow, np.float32)
        top_k = np.zeros(nrow, np.int32)
        top_p = np.ones(nrow, np.float32)
        seeds = np.zeros(nrow, np.uint32)
        for r, (_, p, seed) in enumerate(reqs):
            temp[r], top_k[r], top_p[r], seeds[r] = p.temperature, p.top_k, p.top_p, seed & 0xFFFFFFFF
        any_sampled = bool((temp > 0).any())
        texts = [OutputText(self.tokenizer, p, ids) for ids, p, _ in reqs]
        timings = [Timings() for _ in reqs]
        outputs: list[list[int]] = [[] for _ in reqs]
        reasons: list[str | None] = [None] * len(reqs)
        kv = KVStore(pol, self.tiers, cfg.num_layers, (bs, s, cfg.num_kv_heads, cfg.head_dim),
                     jnp.dtype(cfg.dtype))
        dev = lambda a: self.tiers.to_device(a)                       # noqa: E731
        rows = [slice(k * bs, (k + 1) * bs) for k in range(nb)]
        eos = frozenset(cfg.eos_token_ids)
        try:
            pos = np.broadcast_to(np.arange(t, dtype=np.int32), (nrow, t)).copy()
            xs = [self.programs.embed(self.rest_state, dev(tokens[r]), dev(pos[r])) for r in rows]
            last = lens - 1
            step = 0
            while True:
                hs = self.executor.run(xs, [dev(pos[r]) for r in rows], [pos[r] for r in rows], kv)
                sampled = [self.programs.head[any_sampled](self.rest_state, h, dev(last[r].astype(np.int32)),
                                                           dev(temp[r]), dev(top_k[r]), dev(top_p[r]), dev(seeds[r]),
                                                           dev(np.full(bs, step, np.int32)))
                           for h, r in zip(hs, rows)]
                new = np.concatenate([np.asarray(x) for x in sampled])
                check_interrupt()
                now = time.perf_counter()
                for r, (ids, p, _) in enumerate(reqs):
                    if reasons[r] is not None:
                        continue
                    tok = int(new[r])
                    outputs[r].append(tok)
                    timings[r].first_token = timings[r].first_token or now
                    texts[r].add([tok])
                    if texts[r].stopped or tok in p.stop_token_ids or (not p.ignore_eos and tok in eos):
                        reasons[r] = "stop"
                    elif len(outputs[r]) >= p.max_tokens or len(ids) + len(outputs[r]) >= self.max_model_len:
                        reasons[r] = "length"
                    if reasons[r]:
                        timings[r].finished = now
                if all(x is not None for x in reasons):
                    break
                step += 1
                pos = np.minimum(lens + step - 1, s - 1).astype(np.int32)[:, None]
                last = np.zeros(nrow, np.int64)
                xs = [self.programs.embed(self.rest_state, dev(new[r, None].astype(np.int32)), dev(pos[r]))
                      for r in rows]
        finally:
            self.executor.drain()
            if self.trace is not None:
                self.trace.flush()
            kv.close()
        out = []
        for r, (ids, p, _) in enumerate(reqs):
            self._ids += 1
            texts[r].release(final=True)
            text = texts[r].text
            out.append(RequestOutput(f"offload-{self._ids}", ids, outputs[r], text, outputs[r], text, True,
                                     reasons[r], timings[r].as_dict()))
        return out

    # ---- perplexity -----------------------------------------------------------------------------------------------
    def token_logprobs(self, sequences: Sequence[Sequence[int]], argmax: bool = False) -> list:
        """For each token sequence, log p(token t+1 | tokens <= t) for t < len - 1, from one prefill pass through
        the policy's placement and schedule (compressed weights, Top-K attention included); with `argmax`,
        (those, the most likely token after each t) pairs."""
        pol, cfg = self.policy, self.cfg
        bs, nb = pol.gpu_batch_size, pol.num_gpu_batches
        out = []
        for i in range(0, len(sequences), bs * nb):
            chunk = [list(map(int, x)) for x in sequences[i:i + bs * nb]]
            t = int(-(-max(len(x) for x in chunk) // PREFILL_ALIGN) * PREFILL_ALIGN)
            toks = np.zeros((bs * nb, t), np.int32)
            for r, x in enumerate(chunk):
                toks[r, :len(x)] = x
            pos = np.broadcast_to(np.arange(t, dtype=np.int32), toks.shape).copy()
            kv = KVStore(pol, self.tiers, cfg.num_layers, (bs, t, cfg.num_kv_heads, cfg.head_dim),
                         jnp.dtype(cfg.dtype))
            rows = [slice(k * bs, (k + 1) * bs) for k in range(nb)]
            dev = self.tiers.to_device
            xs = [self.programs.embed(self.rest_state, dev(toks[r]), dev(pos[r])) for r in rows]
            try:
                hs = self.executor.run(xs, [dev(pos[r]) for r in rows], [pos[r] for r in rows], kv)
            finally:
                self.executor.drain()
                kv.close()
            tgt = np.concatenate([toks[:, 1:], np.zeros((toks.shape[0], 1), np.int32)], axis=1)
            res = [self.programs.token_logprobs(self.rest_state, h, dev(tgt[r])) for h, r in zip(hs, rows)]
            lp = np.concatenate([np.asarray(a) for a, _ in res])
            top = np.concatenate([np.asarray(b) for _, b in res])
            out += [(lp[r, :len(x) - 1], top[r, :len(x) - 1]) if argmax else lp[r, :len(x) - 1]
                    for r, x in enumerate(chunk)]
        return out


def from_flags(args, progress: bool = False) -> OffloadEngine:
    """`nfjax generate --offload POLICY.json|auto` (and the benches): the policy file, or the policy search (with
    `--gpu-memory-gb`, `--cpu-memory-gb`, `--disk-gb`, `--offload-dir`), `--model`, `--dtype` and
    `--max-model-len`; the paged engine's cache and batching flags do not apply here."""
    if hasattr(args, "port"):
        raise UserError("--offload runs offline batches (nfjax generate, the benches, OffloadEngine.generate); "
                        "the server does not serve offload mode yet")
    if (getattr(args, "tp", None) or 1) > 1:
        raise UserError("--tp with --offload: offload mode runs on one device")
    caps = {f: getattr(args, f, None) for f in ("gpu_memory_gb", "cpu_memory_gb", "disk_gb", "offload_dir")}
    max_len = getattr(args, "max_model_len", None)
    if args.offload != "auto":
        policy = Policy.load(args.offload)
        set_caps = {f: v for f, v in caps.items() if v is not None}
        if set_caps:
            policy = policy.replace(**set_caps)          # the flags override the file's caps
    else:
        policy, max_len = _auto(args, Policy(**caps), max_len)
    return OffloadEngine.from_pretrained(getattr(args, "model", None), policy, dtype=getattr(args, "dtype", None),
                                         max_model_len=max_len, progress=progress)


def _auto(args, base: Policy, max_len: int | None) -> tuple[Policy, int]:
    """`--offload auto`: the workload from the prompts (their longest, in tokens) and `--max-tokens`, at most as
    many sequences a block as there are prompts; solve, log, return the policy and the context it was solved for."""
    import json
    import sys

    from nfjax.checkpoint.models import resolve
    from nfjax.checkpoint.orbax_io import load_config
    from nfjax.engine.engine import TINY_MODEL
    from nfjax.offload.cost_model import Workload
    from nfjax.offload.search import auto_policy
    from nfjax.tokenizer import load_tokenizer
    model = getattr(args, "model", None)
    path = Path(resolve(model)) if model is not None else TINY_MODEL
    if not path.is_dir():
        raise UserError(f"{path}: no such model folder")
    cfg = load_config(path)
    if getattr(args, "dtype", None):
        cfg = cfg.replace(dtype=args.dtype)
    prompts = list(getattr(args, "prompts", None) or [])
    gen = int(getattr(args, "max_tokens", None) or 32)
    if getattr(args, "token_ids", False):
        plen = max((len(p.replace(",", " ").split()) for p in prompts), default=1)
    elif prompts:
        tok = load_tokenizer(path, token_ids_only=True)
        plen = max(len(tok.encode(p)) for p in prompts)
    else:
        plen = max(1, (max_len or cfg.max_position_embeddings) - gen)
    ctx = min(max_len or plen + gen, cfg.max_position_embeddings)
    log = lambda m: print(f"[{m}]", file=sys.stderr, flush=True)            # noqa: E731
    res = auto_policy(cfg, Workload(min(plen, ctx - 1), min(gen, ctx - plen) if ctx > plen else 1, ctx), base,
                      remeasure=bool(getattr(args, "remeasure_hardware", False)), max_block=len(prompts) or None,
                      log=log)
    log("offload auto policy: " + json.dumps(res.policy.to_json()))
    return res.policy, ctx
