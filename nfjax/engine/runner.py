"""Compiled step programs (all compiled at start) and their asynchronous launch.

A step is a few launches of compiled programs: `embed` (input tokens, some taken on device from the previous
step's samples), one *layer-group program* per `layers_per_program` consecutive layers, each layer's weights
its own arrays, and `head` (final norm, logits of each sequence's last token, sampling). Why not one program
for the step: a `lax.scan` over stacked layer weights made XLA copy every layer's weights before its GEMMs
(jax 0.10; on jax 0.11.2 the GEMMs read the slices in place, but the scanned step still ran 24.9 ms where
layer groups run 14.9, docs/design.md), and 32 layers unrolled in one program ran no faster than groups of 4
at twice the compile time. Decode-only batches of the plain step run programs without the prefill kernel.

The sampled tokens of a step stay on the device and feed the next step's decode inputs; the host reads a
step's tokens only after the next step has been launched.
"""
from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int

from nfjax.compat import NO_COMMAND_BUFFERS, NO_REMAT, on_gpu, use_compile_cache
from nfjax.config import EngineConfig, prefill_copy_pages
from nfjax.engine.batcher import Batch
from nfjax.engine.penalties import FullInput, Logprobs, PenaltyState, full_input, needs_full, num_penalty_slots
from nfjax.engine.step_input import StepInput, pack, stage, unpack_into
from nfjax.kv.cache import KVCache, device_memory, free_device_bytes
from nfjax.kv.metadata import AttentionMetadata, build_metadata
from nfjax.kv.tail_slots import TailCopies, TailSlots, tail_rows
from nfjax.kv.prefix_cache import TierCopies
from nfjax.models.fused import join_projections
from nfjax.models.llama import ForwardOptions, LlamaModel, sequential_layer_fn
from nfjax.models.rotation_fold import fold_v_rotation, folds
from nfjax.models.rope import inv_frequencies
from nfjax.parallel import TP_AXIS, kv_spec, state_specs, unstack_layers
from nfjax.engine.step_programs import (HEAD_MODES, embed_step, full_head_step, head_mode, head_step, layer_groups,
                                       layers_step, on_leaves, seed_slot, split_layers)


@dataclass
class StepHandle:
    batch: Batch
    sampled: jax.Array               # [S] on device
    launched_at: float
    logprobs: Logprobs | None = None  # on device, from the full head (penalties, min_tokens, logprobs)
    host_ms: float = 0.0             # host time spent forming and launching it, of which:
    put_ms: float = 0.0              #   copying its inputs to the device
    dispatch_ms: float = 0.0         #   enqueueing its programs
    host_cpu_ms: float = 0.0         # the engine thread's CPU time in host_ms (near host_ms: busy, not waiting)
    slowest_program: str = ""        # the program of the step whose enqueue took longest, and its ms
    slowest_program_ms: float = 0.0


KV_TRIES, KV_SHRINK = 5, 0.85     # an automatic KV size that does not fit: retried at 85% of the memory each time


class Runner:
    """Owns the weights, the KV arrays and the compiled programs. Nothing compiles after `compile_all`."""

    def __init__(self, model: LlamaModel, config: EngineConfig, mesh: Mesh, take_weights: bool = False):
        """`model`'s weights must already sit in their shardings on `mesh` (see nfjax.parallel). `config`'s
        automatic sizes are resolved here, where the free device memory is known (`self.config`).
        `config.execution`: the step variants (nano-batch strategies) compiled per bucket and chosen per batch.
        The layers run from per-layer copies of the weights; `take_weights` deletes the model's stacked layer
        arrays as they are copied (the model is unusable afterwards; `model()` rebuilds one)."""
        from nfjax.engine.builder import resolve
        from nfjax.schedule.graph import layer_graph
        from nfjax.schedule.variants import SEQUENTIAL, Variants
        self.cfg = model.cfg
        self.mesh = mesh
        tp = mesh.shape[TP_AXIS]
        self.rest_gd, self.rest_state, self.layer_gd, stacked = split_layers(model)
        self.layer_specs = jax.tree.map(lambda sp: P(*sp[1:]), state_specs(stacked, tp))
        self.layer_states = unstack_layers(stacked, self.layer_specs, mesh, release=take_weights)
        del stacked
        if config.execution.join_projections:      # q/k/v and gate/up one weight each (nfjax/models/fused.py)
            self._transform_layers(partial(join_projections, mesh=mesh,
                                           swiglu_epilogue=config.execution.swiglu_epilogue), tp)
        if config.execution.fold_v_rotation and folds(config.cache.kv_dtype):
            self._transform_layers(partial(fold_v_rotation, mesh=mesh, head_dim=model.cfg.head_dim), tp)
        # the free memory read below counts a deleted weight only once the copies reading it are done
        jax.block_until_ready(self.layer_states)
        self.memory_after_weights = device_memory()      # what the cache is sized from (benches record it)
        self.inv_freq = jnp.asarray(inv_frequencies(model.cfg), jnp.float32)
        self.replicated = NamedSharding(mesh, P())
        # sized after unstacking (its holes are what is left), the engine's largest allocations made now: one
        # that does not fit fails here, by name, not at a later step
        self.config = config = self._make_kv(config, resolve)
        cache, sched, sc = config.cache, config.batcher, config.execution
        skip_collectives = config.parallel.skip_collectives
        self.cache_cfg = cache
        self.sched = sched
        self.kv_sharding = self.kv.like(NamedSharding(mesh, kv_spec()))
        # kivi64: which K tail row holds each sequence's filling group (nfjax/kv/tail_slots.py)
        self.tails = TailSlots(self.kv.k_tail.shape[1]) if self.kv.k_tail is not None else None
        self.tail_copies: TailCopies | None = None
        self.max_seqs = sched.max_seqs
        self._prev = jax.device_put(jnp.zeros((self.max_seqs,), jnp.int32), self.replicated)
        self.penalty_slots = num_penalty_slots(self.max_seqs)
        self.penalty_state = PenaltyState.create(self.penalty_slots, model.cfg.vocab_size, self.replicated)
        self.last_logprobs: Logprobs | None = None      # the latest full head's, on device
        self.slowest_dispatch: tuple[str, float] = ("", 0.0)    # run_step's slowest program enqueue (name, s)
        self.variants = Variants(sc, sched.token_buckets, tp, graph=layer_graph(model.cfg),
                                 sequential_only=(sched.prefill_bucket,) if sched.prefill_bucket else ())
        self._layer_ids = [jax.device_put(jnp.int32(i), self.replicated) for i in range(model.cfg.num_layers)]
        g = max(1, min(sc.layers_per_program, model.cfg.num_layers))
        # Variants that split the batch run one layer per program: in a multi-layer program a later layer's
        # in-place cache writes for one nano-batch could be ordered before an earlier layer's cache reads for
        # another, and XLA copies the whole cache to keep them apart (seen in the HLO; an optimization
        # barrier does not prevent it). A program boundary orders them for free.
        self._groups = {lb: layer_groups(model.cfg.num_layers, 1 if v.splits else g)
                        for vs in self.variants.by_bucket.values() for lb, v in vs.items()}
        # the programs take the weights as flat tuples of arrays (`on_leaves`): the rest's, and each layer group's
        rest_leaves, self._rest_tdef = jax.tree.flatten(self.rest_state)
        self._rest_leaves = tuple(rest_leaves)
        self._group_args = {(i0, n): tuple(jax.tree.leaves(tuple(self.layer_states[i0:i0 + n])))
                            for gs in self._groups.values() for i0, n in gs}
        self.groups = self._groups[SEQUENTIAL]           # (first layer, count) of the plain step's programs
        self._embed: dict[int, object] = {}                  # bucket -> compiled embed program
        self._head: dict[tuple[int, str], object] = {}       # (bucket, HEAD_MODES entry) -> compiled head
        self._full_head: dict[int, object] = {}              # bucket -> head with penalties/min_tokens/logprobs
        self._stage: dict[int, object] = {}                  # bucket -> compiled copy into the staged inputs
        self._unpack: dict[int, object] = {}                 # bucket -> the same from one packed int32 vector
        self._staged: dict[int, StepInput] = {}              # bucket -> the step inputs' device buffers
        self.stable_inputs = sc.stable_inputs
        # (bucket, strategy label) -> compiled layer-group program; (bucket, label, n) for a shorter last group
        self._steps: dict[tuple, object] = {}
        self._decode_steps: dict[tuple, object] = {}          # the same for decode-only batches (Sequential)
        self.layer_fns: dict[tuple[int, str], object] = {}    # ... -> its layer_fn (layer_schedule, merges)
        self.pinned: str | None = None
        self.strategy_counts: dict[str, int] = {}             # steps launched per strategy label
        self._swap_out = None
        self._swap_in = None
        self.tier_copies: TierCopies | None = None      # the prefix tiers' page <-> row copies
        self._seed = None                         # fills a penalty slot with a prompt whose prefix was reused
        self.compile_seconds = 0.0
        self.lower_seconds = 0.0        # of compile_seconds: tracing and lowering on this thread
        self.opts = ForwardOptions(max_prefill_seqs=sched.max_prefill_seqs, skip_collectives=skip_collectives)
        self.xla_options = ({} if sc.command_buffers else dict(NO_COMMAND_BUFFERS)) | (
            {} if sc.xla_remat else dict(NO_REMAT))                                  # every step program's

    def whole_table_opts(self, meta: AttentionMetadata) -> ForwardOptions:
        """`opts` for a forward outside the step programs (inspection, the accuracy bench): where prefill reads a
        bfloat16 copy of its pages (fp8r always), one that holds every row's whole page table, since no batcher
        bounded these rows' pages."""
        if not prefill_copy_pages(self.config, max(self.config.batcher.token_buckets)):
            return self.opts
        return dataclasses.replace(self.opts, prefill_copy_pages=int(np.prod(meta.page_table.shape)))

    def prefill_copy_pages(self, bucket: int) -> int:
        """The bfloat16 copy's pages of `bucket`'s prefill attention (`execution.prefill_dequant_first` on a
        quantized cache the kernels read), else 0: the kernel reads the cache in place."""
        return prefill_copy_pages(self.config, self.sched.formation_budget(bucket))

    # ---- compilation ------------------------------------------------------------------------------
    def empty_input(self, bucket: int) -> StepInput:
        """A host step input of `bucket` tokens that holds no sequence: every token is padding (writes nothing)."""
        s, p, ps = self.sched.seqs_for(bucket), self.cache_cfg.max_pages_per_seq, self.cache_cfg.page_size
        meta = build_metadata([], bucket, s, p, ps)
        z = np.zeros(s, np.int32)
        return StepInput(np.zeros(bucket, np.int32), np.full(bucket, -1, np.int32), meta, z.astype(np.float32), z,
                         z.astype(np.float32) + 1, z.astype(np.uint32), z)

    def _example_input(self, bucket: int) -> StepInput:
        return self._to_device(self.empty_input(bucket))

    def _full_like(self, bucket: int) -> FullInput:
        return FullInput.empty(self.sched.seqs_for(bucket), bucket, self.penalty_slots, self.cfg.vocab_size)

    def _to_device(self, inp: StepInput) -> StepInput:
        return jax.device_put(inp, self.replicated)

    def put_input(self, bucket: int, inp: StepInput) -> StepInput:
        """A host `StepInput` on the device: with `stable_inputs`, one packed copy written into the bucket's
        staged buffers (nfjax/engine/step_input.py); else a device_put of every field."""
        if not self.stable_inputs:
            return self._to_device(inp)
        packed = jax.device_put(pack(inp), self.replicated)
        self._staged[bucket] = self._unpack[bucket](self._staged[bucket], packed)
        return self._staged[bucket]

    def _make_kv(self, config: EngineConfig, resolve) -> EngineConfig:
        """`config` resolved and its KV cache (`self.kv`) allocated. An automatic size that does not fit (free
        memory in holes: Mixtral's unstacked experts left 41.6 GiB free on an H200 but no block over 28 GiB,
        docs/design.md section 15) is retried at `KV_SHRINK` of the free memory each time, with a warning; a size
        given by --num-pages, or the last try, is a UserError."""
        free, auto = free_device_bytes(), config.cache.num_pages is None
        tries = KV_TRIES if auto and free is not None else 1
        for i in range(tries):
            resolved = resolve(config, None if free is None else int(free * KV_SHRINK ** i), on_gpu())
            cache = resolved.cache
            err = None
            try:
                self.kv = KVCache.create(self.cfg, cache, sharding=NamedSharding(self.mesh, kv_spec()),
                                         tail_rows=tail_rows(resolved.batcher.max_seqs))
                jax.block_until_ready(self.kv.arrays())
                if i:
                    import warnings
                    warnings.warn(f"the KV cache holds {cache.num_pages:,} pages, not the {first:,} the free device "
                                  f"memory allowed: no free block held them (--kv-memory-fraction, --num-pages)",
                                  RuntimeWarning, stacklevel=3)
                return resolved
            except Exception as e:  # noqa: BLE001 - the runtime's allocation error type differs across jax versions
                self.kv = None
                err = f"{type(e).__name__}: {str(e)[:200]}"
            if i == 0:
                first = cache.num_pages
        from nfjax.errors import UserError
        raise UserError(f"the KV cache ({cache.num_pages:,} pages) did not fit on the device: lower "
                        f"--kv-memory-fraction (now {cache.kv_memory_fraction}) or set --num-pages ({err})")

    def compile_all(self, progress: bool = False) -> None:
        """Lower every program and compile each on a thread pool as soon as it is lowered (XLA compiles outside the
        GIL, so compiling overlaps the lowering of the programs after it); the layer programs, the longest to
        compile, go first, the largest buckets' first."""
        from nfjax.schedule.variants import SEQUENTIAL
        t0 = time.perf_counter()
        if self.config.execution.compile_cache_dir:
            use_compile_cache(self.config.execution.compile_cache_dir)
        if self.config.execution.kernel_lowering_cache:
            from pallas_kernels import _lowering_cache
            if not _lowering_cache.enable():
                print(f"kernel_lowering_cache: this JAX's Pallas lowering is not the one the cache wraps "
                      f"({_lowering_cache.why_not()}); lowering each program's kernels as usual", flush=True)
        rep = self.replicated
        x_sh = jax.ShapeDtypeStruct((0, self.cfg.hidden_size), jnp.dtype(self.cfg.dtype), sharding=rep)
        xo = self.xla_options or None
        token_buckets = sorted(self.sched.token_buckets)
        buckets = sorted(self.sched.all_buckets)
        # the buckets a decode-only batch (at most max_seqs tokens) can land in
        decode_buckets = {b for b in token_buckets if b < self.max_seqs} | {
            min([b for b in token_buckets if b >= self.max_seqs], default=token_buckets[-1])}
        inputs = {b: self._example_input(b) for b in buckets}
        xs = {b: x_sh.update(shape=(b, self.cfg.hidden_size)) for b in buckets}
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=0, desc="compiling", unit="program")
        futures = []

        def compile_one(table, key, lowered, opts):
            table[key] = lowered.compile(compiler_options=opts)
            if bar is not None:
                bar.update(1)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            def submit(table: dict, key, lowered, opts: dict | None) -> None:
                futures.append(pool.submit(compile_one, table, key, lowered, opts))
                if bar is not None:
                    bar.total += 1
                    bar.refresh()

            for b in reversed(buckets):
                inp, x = inputs[b], xs[b]
                for v in self.variants.by_bucket[b].values():
                    self.layer_fns[(b, v.label)] = layer_fn = v.layer_fn()
                    opts = {**self.xla_options, **v.compiler_options()} or None
                    # Decode-only batches of the plain step also get programs without the prefill kernel.
                    decode = (False, True) if v.label == SEQUENTIAL and b in decode_buckets else (False,)
                    for dec in decode:
                        fwd = dataclasses.replace(self.opts, decode_only=dec,
                                                  max_prefill_seqs=self.sched.prefill_seqs_for(b),
                                                  prefill_copy_pages=self.prefill_copy_pages(b))
                        table = self._decode_steps if dec else self._steps
                        step = partial(layers_step, self.layer_gd, self.layer_specs, self.mesh, layer_fn, fwd,
                                       self.inv_freq)
                        groups = self._groups[v.label]
                        for n in sorted({n for _, n in groups}, reverse=True):
                            key = (b, v.label) if n == groups[0][1] else (b, v.label, n)
                            args, tdef = jax.tree.flatten(tuple(self.layer_states[:n]))
                            layers = jax.jit(on_leaves(step, tdef), donate_argnums=(1, 2),
                                             out_shardings=(rep, self.kv_sharding))
                            submit(table, key, layers.lower(tuple(args), self.kv, x, inp.meta, self._layer_ids[0]),
                                   opts)
            rest = self._rest_leaves
            for b in reversed(buckets):
                inp, x = inputs[b], xs[b]
                like = self._full_like(b)
                packed = jax.ShapeDtypeStruct((sum(a.size for a in jax.tree.leaves(like)),), jnp.int32,
                                              sharding=rep)
                if b in token_buckets:      # the prefill bucket's steps never need it (batcher._step_limits)
                    submit(self._full_head, b, jax.jit(
                        self._on_rest(partial(full_head_step, self.rest_gd, self.max_seqs, like)),
                        donate_argnums=4, out_shardings=rep).lower(rest, x, inp, packed, self.penalty_state), xo)
                for mode in HEAD_MODES:                # greedy batches skip the draw, top-k/top-p-free ones the sort
                    submit(self._head, (b, mode), jax.jit(
                        self._on_rest(partial(head_step, self.rest_gd, mode, self.max_seqs)),
                        out_shardings=rep).lower(rest, x, inp), xo)
                submit(self._embed, b, jax.jit(self._on_rest(partial(embed_step, self.rest_gd)),
                                               out_shardings=rep).lower(rest, self._prev, inp), xo)
                if self.stable_inputs:
                    submit(self._stage, b, jax.jit(stage, donate_argnums=0, out_shardings=rep).lower(inp, inp), None)
                    packed = jax.ShapeDtypeStruct((sum(a.size for a in jax.tree.leaves(inp)),), jnp.int32,
                                                  sharding=rep)
                    submit(self._unpack, b, jax.jit(unpack_into, donate_argnums=0, out_shardings=rep).lower(
                        inp, packed), None)
                    self._staged[b] = inp           # lowering read only its shapes; the steps take it over
            self.lower_seconds = time.perf_counter() - t0
        for f in futures:
            f.result()                              # re-raise the first compile error here
        if bar is not None:
            bar.close()
        pages = jax.device_put(jnp.zeros((self.cache_cfg.max_pages_per_seq,), jnp.int32), self.replicated)
        blk_sh = self.kv_sharding.k
        # one sequence's pages (padded), values and aux as stored: compressed formats move compressed
        blks = [b.update(sharding=blk_sh) for b in jax.eval_shape(KVCache.take_pages, self.kv, pages)]
        self._swap_out = jax.jit(KVCache.take_pages, out_shardings=(blk_sh,) * len(blks)).lower(self.kv,
                                                                                                 pages).compile()
        self._swap_in = jax.jit(lambda kv, pg, *b: kv.put_pages(pg, b), donate_argnums=0,
                                out_shardings=self.kv_sharding).lower(self.kv, pages, *blks).compile()
        if self.tails is not None:          # a sequence's K tail row moves with its pages
            self.tail_copies = TailCopies(self.tails, self.kv, self.kv_sharding, blk_sh, self.replicated)
        self._compile_prefix_programs()
        self.compile_seconds = time.perf_counter() - t0
        self._check_scratch()

    def _check_scratch(self) -> None:
        """A warning at start where the largest program's scratch exceeds the device memory left beside the
        weights and the cache: a step running that program would fail to allocate it (docs/design.md section 2: the
        sampled head once needed 4.65 GiB against ~6 GiB left on an H100)."""
        free = free_device_bytes()
        if free is None:                 # no statistics (the CPU): nothing to compare, no memory analysis run
            return
        top = self.largest_temps(1)
        if not top or top[0][1] <= free:
            return
        import warnings
        name, temp = top[0]
        warnings.warn(f"the compiled program {name} needs {temp / 2**30:.2f} GiB of scratch and {free / 2**30:.2f} "
                      f"GiB are free beside the weights and the KV cache: a step that runs it can run out of memory; "
                      f"lower --kv-memory-fraction (now {self.cache_cfg.kv_memory_fraction}), --num-pages or "
                      f"--max-seqs", RuntimeWarning, stacklevel=3)

    def _compile_prefix_programs(self) -> None:
        """The prefix cache's programs: the penalty-slot seed, and with a host tier the page <-> row copies."""
        c, rep = self.cache_cfg, self.replicated
        if not c.prefix_cache:
            return
        toks = jax.ShapeDtypeStruct((c.max_model_len,), jnp.int32, sharding=rep)
        self._seed = jax.jit(seed_slot, donate_argnums=0, out_shardings=rep).lower(
            self.penalty_state, self._layer_ids[0], toks).compile()
        if c.host_cache_gb or c.disk_cache_dir:
            self.tier_copies = TierCopies(self.kv, self.kv_sharding, rep, c.num_pages, c.max_pages_per_seq,
                                          host_sharding=self._tier_host_sharding())

    def _tier_host_sharding(self):
        """Where the host tier keeps its rows: pinned_host JAX arrays on a GPU with one device (a replicated
        pinned row would be one copy per device under TP), else numpy (None). NFJAX_TIER_HOST_MEMORY=pinned |
        numpy overrides (tests run the pinned path on the CPU backend, which has the memory kind)."""
        from nfjax.compat import pinned_host_sharding
        want = os.environ.get("NFJAX_TIER_HOST_MEMORY", "auto")
        if want == "numpy" or (want == "auto" and (not on_gpu() or self.mesh.size != 1)):
            return None
        return pinned_host_sharding(self.replicated)

    # ---- prefix cache -----------------------------------------------------------------------------
    def pages_from_host(self, pages: list[int], rows: list) -> None:
        """Rows (numpy or pinned arrays) written into `pages`: a host->device copy and an on-device scatter a
        run."""
        self.kv = self.tier_copies.from_host(self.kv, pages, rows)

    def seed_penalty_slot(self, slot: int, prompt: list[int]) -> None:
        """Clear a penalty slot and mark the whole prompt in it: the request's prefill skips the reused tokens,
        whose prompt flags the full head would otherwise never see (nfjax/engine/penalties.py)."""
        toks = np.full(self.cache_cfg.max_model_len, self.cfg.vocab_size, np.int32)
        toks[:len(prompt)] = prompt
        self.penalty_state = self._seed(self.penalty_state, jax.device_put(jnp.int32(slot), self.replicated),
                                        jax.device_put(toks, self.replicated))

    def largest_temps(self, n: int = 3) -> list[tuple[str, int]]:
        """The `n` compiled programs with the most scratch memory (XLA's memory analysis), largest first: what
        the KV sizing must leave free beside the weights and the cache."""
        tables = {"embed": self._embed, "head": self._head, "full_head": self._full_head, "layers": self._steps,
                  "decode_layers": self._decode_steps}
        out = []
        for name, table in tables.items():
            for key, prog in table.items():
                try:
                    out.append((f"{name}{key}", int(prog.memory_analysis().temp_size_in_bytes)))
                except Exception:  # noqa: BLE001 - a backend without the analysis reports nothing
                    pass
        return sorted(out, key=lambda t: -t[1])[:n]

    @property
    def num_compiled(self) -> int:
        """Compiled (bucket, strategy) step variants."""
        return len({k[:2] for k in self._steps})

    def pin_strategy(self, label: str | None) -> None:
        """Run every step with strategy `label` where it is compiled for the bucket (else sequential);
        None: back to the per-batch choice. For benchmarks and tests: no recompilation."""
        known = {lb for vs in self.variants.by_bucket.values() for lb in vs}
        if label is not None and label not in known:
            raise ValueError(f"strategy {label!r} is not compiled; compiled: {', '.join(sorted(known))}")
        self.pinned = label

    # ---- swapping ---------------------------------------------------------------------------------
    def _padded_pages(self, pages: list[int]) -> jax.Array:
        # padding: a page past the cache, dropped by the swap-in's write (one shared page serialises XLA's scatter)
        out = np.full(self.cache_cfg.max_pages_per_seq, self.cache_cfg.num_pages, np.int32)
        out[:len(pages)] = pages
        return jax.device_put(out, self.replicated)

    def swap_out(self, pages: list[int]) -> tuple:
        """The pages' arrays as stored, on the host; kivi64 adds the sequence's K tail row (None: no filling
        group) as a last element."""
        n = len(pages)
        out = tuple(np.asarray(a)[:, :n] for a in self._swap_out(self.kv, self._padded_pages(pages)))
        return out if self.tails is None else out + (self.tail_copies.out(self.kv, pages),)

    def swap_in(self, host_kv: tuple, pages: list[int]) -> None:
        n = host_kv[0].shape[1]
        if self.tails is not None:          # the filling group is the last page swapped out
            *host_kv, tail = host_kv
            self.kv = self.tail_copies.into(self.kv, pages[n - 1], tail)
        pad = [(0, 0), (0, self.cache_cfg.max_pages_per_seq - n)]
        blocks = jax.device_put(tuple(np.pad(a, pad + [(0, 0)] * (a.ndim - 2)) for a in host_kv), self.kv_sharding.k)
        self.kv = self._swap_in(self.kv, self._padded_pages(list(pages[:n])), *blocks)

    # ---- steps ------------------------------------------------------------------------------------
    def launch(self, batch: Batch) -> StepHandle:
        t = batch.bucket
        s, p, ps = self.sched.seqs_for(t), self.cache_cfg.max_pages_per_seq, self.cache_cfg.page_size
        tokens = np.zeros(t, np.int32)
        src = np.full(t, -1, np.int32)
        temp = np.zeros(s, np.float32)
        top_k = np.zeros(s, np.int32)
        top_p = np.ones(s, np.float32)
        seeds = np.zeros(s, np.uint32)
        counters = np.zeros(s, np.int32)
        off = 0
        any_full = False
        for i, sq in enumerate(batch.seqs):
            r = sq.req
            if sq.prev_slot is not None:
                src[off] = sq.prev_slot
            else:
                tokens[off:off + sq.num_tokens] = r.tokens(sq.start, sq.start + sq.num_tokens)
            off += sq.num_tokens
            temp[i], top_k[i], top_p[i] = r.params.temperature, r.params.top_k, r.params.top_p
            seeds[i] = r.seed & 0xFFFFFFFF
            counters[i] = r.num_launched_outputs - 1 if sq.samples else 0
            any_full = any_full or needs_full(sq)
        tails = None
        if self.tails is not None:
            tails = [self.tails.for_step(sq.req, sq.req.pages, sq.start, sq.start + sq.num_tokens)
                     for sq in batch.seqs]
            self.tails.end_step()
        meta = build_metadata([(sq.req.pages, sq.start, sq.num_tokens) for sq in batch.seqs], t, s, p, ps,
                              num_decode=batch.num_decode, kv_tails=tails)
        t0 = time.perf_counter()
        inp = self.put_input(t, StepInput(tokens, src, meta, temp, top_k, top_p, seeds, counters))
        full = None
        if any_full:            # penalties, min_tokens or logprobs in the batch: its inputs, copied over as one
            full = jax.device_put(pack(full_input(batch, s, self.penalty_slots, self.cfg.vocab_size,
                                                  self.cfg.eos_token_ids)), self.replicated)
        t1 = time.perf_counter()
        label = self.variants.choose(t, batch.num_tokens, batch.num_decode, self.pinned)
        self.strategy_counts[label] = self.strategy_counts.get(label, 0) + 1
        sampled = self.run_step(t, label, inp, any_sampled=bool((temp > 0).any()),
                                limits=bool(((temp > 0) & ((top_k > 0) | (top_p < 1))).any()),
                                decode_only=batch.num_decode == len(batch.seqs), full=full)
        t2 = time.perf_counter()
        return StepHandle(batch, sampled, t2, self.last_logprobs, put_ms=(t1 - t0) * 1e3,
                          dispatch_ms=(t2 - t1) * 1e3, slowest_program=self.slowest_dispatch[0],
                          slowest_program_ms=self.slowest_dispatch[1] * 1e3)

    def run_step(self, bucket: int, label: str, inp: StepInput, any_sampled: bool = True, limits: bool = True,
                 decode_only: bool = False, full: jax.Array | None = None) -> jax.Array:
        """Launch one step (embed, every layer, head) of the compiled variant `label`; returns the samples on
        device (they also feed the next step). `any_sampled=False` promises every row is greedy (temperature
        0), `limits=False` that no sampled row has a top-k or top-p (then no head sorts); `decode_only=True`
        that every row is a decode (then the programs without the prefill kernel run, where compiled). `full`:
        the packed `FullInput` of a batch that needs the full head (penalties, min_tokens, logprobs); its
        logprobs are left in `last_logprobs`. Benchmarks call this with synthetic inputs."""
        if self.stable_inputs and inp is not self._staged[bucket]:     # a caller's own device inputs
            inp = self._staged[bucket] = self._stage[bucket](self._staged[bucket], inp)
        rest = self._rest_leaves
        t = time.perf_counter()
        x = self._embed[bucket](rest, self._prev, inp)
        slowest = ("embed", time.perf_counter() - t)
        for i0, n, prog in self.layer_programs(bucket, label, decode_only):
            t = time.perf_counter()
            x, self.kv = prog(self._group_args[(i0, n)], self.kv, x, inp.meta, self._layer_ids[i0])
            slowest = max(slowest, (f"layers{i0}", time.perf_counter() - t), key=lambda s: s[1])
        t = time.perf_counter()
        if full is None:
            self.last_logprobs = None
            self._prev = self._head[(bucket, head_mode(any_sampled, limits))](rest, x, inp)
        else:
            self._prev, self.last_logprobs, self.penalty_state = self._full_head[bucket](
                rest, x, inp, full, self.penalty_state)
        # the program whose enqueue took longest (the trace's slowest_program: a rare slow dispatch names it)
        self.slowest_dispatch = max(slowest, ("head", time.perf_counter() - t), key=lambda s: s[1])
        return self._prev

    def group_args(self, i0: int, n: int) -> tuple:
        """Layers i0 .. i0 + n - 1's weights as the layer-group programs take them (one flat tuple)."""
        return self._group_args[(i0, n)]

    def _on_rest(self, fn):
        return on_leaves(fn, self._rest_tdef)

    def layer_programs(self, bucket: int, label: str, decode_only: bool = False) -> list[tuple[int, int, object]]:
        """(first layer, layer count, compiled program) of each layer group of one step, in order; a program takes
        `group_args(first, count)` where a layer group's states would go."""
        groups = self._groups[label]
        full = groups[0][1]
        table = self._decode_steps if decode_only and (bucket, label) in self._decode_steps else self._steps
        return [(i0, n, table[(bucket, label) if n == full else (bucket, label, n)]) for i0, n in groups]

    def _transform_layers(self, fn, tp: int) -> None:
        """`fn(layer)` on each layer's module in place (weight transforms for serving), its state kept."""
        for i, st in enumerate(self.layer_states):
            layer = nnx.merge(self.layer_gd, st)
            fn(layer)
            gd, self.layer_states[i] = nnx.split(layer)
        self.layer_gd = gd
        self.layer_specs = state_specs(self.layer_states[0], tp)

    def logits(self, tokens: Int[Array, "T"], meta: AttentionMetadata) -> Float[Array, "S V"]:
        """Each sequence's last-token logits through the layer-program code (sequential schedule), compiled on
        the spot, cache writes discarded: tests and inspection."""
        @jax.jit
        def f(rest_state, layer_states, kv, tokens, meta):
            model = nnx.merge(self.rest_gd, rest_state)
            x = model.embed_input(tokens, meta.positions)
            for i0, n in self.groups:
                x, kv = layers_step(self.layer_gd, self.layer_specs, self.mesh, sequential_layer_fn,
                                    self.whole_table_opts(meta), self.inv_freq, tuple(layer_states[i0:i0 + n]), kv,
                                    x, meta, jnp.int32(i0))
            return model.logits(model.norm(x[meta.logits_index]))
        put = partial(jax.device_put, device=self.replicated)
        return f(self.rest_state, self.layer_states, self.kv, put(tokens), put(meta))

    def model(self) -> LlamaModel:
        """The model with its layers stacked again (a copy of the weights: tests and inspection only)."""
        model = nnx.merge(self.rest_gd, self.rest_state)
        model.layers = nnx.merge(self.layer_gd, jax.tree.map(lambda *a: jnp.stack(a), *self.layer_states))
        return model

    @staticmethod
    def read(handle: StepHandle) -> np.ndarray:
        return np.asarray(handle.sampled)

    @staticmethod
    def read_logprobs(handle: StepHandle) -> Logprobs | None:
        """The step's logprobs on the host (a full-head step; else None), read with its tokens."""
        return None if handle.logprobs is None else jax.device_get(handle.logprobs)
