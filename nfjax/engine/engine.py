"""`Engine`: the user-facing API over scheduler + runner (continuous batching, async one-step-ahead loop)."""
from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Iterator, Sequence

from nfjax.compat import on_gpu
from nfjax.config import EngineConfig
from nfjax.engine.detok import OutputText
from nfjax.engine.outputs import RequestOutput, TokenLogprob
from nfjax.engine.penalties import MAX_BANNED, banned_ids
from nfjax.engine.prompt import Prompt, encode_prompt
from nfjax.engine.request import Request
from nfjax.engine.runner import Runner, StepHandle
from nfjax.engine.sampling_params import SamplingParams
from nfjax.engine.batcher import Batcher
from nfjax.engine.trace import StepTrace
from nfjax.engine.warm_up import warm_up
from nfjax.errors import UserError
from nfjax.kv.host_pool import start_pool

TINY_MODEL = Path(__file__).resolve().parent.parent / "assets" / "tiny"


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig, progress: bool = False, mesh=None,
                 take_weights: bool = True):
        """`model` may live anywhere: its weights are moved to their TP shardings here if not already.
        `take_weights`: the engine keeps the only copy of the layer weights (the model's own arrays are freed,
        so a large model fits once); False leaves `model` usable (tests reuse one model for several engines)."""
        from nfjax.parallel import make_mesh, replicate_kv_heads, shard_model, tp_config
        tp = config.parallel.tp
        mesh = mesh or make_mesh(tp)
        tp_config(model.cfg, tp)                      # clear error for head counts tp cannot split
        if tp > model.cfg.num_kv_heads:
            replicate_kv_heads(model, tp, mesh)
        shard_model(model, mesh)
        self.tokenizer = tokenizer
        self.model_config = config.model
        self.runner = Runner(model, config, mesh, take_weights=take_weights)
        self.config = config = self.runner.config      # automatic sizes resolved
        pool = start_pool(self.runner)                 # the host tier's pinned pool, allocated while compiling
        self.runner.compile_all(progress=progress)
        self.warm_up_seconds = 0.0
        if on_gpu():        # first launches (command buffers instantiated) at start, not in a request's step
            self.warm_up_seconds = warm_up(self.runner)
        self.batcher = Batcher(config)
        self.batcher.tiers = self._make_tiers(pool)
        self.trace = StepTrace()
        self._requests: dict[str, Request] = {}
        self._inflight: StepHandle | None = None
        self._evicting: list = []                # (steps launched before, [(hash, row)]) on their way to the host
        self._launches = self._reads = 0         # steps launched / read back so far
        self._ids = itertools.count()
        self._rng = random.Random()
        self.preemptions = 0
        self._eos = frozenset(config.model.eos_token_ids)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, dtype: str | None = None, progress: bool = False,
                        config: dict | None = None, **settings) -> "Engine":
        """Load an nfjax checkpoint (no path: the shipped tiny model) and compile every bucket.

        `config`: engine settings as {section: {field: value}} (sections cache, batcher, execution, parallel);
        `settings`: the same by flag name (page_size=, num_pages=, token_buckets=, max_seqs=, tp=, strategies=,
        plan=, ...; see `nfjax.engine.builder.add_engine_args`), applied over `config`.
        """
        from nfjax.engine.builder import SETTINGS, build_engine, overrides_from_args
        bad = sorted(set(settings) - SETTINGS)
        if bad:
            raise UserError(f"from_pretrained: unknown engine setting {bad[0]!r}; settings are "
                            f"{', '.join(sorted(SETTINGS))}")
        overrides = {k: dict(v) for k, v in (config or {}).items()}
        for section, vals in overrides_from_args(settings).items():
            overrides.setdefault(section, {}).update(vals)
        return build_engine(path, overrides, dtype=dtype, progress=progress)

    def _make_tiers(self, pool=None):
        """The prefix cache's host tier (and disk tier below it) when configured, with the rates that decide
        which of them a hit is taken from (nfjax/kv/tiers.py, `TierRates`)."""
        from nfjax.kv.tiers import HostTier, PrefixTiers
        c, copies = self.config.cache, self.runner.tier_copies
        if copies is None:
            return None
        stats, row = self.batcher.stats, copies.row_bytes
        disk = None
        if c.disk_cache_dir:
            from nfjax.kv.disk_tier import DiskTier
            disk = DiskTier(c.disk_cache_dir, int(c.disk_cache_gb * 2 ** 30) // row, row, stats,
                            self._tier_fingerprint(), background=True)
        capacity = int(c.host_cache_gb * 2 ** 30) // row
        tiers = PrefixTiers(HostTier(capacity, row, stats, spill=disk), disk, rates=self._tier_rates())
        if tiers.use_host and copies.pinned and capacity:     # `pool`: its array, allocating since start_pool
            copies.attach_pool(capacity, c.max_pages_per_seq, alloc=pool, disk=disk is not None)
            if copies.pool is not None:
                stats.pinned_reserve_s, stats.pinned_reserve_wait_s = copies.pool.alloc_s, copies.pool.alloc_wait_s
        else:                                  # the copy programs this engine runs, compiled now (none in a step)
            copies.prepare(disk=disk is not None)
        return tiers

    def _tier_rates(self, **overrides):
        """Recompute against load rates: the backend's defaults (nfjax/kv/tiers.py DEFAULT_RATES), on a GPU the
        host tier's host->device rate measured once here (a few ms), then `overrides` (gemm_flops,
        host_bytes_s, disk_bytes_s; CacheConfig fields tier_gemm_tflops / tier_host_gbps / tier_disk_gbps
        where a config has them)."""
        from nfjax.kv.tiers import DEFAULT_RATES, TierRates, flops_per_token
        copies, m, c = self.runner.tier_copies, self.model_config, self.config.cache
        d = DEFAULT_RATES["gpu" if on_gpu() else "cpu"]
        source = {"gemm_flops": "default", "host_bytes_s": "default", "disk_bytes_s": "default"}
        host = d["pinned_bytes_s"] if copies.pinned else d["host_bytes_s"]
        if on_gpu():
            measured = self._measure_tier_h2d()
            if measured:
                host, source["host_bytes_s"] = measured, "measured"
        vals = {"gemm_flops": d["gemm_flops"] * self.runner.mesh.size, "host_bytes_s": host,
                "disk_bytes_s": d["disk_bytes_s"]}
        for key, field, scale in (("gemm_flops", "tier_gemm_tflops", 1e12), ("host_bytes_s", "tier_host_gbps", 1e9),
                                  ("disk_bytes_s", "tier_disk_gbps", 1e9)):
            if getattr(c, field, None):
                vals[key], source[key] = getattr(c, field) * scale, "configured"
        for key, v in overrides.items():
            if v is not None:
                vals[key], source[key] = float(v), "configured"
        pageable = d["host_bytes_s"] if copies.pinned else None     # disk rows are numpy, pinned or not
        return TierRates(c.page_size, copies.row_bytes, flops_per_token(m), source=source,
                         disk_h2d_bytes_s=pageable, **vals)

    def _measure_tier_h2d(self) -> float | None:
        """Bytes/s of loading host rows as the tier does (16 rows, one device_put), best of 3; None on error."""
        import jax
        import numpy as np
        copies = self.runner.tier_copies
        n = max(1, min(16, (64 << 20) // copies.row_bytes))
        try:
            rows = [np.zeros(copies.row_bytes, np.uint8) for _ in range(n)]
            if copies.pinned:
                rows = jax.device_put(rows, copies.host_sharding)
                jax.block_until_ready(rows)
            best = None
            for _ in range(4):
                t0 = time.perf_counter()
                jax.block_until_ready(jax.device_put(rows, copies.replicated))
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            return n * copies.row_bytes / best
        except Exception:  # noqa: BLE001 - not measured: the defaults stand
            return None

    def set_tier_rates(self, gemm_flops: float | None = None, host_bytes_s: float | None = None,
                       disk_bytes_s: float | None = None) -> None:
        """Replace the rates that decide whether a tier hit beats recomputing (None: as at start)."""
        tiers = self.batcher.tiers
        if tiers is not None:
            tiers.set_rates(self._tier_rates(gemm_flops=gemm_flops, host_bytes_s=host_bytes_s,
                                             disk_bytes_s=disk_bytes_s))

    def tier_line(self) -> str | None:
        """The tiers' rule in one line (rates, what is used), None without tiers."""
        t = self.batcher.tiers
        if t is None or t.rates is None:
            return None
        copies = self.runner.tier_copies
        mem = "pinned_host arrays" if copies.pinned else "numpy"
        if copies.pool is not None:
            mem = (f"a pinned_host pool of {copies.pool.capacity:,} rows "
                   f"({copies.pool.capacity * copies.row_bytes / 2 ** 30:.3g} GiB) allocated in "
                   f"{self.batcher.stats.pinned_reserve_s:.1f} s ({copies.pool.alloc_method}; start waited "
                   f"{copies.pool.alloc_wait_s:.1f} s)")
        return f"{t.rates.line()} [host rows: {mem}]"

    def _tier_fingerprint(self) -> bytes:
        """What a disk-tier file's pages depend on besides their tokens: the model, the KV format and layout."""
        import hashlib
        c = self.config.cache
        desc = repr((self.model_config, c.kv_dtype, c.page_size, self.runner.tier_copies.row_bytes))
        return hashlib.blake2b(desc.encode(), digest_size=16).digest()

    def prefix_stats(self) -> dict:
        """Prefix cache counters since start: prompt tokens, reused tokens per tier, hit rate, bytes moved, the
        engine's seconds in tier loads and evictions, and the tiers' rule (nfjax/kv/tiers.py)."""
        disk = self.batcher.tiers.disk if self.batcher.tiers is not None else None
        if disk is not None and not self.has_unfinished():
            disk.flush()              # idle: the background writer's pages counted (a server reads this each step)
        d = self.batcher.stats.as_dict()
        a, t = self.batcher.allocator, self.batcher.tiers
        d.update(enabled=a.prefix, gpu_cached_pages=a.num_cached,
                 host_pages=len(t.host) if t else 0, disk_pages=len(t.disk) if t and t.disk else 0)
        if t is not None:
            d.update(t.stats_dict())
        c = self.runner.tier_copies
        if c is not None:             # rows moved each way, and reads of evicted rows that waited for a step (0)
            d.update(rows_to_host=c.rows_to_host, rows_from_host=c.rows_from_host, tier_step_waits=c.step_waits,
                     host_rows_pinned=c.pinned)
        return d

    def close(self) -> None:
        """Release the disk tier's folder (its lock)."""
        if self.batcher.tiers is not None:
            self._settle_evictions()
            self.batcher.tiers.close()

    def _evict_to_host(self, evict: list) -> None:
        """Start copying evicted cached pages to the host tier, before this step's writes may reuse them: the
        gathers are launched ahead of the step (one device stream: they read the pages first) and their
        device->host copies run beside it. The host tier holds the rows at once (pinned arrays or lazy numpy
        rows, still coming); nothing is waited for here (the rows used to be read back at once, which waited for
        the step in flight: a sync point that broke the one-step-ahead loop at every eviction). Where the host
        tier cannot beat recomputing (`PrefixTiers.use_host`), the pages are dropped, not copied."""
        t0 = time.perf_counter()
        tiers, stats = self.batcher.tiers, self.batcher.stats
        if not tiers.use_host:
            stats.evictions_dropped += len(evict)
            return
        evict = tiers.admit(evict)              # only pages whose copy is expected to pay (nfjax/kv/tier_admission.py)
        copies, wanted = self.runner.tier_copies, len(evict)
        if copies.pool is not None:
            evict = evict[-tiers.host.capacity:]        # a pool exists only for a tier of >= 1 row
            # rows this batch takes out of the tier for its loads keep their slots until the loads launch
            tiers.host.make_room(len(evict), free=lambda: copies.pool.num_free)
        rows = copies.to_host_async(self.runner.kv, [p for p, _ in evict], self._launches, lambda: self._reads)
        stats.evict_launch_s += time.perf_counter() - t0
        stats.evictions_dropped += wanted - len(rows)
        lazy = [(h, row) for (_, h), row in zip(evict, rows)]
        for h, row in lazy:
            tiers.put(h, row)
        if copies.pool is None:         # pool rows need no settling (and would hold their slots meanwhile)
            self._evicting.append((self._launches, lazy))
        stats.evict_s += time.perf_counter() - t0

    def _settle_evictions(self, all_: bool = True) -> None:
        """Rows still coming replaced by their bytes (lazy numpy rows; pinned rows are left as they are) and
        the host tier spilled to disk as far as it can. From `step`, after its read: only copies launched
        before the step just read (they had that whole step to finish)."""
        t0 = time.perf_counter()
        keep = []
        for launched, lazy in self._evicting:
            if not all_ and launched >= self._reads:
                keep.append((launched, lazy))
                continue
            for h, row in lazy:
                self.batcher.tiers.host.settle(h, row)
        self._evicting = keep
        self.batcher.stats.evict_s += time.perf_counter() - t0

    def _load_from_tiers(self, loads: list) -> None:
        """Tier hits into their fresh pages: a host->device copy and an on-device scatter per run."""
        t0 = time.perf_counter()
        rows = [r for _, r in loads]
        self.runner.pages_from_host([p for p, _ in loads], rows)
        self.batcher.stats.bytes_from_host += sum(r.nbytes for r in rows)
        self.batcher.stats.tier_load_s += time.perf_counter() - t0

    # ---- request API (server-facing; not thread-safe: call from one thread) -----------------------
    @property
    def max_model_len(self) -> int:
        return self.batcher.max_model_len

    def _encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.model_config.vocab_size, self.max_model_len)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        ids = self._encode(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise UserError(f"request id {rid!r} is already in use")
        if params.min_tokens and len(banned_ids(params, self._eos)) > MAX_BANNED:
            raise UserError(f"stop_token_ids: with min_tokens, at most {MAX_BANNED} ids (the model's EOS ids "
                            "included unless ignore_eos) can be held back")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        req = Request(rid, ids, params, seed)
        req.out_text = OutputText(self.tokenizer, params, ids)
        self._requests[rid] = req
        self.batcher.add(req)
        return rid

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.batcher.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.batcher.has_work() or self._inflight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.batcher.waiting)

    @property
    def num_running(self) -> int:
        return len(self.batcher.running) + len(self.batcher.swapped)

    @property
    def pages_used(self) -> int:
        return self.batcher.pages_used

    @property
    def pages_total(self) -> int:
        return self.batcher.allocator.capacity

    def capacity_line(self) -> str:
        """What the resolved config holds, in one line (printed by the CLI at start)."""
        c, b = self.config.cache, self.config.batcher
        kv = "" if c.kv_dtype == "bfloat16" else f" ({c.kv_dtype})"
        return (f"KV cache{kv}: {self.pages_total:,} pages of {c.page_size} = {self.pages_total * c.page_size:,} tokens; "
                f"context {c.max_model_len:,}; up to {b.max_seqs} sequences a step; token buckets "
                f"{','.join(map(str, b.token_buckets))}" + (f"; prefill-only steps up to {b.prefill_bucket} tokens"
                                                            if b.prefill_bucket else ""))

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step, then read the previous one's tokens (one step late) and return outputs."""
        t0, c0 = time.perf_counter(), time.thread_time()
        prev = self._inflight
        slots = {} if prev is None else {sq.req.request_id: i for i, sq in enumerate(prev.batch.seqs) if sq.samples}
        batch = self.batcher.next_batch(slots)
        handle = None
        if batch is not None:
            if batch.evict:                        # reads of pages this step may overwrite come first
                self._evict_to_host(batch.evict)
            for req, pages in batch.swap_out:
                req.host_kv = self.runner.swap_out(pages)
                self.preemptions += 1
            for req in batch.swap_in:
                self.runner.swap_in(req.host_kv, req.pages)
                req.host_kv = None
            if batch.loads:
                self._load_from_tiers(batch.loads)
            for req in batch.prefix_seeds:
                self.runner.seed_penalty_slot(req.penalty_slot, req.prompt_ids)
            handle = self.runner.launch(batch) if batch.seqs else None
            if handle is not None:
                self._launches += 1
                handle.host_ms = (time.perf_counter() - t0) * 1e3
                handle.host_cpu_ms = (time.thread_time() - c0) * 1e3
        self._inflight = handle
        if prev is None:
            return []
        t1, c1 = time.perf_counter(), time.thread_time()
        tokens = self.runner.read(prev)
        self._reads += 1
        if self._evicting:
            self._settle_evictions(all_=False)
        logprobs = self.runner.read_logprobs(prev)
        t2, c2 = time.perf_counter(), time.thread_time()
        rec = self.trace.record(prev, t2 - prev.launched_at, (t2 - t1) * 1e3, (c2 - c1) * 1e3)
        outs = self._process(prev, tokens, logprobs)
        rec.process_ms = (time.perf_counter() - t2) * 1e3
        return outs

    def _process(self, handle: StepHandle, tokens, logprobs=None) -> list[RequestOutput]:
        """The step's tokens into its requests (text, stop strings, finishing) and an output per sampled row.
        Per row the cost does not grow with the output's length (outputs are views: `RequestOutput.view`)."""
        now = time.perf_counter()
        outs = []
        eos, max_len, view = self._eos, self.max_model_len, RequestOutput.view
        tokens = tokens.tolist()       # ints at once (per-row numpy scalars cost more than the rest of the row)
        if logprobs is not None:     # as lists once (per row from numpy took twice the host time, 256 rows x 20)
            lp_token, lp_ids, lp_top = logprobs.token.tolist(), logprobs.top_ids.tolist(), logprobs.top.tolist()
        for i, sq in enumerate(handle.batch.seqs):
            req = sq.req
            if not sq.samples or req.finished:
                continue          # a mid-prompt chunk, or a token past EOS / abort (dropped)
            tok = tokens[i]
            out_ids = req.output_ids
            out_ids.append(tok)
            n = len(out_ids)
            p = req.params
            new_lp = None
            if p.logprobs is not None:           # its step ran the full head (penalties.needs_full)
                k = p.logprobs
                new_lp = [TokenLogprob(tok, lp_token[i], tuple(zip(lp_ids[i][:k], lp_top[i][:k])))]
                req.logprobs.append(new_lp[0])
                req.cumulative_logprob += new_lp[0].logprob
            if n == 1:
                req.timings.first_token = now
            text = req.out_text
            text.add(tok, n > p.min_tokens)       # as vLLM: stop strings after min_tokens
            reason = None
            if n >= p.min_tokens and (text.stopped or tok in p.stop_token_ids or (not p.ignore_eos and tok in eos)):
                reason = "stop"
            elif n >= p.max_tokens or req.prompt_len + n >= max_len:
                reason = "length"
            if reason:
                self.batcher.finish(req, reason)
                req.timings.finished = now
                self._requests.pop(req.request_id, None)
            outs.append(view(req, [tok], text.release(final=reason is not None), new_lp))
        return outs

    # ---- offline API ------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                 = None, progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; one output per prompt, in order."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(plist)
        if len(params_list) != len(plist):
            raise UserError(f"{len(params_list)} sampling params for {len(plist)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(plist, params_list)]
        final: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generating", unit="req")
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
                    if bar:
                        bar.update(1)
        while self._inflight is not None:   # drain the one-step-late launch of finished requests
            self.step()
        if bar:
            bar.close()
        return [final[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield outputs for one prompt as tokens arrive (other queued requests advance too)."""
        rid = self.add_request(prompt, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            if rid in self._requests:
                self.abort(rid)
