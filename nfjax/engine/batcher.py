"""NanoFlow batch formation: a dense token budget per step, decodes first, then prefill chunks to fill it.

Requests added together (between two steps: all of `Engine.generate`'s, or a server's arrivals within one step)
are queued longest predicted first, so the longest requests start first and the run does not end on a tail of
small steps behind one late long request; later arrivals still queue behind earlier ones. A decode-only step
just past a token bucket runs in the bucket below when nothing waits: the decodes left out are those that end
before the longest running request even at half speed, never left out two steps in a row. A step of mostly
decodes whose prefill chunks would leave more than a quarter of its bucket as padding runs in the bucket below
with shorter chunks (nfjax/engine/bucket_fit.py, docs/design.md section 9). A step with no decode may take a burst
of prompts up to the prefill bucket (`batcher.prefill_bucket`, `_step_limits`; docs/design.md section 19).

Admission uses NanoFlow's memory prediction: each request's end is predicted (max_tokens where it ignores EOS,
else the average output length seen so far) and a request is let in when the peak of the pages all running
requests will hold, step by step to their predicted ends, still fits (nfjax/engine/memory_forecast.py); when pages
still run out, the newest running request is preempted: its KV pages move to host memory and come back later
without recomputation.

A request with penalties also takes a penalty slot at admission (its token counts on the device,
nfjax/engine/penalties.py) and keeps it, swapped out or not, until it finishes; with none free, admission waits.

Prefix cache (on unless `CacheConfig.prefix_cache` is off): at admission a request takes the cached pages of its
prompt's longest cached run of full pages (GPU first, then the host and disk tiers, whose rows the engine loads
before the step) and its prefill starts at the first uncached token; a page is offered to the cache once it is
full, written by a launched step, and its tokens are known on the host (prompt chunks at formation, generated
tokens at finish or preemption). The last prompt token is always computed, and a request writes only from its
first uncached position on, in pages of its own, so shared pages are never written (no copy-on-write).

kivi64 and fp8r (formats keeping each sequence's filling group of 64 K positions in bfloat16, a group a page;
docs/design.md sections 14.1 and 14.3): a query sees a group its own step completes as quantized, so a prefill
chunk that does not end its prompt ends at a multiple of 64 (`_add_chunk`, `_shorten_chunks`), and what a query
sees depends on its position and its prompt's length only: tokens do not depend on the batch. When the step's
decodes leave the first prefill in line less than a group (where another format's prefill would still get a few
tokens), enough decodes sit this step out to give it one (`_make_room`; never the same decode two steps in a
row). Only pages wholly inside a prompt are offered to the prefix cache: a page holding generated positions was
written by decodes, which saw their group unquantized, and is not what a prefill of the same tokens writes.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from nfjax.config import ConfigError, EngineConfig, prefill_copy_pages
from nfjax.engine.bucket_fit import BucketFit, held_from, predicted
from nfjax.engine.memory_forecast import MemoryForecast
from nfjax.engine.penalties import num_penalty_slots
from nfjax.engine.request import Request, Status
from nfjax.kv.allocator import PageAllocator
from nfjax.kv.prefix_cache import page_hash, prompt_hashes
from nfjax.kv.tiers import PrefixStats
from pallas_kernels.kv_kivi64 import GROUP as KIVI_GROUP
from pallas_kernels.kv_quant import has_tail


def check_chunk_budget(kv_dtype: str, token_buckets: tuple[int, ...]) -> None:
    """The prefill chunks of a format with a tail (kivi64, fp8r) that do not end their prompt end at a multiple of
    64 positions: a token budget below that could never start a longer prompt, so it is refused at start (a
    ConfigError naming the flags)."""
    if has_tail(kv_dtype) and max(token_buckets) < KIVI_GROUP:
        raise ConfigError(f"--kv-dtype {kv_dtype} needs a token budget (the largest of --token-buckets / "
                          f"batcher.token_buckets) of at least {KIVI_GROUP}, got {max(token_buckets)}: a prefill "
                          f"chunk that does not end its prompt ends at a multiple of {KIVI_GROUP} positions "
                          f"(docs/design.md section 14.1), so a longer prompt could never start")


@dataclass
class ScheduledSeq:
    req: Request
    start: int                 # first position computed this step
    num_tokens: int
    samples: bool              # this chunk ends at the sequence's newest token, so a token is sampled
    prev_slot: int | None      # decode input comes from the previous step's sampled row (not yet on host)


@dataclass
class Batch:
    bucket: int                               # static token count of the compiled step
    seqs: list[ScheduledSeq]                  # decodes first, then prefill chunks
    num_decode: int
    swap_out: list[tuple[Request, list[int]]] = field(default_factory=list)  # (request, pages to copy out)
    swap_in: list[Request] = field(default_factory=list)
    evict: list[tuple[int, bytes]] = field(default_factory=list)   # cached pages to copy to the host tier first
    loads: list[tuple[int, object]] = field(default_factory=list)  # (page, row) loaded from a tier before the step
    prefix_seeds: list[Request] = field(default_factory=list)     # penalty slots to fill with a reused prompt
    prompt_tokens: int = 0                    # prompt tokens of the requests admitted in this step
    reused_tokens: int = 0                    # of which reused from the prefix cache (all tiers)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Batcher(BucketFit):
    FORECAST = MemoryForecast  # the memory forecast's class (a replay of runs measured before a change swaps it)
    LONGEST_FIRST = True       # requests added together are admitted longest predicted first (module docstring)

    def __init__(self, config: EngineConfig):
        """`config` with its automatic sizes resolved (`Runner.config`)."""
        self.cfg = sched = config.batcher
        self.cache = cache = config.cache
        self.budget = max(sched.token_buckets)
        self.prefill_budget = sched.prefill_bucket or 0     # a step with no decode (`_step_limits`); 0: none
        self._chunk_cap = sched.max_prefill_seqs            # prefill chunks the step being formed may hold
        self.max_model_len = cache.max_model_len
        self.allocator = PageAllocator(cache.num_pages, prefix=cache.prefix_cache)
        self.tiers = None                          # nfjax.kv.tiers.PrefixTiers, set by the engine when configured
        self.stats = PrefixStats()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # in arrival order
        self.swapped: deque[Request] = deque()
        self.free_penalty_slots = list(range(num_penalty_slots(sched.max_seqs)))[::-1]     # pop(): the lowest
        self._out_len_sum = 0                      # outputs of finished (not aborted) requests: sum, count
        self._out_len_count = 0
        self._wants: dict[str, list[bytes]] = {}  # waiting request id -> the prompt hashes it wants kept
        self._burst: list[Request] = []            # added since the last step, not yet ordered in `waiting`
        self._deferred: set[int] = set()           # id() of the decodes left out of the last step
        self._missed = 0                           # decodes the step being formed could not take
        # kivi64, fp8r (a filling K group in a tail row): non-final prefill chunks end at multiples of this (0:
        # anywhere); see the module docstring
        self.group = KIVI_GROUP if has_tail(cache.kv_dtype) else 0
        # execution.prefill_dequant_first: a step's prefill rows read at most this many pages a formation budget
        # (the runner's bfloat16 copy of them, `config.prefill_copy_pages`); {} without it
        self._copy_limits = {b: n for b in (self.budget, self.prefill_budget) if b
                             for n in [prefill_copy_pages(config, b)] if n}
        self._copy_cap = self._copy_used = 0       # the step being formed's limit and its prefill rows' pages
        self._made_room: set[int] = set()          # id() of the decodes `_make_room` left out of this step
        check_chunk_budget(cache.kv_dtype, sched.token_buckets)

    # ---- bookkeeping ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self._burst.append(req)
        self._want(req)

    def _order_burst(self) -> None:
        """The requests added since the last step, longest predicted (prompt + output) first: they are the
        newest in `waiting`, so its tail. Stable: equal predictions keep their order."""
        burst, self._burst = self._burst, []
        n = sum(1 for r in burst if r.status is Status.WAITING)
        if n < 2 or not self.LONGEST_FIRST:
            return
        tail = [self.waiting.pop() for _ in range(n)][::-1]
        tail.sort(key=lambda r: -self._expected_len(r))
        self.waiting.extend(tail)

    def _want(self, req: Request) -> None:
        """A waiting request's cached prompt pages are evicted last (nfjax/kv/allocator.py, eviction order)."""
        if self.allocator.prefix and not req.num_computed and req.request_id not in self._wants:
            hashes = list(prompt_hashes(req, self.cache.page_size))
            self._wants[req.request_id] = hashes
            self.allocator.want(hashes)

    def _unwant(self, req: Request) -> None:
        hashes = self._wants.pop(req.request_id, None)
        if hashes is not None:
            self.allocator.unwant(hashes)

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished and release its pages (a launched step may still write them: stream order keeps that safe)."""
        if req.finished:
            return
        req.status, req.finish_reason = Status.FINISHED, reason
        self._unwant(req)
        if req.pages:
            self._register(req)                     # pages its generated tokens filled
            self.allocator.free(req.pages)
            req.pages = []
        req.host_kv = None
        # a step in flight may still count a token in the slot; the next owner's first step clears it after that
        self._release_slot(req)
        for q in (self.running, self.waiting, self.swapped):
            # by identity: Request is a dataclass, and its __eq__ over ~1,000 running and waiting requests was
            # most of a finish's host time
            for i, r in enumerate(q):
                if r is req:
                    del q[i]
                    break
        if reason != "abort":
            self._out_len_sum += len(req.output_ids)
            self._out_len_count += 1

    def _release_slot(self, req: Request) -> None:
        if req.penalty_slot is not None:
            self.free_penalty_slots.append(req.penalty_slot)
            req.penalty_slot = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def pages_used(self) -> int:
        return self.allocator.num_used

    # ---- memory prediction ------------------------------------------------------------------------
    def _mean_out(self) -> int | None:
        """The mean output of the finished requests (rounded up), None before the first finishes."""
        return math.ceil(self._out_len_sum / self._out_len_count) if self._out_len_count else None

    def _expected_len(self, req: Request) -> int:
        return predicted(req, self.max_model_len, self._mean_out())[2]

    def _span(self, req: Request) -> tuple[int, int]:
        """(positions `req` holds once its prompt is in, positions at its predicted end): its forecast entry."""
        return held_from(req), self._expected_len(req)

    def _forecast(self) -> MemoryForecast:
        """The running requests' pages step by step to their predicted ends (built once per step)."""
        f = self.FORECAST(self.cache.page_size)
        max_len, mean_out = self.max_model_len, self._mean_out()
        for r in self.running:          # `_span`, with the mean taken once (hundreds of rows a step)
            f.add(held_from(r), predicted(r, max_len, mean_out)[2])
        return f

    def _fits_prediction(self, req: Request, forecast: MemoryForecast | None = None) -> bool:
        """Would `req` fit beside the running requests at the peak of their forecast (memory_forecast.py)?
        `forecast`: the running requests' forecast when the caller already has it (admission adds each admitted
        request to it instead of building it again)."""
        if not self.running:
            return True        # always admit one request so the engine makes progress
        if not self.cfg.predict_memory:
            return self.cache.pages_for(req.num_computed + 1) <= self.allocator.num_free
        forecast = self._forecast() if forecast is None else forecast
        return forecast.peak_with(*self._span(req)) <= self.allocator.capacity

    # ---- pages ------------------------------------------------------------------------------------
    def _register(self, req: Request) -> None:
        """Offer the request's full, written pages whose tokens the host knows to the prefix cache."""
        a, ps = self.allocator, self.cache.page_size
        if not a.prefix:
            return
        # kivi64, fp8r: only pages wholly inside the prompt (module docstring)
        done = min(req.num_computed, req.prompt_len) if self.group else req.num_computed
        while req.num_registered < len(req.pages) and (req.num_registered + 1) * ps <= done:
            h = page_hash(req, req.num_registered, ps)
            if h is None:
                return
            a.register(req.pages[req.num_registered], h)
            req.num_registered += 1

    def _reuse_prefix(self, batch: Batch, req: Request) -> None:
        """A newly admitted request takes its prompt's cached pages: GPU hits are shared, tier hits get fresh
        pages loaded before the step. The prefix is walked page by page through every tier (a run on the GPU,
        then one in the host or disk tier, then the GPU again...) up to the first page no tier holds. At least
        one page is left free for its first chunk, so admission cannot fail after a load was planned."""
        a, ps = self.allocator, self.cache.page_size
        req.reused = {}
        if not a.prefix or req.num_computed:
            return
        hashes = prompt_hashes(req, ps)
        pages: list[int] = []
        while len(pages) < len(hashes):
            run = a.lookup(hashes[len(pages):])
            while run and a.num_free < 1:            # taking them left no page for the chunk: give the last back
                a.free([run.pop()])
            if run:
                pages += run
                req.reused["gpu"] = req.reused.get("gpu", 0) + len(run) * ps
            if self.tiers is None or len(pages) == len(hashes):
                break
            rows = self.tiers.fetch(hashes[len(pages):], a.num_free - 1)
            if not rows:
                break
            new = a.allocate(len(rows))
            for p, h, (row, tier) in zip(new, hashes[len(pages):], rows):
                a.register(p, h)
                batch.loads.append((p, row))
                req.reused[tier] = req.reused.get(tier, 0) + ps
            pages += new
            if a.num_free < 1:
                break
        req.pages, req.num_computed, req.num_registered = pages, len(pages) * ps, len(pages)
        if pages and req.penalty_slot is not None:
            batch.prefix_seeds.append(req)

    def _grow(self, req: Request, upto: int) -> bool:
        if len(req.pages) * self.cache.page_size >= upto:
            return True                 # the common case (a decode needs a page one step in page_size)
        need = self.cache.pages_for(upto) - len(req.pages)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        req.pages.extend(self.allocator.allocate(need))
        return True

    def _preempt_newest(self, batch: Batch, protect: Request) -> bool:
        """Swap out the newest running request other than `protect` and not already in this batch."""
        busy = {id(s.req) for s in batch.seqs} | {id(r) for r in batch.swap_in}
        for victim in reversed(self.running):
            if victim is protect or id(victim) in busy:
                continue
            self.running.remove(victim)
            victim.status = Status.SWAPPED
            self._register(victim)                  # its full pages stay cached while it is away
            keep = self.cache.pages_for(victim.num_computed)
            if len(victim.pages) > keep:            # pages grown ahead hold nothing yet
                self.allocator.free(victim.pages[keep:])
                victim.pages = victim.pages[:keep]
            # The runner copies these pages out before this step runs; freeing them now is safe because every
            # later write to them is issued after that copy on the same device stream.
            batch.swap_out.append((victim, victim.pages))
            self.allocator.free(victim.pages)
            victim.pages = []
            self.swapped.appendleft(victim)
            return True
        return False

    # ---- batch formation --------------------------------------------------------------------------
    def next_batch(self, prev_slots: dict[str, int]) -> Batch | None:
        """Form the next step. `prev_slots` maps request ids to their sampled row in the step in flight."""
        batch = Batch(bucket=0, seqs=[], num_decode=0)
        if self._burst:
            self._order_burst()
        self._swap_in(batch)
        # 1) decodes: one token each for every running request past its prompt
        missed = 0             # decodes that could have run but did not (the sequence cap, pages, input)
        # The loop runs for every running request each step (hundreds): attribute reads are kept local and the
        # common cases inline (a page with room, the input token in flight), as they cost most of a step's
        # formation at 384 rows otherwise.
        seqs, max_seqs, max_len, ps = batch.seqs, self.cfg.max_seqs, self.max_model_len, self.cache.page_size
        running = Status.RUNNING
        for req in list(self.running):
            if req.status is not running:
                continue   # preempted earlier in this loop
            pos = req.num_computed
            if pos < req.prompt_len:
                continue   # in prefill
            if len(seqs) >= max_seqs:
                missed += 1
                continue
            launched = req.num_launched_outputs
            if launched >= req.params.max_tokens or req.prompt_len + launched >= max_len:
                continue   # its last token is in flight; the host finishes it when that lands
            if len(req.pages) * ps <= pos:
                grown = self._grow(req, pos + 1)
                while not grown and self._preempt_newest(batch, protect=req):
                    grown = self._grow(req, pos + 1)
                if not grown:
                    missed += 1
                    continue
            known = req.token_at(pos)
            slot = None if known is not None else prev_slots.get(req.request_id)
            if known is None and slot is None:
                missed += 1
                continue   # input token not available (cannot happen in steady state)
            seqs.append(ScheduledSeq(req, pos, 1, True, slot))
        self._missed = missed
        batch.num_decode = len(batch.seqs)
        # 2) prefill chunks: running prefills first, then admit waiting requests FCFS
        budget, self._chunk_cap = self._step_limits(batch)
        self._copy_cap, self._copy_used = self._copy_limits.get(budget, 0), 0
        left = budget - batch.num_tokens
        self._made_room = set()
        for req in [r for r in self.running if r.in_prefill]:
            if left <= 0 or not self._room_for_chunk(batch):
                break
            if self._blocked(req, left, req.prompt_len - req.num_computed):
                if not self._make_room(batch, req, left):
                    continue                        # it waits; a later prompt that ends within `left` may go
                left = self.group
            left -= self._add_chunk(batch, req, left)
        forecast = None        # the running requests' pages to their predicted ends, built once per step
        # No admission while a preempted request waits to come back: new requests would take its pages.
        while (self.waiting and left > 0 and self._room_for_chunk(batch) and not batch.swap_out
               and not self.swapped):
            req = self.waiting[0]
            if forecast is None and self.cfg.predict_memory and self.running:
                forecast = self._forecast()
            if not self._fits_prediction(req, forecast):
                break
            if self._copy_cap and (self._copy_used + self.cache.pages_for(self._first_chunk_end(req, left))
                                   > self._copy_cap):
                break           # the copy holds it in a later step (checked before `_reuse_prefix` takes pages)
            # kivi64, fp8r: the prompt, less any prefix it may reuse, counts whole here (no page taken before this)
            if self._blocked(req, left, req.prompt_len):
                if not self._make_room(batch, req, left):
                    break
                left = self.group
            if req.penalized:
                if not self.free_penalty_slots:
                    break       # every penalty slot is taken: wait (first come, first served)
                req.penalty_slot = self.free_penalty_slots.pop()
            self.waiting.popleft()
            self._unwant(req)                       # its cached pages are taken now, or evicted as any other
            req.status = Status.RUNNING
            self.running.append(req)
            self._reuse_prefix(batch, req)
            took = self._add_chunk(batch, req, left)
            if took == 0:       # no pages even for one chunk (so nothing was reused or loaded): put it back
                self._release_slot(req)
                self.running.remove(req)
                req.status = Status.WAITING
                self.waiting.appendleft(req)
                self._want(req)
                break
            left -= took
            batch.prompt_tokens += req.prompt_len
            batch.reused_tokens += req.num_computed          # advanced after formation
            st = self.stats
            st.prompt_tokens += req.prompt_len
            st.hit_tokens_gpu += req.reused.get("gpu", 0)
            st.hit_tokens_host += req.reused.get("host", 0)
            st.hit_tokens_disk += req.reused.get("disk", 0)
            if forecast is not None:
                forecast.add(*self._span(req))
        evicted = self.allocator.take_evicted()
        if self.tiers is not None:
            batch.evict = evicted
        if not batch.seqs and not batch.swap_out and not batch.swap_in:
            return None
        batch.bucket = self._fit_bucket(batch)
        register = self.allocator.prefix
        for s in batch.seqs:
            req = s.req
            req.num_computed += s.num_tokens
            if s.samples:
                req.num_launched_outputs += 1
            # `_register`'s own first test, inline: most steps fill no page of most requests
            if register and (req.num_registered + 1) * ps <= req.num_computed and req.num_registered < len(req.pages):
                self._register(req)
        return batch

    def _room_for_chunk(self, batch: Batch) -> bool:
        return len(batch.seqs) < self.cfg.max_seqs and len(batch.seqs) - batch.num_decode < self._chunk_cap

    def _step_limits(self, batch: Batch) -> tuple[int, int]:
        """(token budget, prefill chunks) of the step being formed: the largest token bucket's and
        `max_prefill_seqs`, or the prefill bucket's when the step holds no decode and the prompts first in line
        (running prefills, then waiting requests, less what the prefix cache holds of them) would fill at least
        (1 - SHORTEN_PAD) of it, none of them needing the full head (not compiled for that bucket: its all-token
        logits would take GiBs)."""
        normal = (self.budget, self.cfg.max_prefill_seqs)
        if not self.prefill_budget or batch.num_decode or batch.seqs or self.swapped:
            return normal
        cap = self.cfg.prefill_seqs_for(self.prefill_budget)
        firsts = [r for r in self.running if r.in_prefill][:cap]
        firsts += [self.waiting[i] for i in range(min(len(self.waiting), cap - len(firsts)))]
        if any(r.penalized or r.full_when_sampling for r in firsts):
            return normal
        tokens = sum(r.prompt_len - r.num_computed - self._cached_prefix(r) for r in firsts)
        if tokens < (1 - self.SHORTEN_PAD) * self.prefill_budget:
            return normal
        return self.prefill_budget, cap

    def _cached_prefix(self, req: Request) -> int:
        """Prompt tokens of a waiting request the GPU prefix cache holds now (its leading full pages; the last
        prompt token is always computed): what its admission would not prefill."""
        hashes = self._wants.get(req.request_id)
        if not hashes or req.num_computed:
            return 0
        return min(self._held_pages(hashes) * self.cache.page_size, req.prompt_len - 1)

    def _held_pages(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first on, the GPU prefix cache holds."""
        n = 0
        while n < len(hashes) and self.allocator.contains(hashes[n]):
            n += 1
        return n

    def _blocked(self, req: Request, left: int, rest: int) -> bool:
        """A format with a tail: `left` tokens reach neither the end of `req`'s prompt (`rest` to go) nor a group
        boundary, so its chunk would wait (where another format's would take them)."""
        return bool(self.group) and left < min(rest, self.group)

    def _make_room(self, batch: Batch, req: Request, left: int) -> bool:
        """A format with a tail: leave out enough decodes (newest first, none left out by the last step) that the
        first prefill in line gets one group this step, if pages hold it. False (nothing changed) when the step
        already has a prefill chunk, or too few decodes may sit out: then the prefill waits a step."""
        need = self.group - left
        if len(batch.seqs) > batch.num_decode or self._made_room:
            return False
        if self.cache.pages_for(req.num_computed + self.group) - len(req.pages) > self.allocator.num_free:
            return False
        order = {id(r): i for i, r in enumerate(self.running)}
        can = [i for i in range(batch.num_decode) if id(batch.seqs[i].req) not in self._deferred]
        if len(can) < need:
            return False
        can.sort(key=lambda i: -order.get(id(batch.seqs[i].req), -1))       # the newest running first
        out = set(can[:need])
        self._made_room = {id(batch.seqs[i].req) for i in out}
        batch.seqs = [s for i, s in enumerate(batch.seqs) if i not in out]
        batch.num_decode = len(batch.seqs)
        return True

    def _first_chunk_end(self, req: Request, left: int) -> int:
        """Where a waiting request's first chunk ends at most, before `_reuse_prefix` runs: `left` tokens past the
        prompt pages the GPU cache holds (as `_reuse_prefix` takes them, or fewer), or past what it has computed;
        with host or disk tiers, which may hold any of its pages, its prompt's end. Never below the end
        `_add_chunk` then finds, so its copy check cannot fail after pages were reused (nothing would give them
        back)."""
        a, ps = self.allocator, self.cache.page_size
        if req.num_computed or not a.prefix:
            base = req.num_computed
        elif self.tiers is not None:
            return req.prompt_len
        else:
            base = self._held_pages(prompt_hashes(req, ps)) * ps
        return min(req.prompt_len, base + left)

    def _add_chunk(self, batch: Batch, req: Request, left: int) -> int:
        n = min(req.prompt_len - req.num_computed, left)
        if self.group and n < req.prompt_len - req.num_computed:
            n = (req.num_computed + n) // self.group * self.group - req.num_computed     # a non-final chunk
        if self._copy_cap and self._copy_used + self.cache.pages_for(req.num_computed + n) > self._copy_cap:
            return 0            # its pages would not fit the prefill copy beside this step's other chunks
        while n > 0 and not self._grow(req, req.num_computed + n):
            n = min(n, (len(req.pages) + self.allocator.num_free) * self.cache.page_size - req.num_computed)
        if n <= 0:
            return 0
        end = req.num_computed + n
        batch.seqs.append(ScheduledSeq(req, req.num_computed, n, end == req.prompt_len, None))
        self._copy_used += self.cache.pages_for(end)
        return n

    def _swap_in(self, batch: Batch) -> None:
        while self.swapped:
            req = self.swapped[0]
            need = self.cache.pages_for(req.num_computed + 1)
            if need > self.allocator.num_free or not self._fits_prediction(req):
                return
            self.swapped.popleft()
            req.pages = self.allocator.allocate(need)
            req.num_registered = 0                  # fresh pages: offered to the cache again as they are
            req.status = Status.RUNNING
            self.running.append(req)
            self.running.sort(key=lambda r: r.timings.arrival)
            batch.swap_in.append(req)
