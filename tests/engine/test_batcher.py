"""Batch formation policies (nfjax/engine/batcher.py): requests added together are admitted longest predicted
first; a decode-only step just past a token bucket runs in the bucket below by leaving out decodes with slack,
without making the run longer, preempting, or changing a token; and a step of mostly decodes runs its prefill
chunks shortened to the bucket below rather than padding the one above."""
import random

import pytest

from nfjax.config import BatcherConfig, CacheConfig, ConfigError, EngineConfig, ModelConfig
from nfjax.engine import SamplingParams
from nfjax.engine.batcher import Batcher
from nfjax.engine.request import Request

from tests.engine.conftest import make_engine

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=16, max_position_embeddings=4096)


def _batcher(buckets=(16, 64), max_seqs=64, max_prefill_seqs=16, num_pages=512, **kw):
    cfg = EngineConfig(model=MODEL, cache=CacheConfig(page_size=16, num_pages=num_pages, max_pages_per_seq=64,
                                                      max_model_len=1024),
                       batcher=BatcherConfig(token_buckets=buckets, max_seqs=max_seqs,
                                             max_prefill_seqs=max_prefill_seqs))
    return type("B", (Batcher,), kw)(cfg) if kw else Batcher(cfg)


def _req(rid, prompt_len, out, exact=True):
    return Request(rid, list(range(1, prompt_len + 1)),
                   SamplingParams.greedy(max_tokens=out, ignore_eos=exact), 0)


def _step(b, log=None):
    """One step as the engine takes it, with its tokens landing at once; `log` gets (bucket, decode ids)."""
    batch = b.next_batch({})
    assert b.allocator.num_used <= b.allocator.capacity
    if log is not None:
        log.append((batch.bucket, [s.req.request_id for s in batch.seqs[:batch.num_decode]], len(batch.swap_out)))
    for s in batch.seqs:
        if s.samples:
            s.req.output_ids.append(1)
            if len(s.req.output_ids) >= s.req.params.max_tokens:
                b.finish(s.req, "length")
    return batch


def test_requests_added_together_are_admitted_longest_first_and_later_ones_queue_behind():
    b = _batcher(max_prefill_seqs=1)                      # one admission a step
    for rid, out in (("a", 5), ("b", 50), ("c", 20), ("d", 20)):
        b.add(_req(rid, 4, out))
    admitted = [_step(b).seqs[-1].req.request_id]
    b.add(_req("e", 4, 100))                              # a later arrival: behind the first group
    for _ in range(4):
        admitted.append(_step(b).seqs[-1].req.request_id)
    assert admitted == ["b", "c", "d", "a", "e"]          # equal predictions keep their order


def test_old_order_without_longest_first():
    b = _batcher(max_prefill_seqs=1, LONGEST_FIRST=False)
    for rid, out in (("a", 5), ("b", 50), ("c", 20)):
        b.add(_req(rid, 4, out))
    assert [_step(b).seqs[-1].req.request_id for _ in range(3)] == ["a", "b", "c"]


def _run(b, work, exact=True):
    for i, (plen, out) in enumerate(work):
        b.add(_req(str(i), plen, out, exact))
    log = []
    while b.has_work():
        _step(b, log)
    return log


WORK = [(2, 120)] + [(2, random.Random(i).randint(20, 40)) for i in range(21)]   # 22 decodes: just past 16


def test_decodes_with_slack_wait_so_the_step_fits_the_bucket_below():
    log = _run(_batcher(), WORK)
    base = _run(_batcher(DEFER_SLACK=0.0), WORK)
    assert len(log) == len(base) == 120                   # the longest request's chain: the run is no longer
    assert sum(1 for bucket, *_ in base if bucket == 64) > 20
    assert all(bucket == 16 for bucket, *_ in log[2:])    # 17 to 22 decodes ran 16 at a time (after 2 prefill steps)
    assert all("0" in ids for _, ids, _ in log[1:])       # the longest request never waits
    steps_of: dict[str, list[int]] = {}
    for t, (_, ids, _) in enumerate(log):
        for r in ids:
            steps_of.setdefault(r, []).append(t)
    for r, ts in steps_of.items():                        # never left out two steps in a row
        assert max(b - a for a, b in zip(ts, ts[1:])) <= 2, r
        assert len(ts) == WORK[int(r)][1] - 1             # the first token came with the prompt
    assert sum(swaps for *_, swaps in log) == 0


class Watched(Batcher):
    """Records, per step, whether a request waited and how many running requests could decode."""

    def next_batch(self, prev_slots):
        self.seen = getattr(self, "seen", [])
        decodable = sum(1 for r in self.running if not r.in_prefill)
        batch = super().next_batch(prev_slots)
        self.seen.append((bool(self.waiting), decodable, batch.num_decode))
        return batch


def test_no_decode_waits_without_exact_lengths_or_while_a_request_waits():
    # lengths not known (EOS may come any time): nothing is surely longer, so nothing is left out
    log = _run(_batcher(), WORK, exact=False)
    assert sum(1 for bucket, *_ in log if bucket == 64) > 20
    # a large request waits for pages: meanwhile every running request decodes, whatever the bucket
    cfg = _batcher(num_pages=40).cfg
    b = Watched(EngineConfig(model=MODEL, cache=CacheConfig(page_size=16, num_pages=40, max_pages_per_seq=64,
                                                            max_model_len=1024), batcher=cfg))
    for i, (plen, out) in enumerate(WORK + [(300, 200)]):
        b.add(_req(str(i), plen, out))
    while b.has_work():
        _step(b)
    waited = [(d, n) for w, d, n in b.seen[1:] if w]
    assert len(waited) > 10 and all(d == n for d, n in waited)


def test_a_prompt_beside_many_decodes_is_chunked_to_the_bucket_below():
    b = _batcher()
    for i in range(12):
        b.add(_req(str(i), 1, 30))
    _step(b)                                              # 12 one-token prompts
    b.add(_req("x", 20, 5))
    log = [_step(b) for _ in range(6)]
    chunks = [[s.num_tokens for s in batch.seqs[batch.num_decode:]] for batch in log]
    assert [batch.bucket for batch in log] == [16] * 6    # 12 decodes + the prompt would pad 64 by half
    assert chunks == [[4], [4], [4], [4], [4], []]        # the prompt over 5 steps, then it decodes
    assert [s.samples for s in log[4].seqs[12:]] == [True] and log[5].num_decode == 13
    few = _batcher()                                      # 4 decodes: the prompt goes in at once (bucket 64)
    for i in range(4):
        few.add(_req(str(i), 1, 30))
    _step(few)
    few.add(_req("x", 20, 5))
    assert [s.num_tokens for s in _step(few).seqs[4:]] == [20]


def _drive(eng, late_prompt):
    """Three requests decoding, then one more arrives: its prompt beside their decodes; every output by id."""
    params = [SamplingParams.greedy(max_tokens=n, ignore_eos=True) for n in (16, 6, 7)]
    ids = [eng.add_request(p, sp) for p, sp in zip(["the cat", "a dog ran", "in the"], params)]
    outs = {}
    for _ in range(3):
        outs.update({o.request_id: o for o in eng.step()})
    ids.append(eng.add_request(late_prompt, SamplingParams.greedy(max_tokens=5, ignore_eos=True)))
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    return [outs[i].token_ids for i in ids]


def test_engine_tokens_unchanged_when_decodes_wait_or_chunks_shorten():
    """Greedy tokens with decodes left out of steps and prefill chunks shortened equal those of steps that take
    every decode and whole chunks."""
    eng = make_engine(CacheConfig(page_size=8, num_pages=64, max_pages_per_seq=16),
                      BatcherConfig(token_buckets=(4, 16), max_seqs=8))
    prompts = ["the cat", "a dog ran", "in the", "on it", "to be or", "so"]
    params = [SamplingParams.greedy(max_tokens=n, ignore_eos=True) for n in (16, 6, 5, 7, 6, 5)]
    outs = eng.generate(prompts, params)
    assert (4, 4) in [(s.bucket, s.decode_tokens) for s in eng.trace.steps if not s.prefill_tokens]
    eng.trace.steps.clear()
    late = _drive(eng, "hello!")
    assert (4, 3, 1) in [(s.bucket, s.decode_tokens, s.prefill_tokens) for s in eng.trace.steps]
    eng.batcher.DEFER_SLACK, eng.batcher.SHORTEN_PAD = 0.0, 1.0
    eng.trace.steps.clear()
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in outs]
    assert (16, 6) in [(s.bucket, s.decode_tokens) for s in eng.trace.steps if not s.prefill_tokens]
    assert _drive(eng, "hello!") == late
    assert eng.pages_used == 0


def _kivi(buckets, kv_dtype="kivi64", max_seqs=128):
    """A batcher over pages of 64: kivi64's (K groups of 64 positions) or another format's."""
    return Batcher(EngineConfig(model=MODEL, cache=CacheConfig(page_size=64, num_pages=512, max_pages_per_seq=16,
                                                               max_model_len=1024, kv_dtype=kv_dtype),
                                batcher=BatcherConfig(token_buckets=buckets, max_seqs=max_seqs)))


def _chunks(batch):
    return [s.num_tokens for s in batch.seqs[batch.num_decode:]]


def _decoding(b, n):
    """`n` one-token prompts admitted (16 a step) and decoding."""
    for i in range(n):
        b.add(_req(str(i), 1, 20))
    while b.waiting:
        _step(b)


def test_kivi64_prefill_chunks_end_at_group_boundaries():
    """kivi64's prefill follows where its chunks end (docs/design.md section 14.1): a chunk that does not end its
    prompt ends at a multiple of 64; a budget below 64 could never start a longer prompt, so it is refused."""
    with pytest.raises(ConfigError, match=r"kivi64 needs a token budget \(the largest of --token-buckets.*48"):
        _kivi((16, 48))
    log = {}
    for fmt in ("kivi64", "bfloat16"):
        b = _kivi((100,), fmt)
        b.add(_req("x", 300, 2))
        log[fmt] = []
        while b.has_work():
            log[fmt].append(_chunks(_step(b)))
    assert log["kivi64"] == [[64], [64], [64], [64], [44], []]
    assert log["bfloat16"] == [[100], [100], [100], []]


def test_kivi64_decodes_sit_out_so_a_prefill_gets_a_group():
    """30 decodes leave a budget of 80 only 50 tokens: another format's prompt takes them; kivi64's would reach no
    group boundary, so the 14 newest decodes not left out by the last step sit this one out instead."""
    log = {}
    for fmt in ("kivi64", "bfloat16"):
        b = _kivi((80,), fmt)
        _decoding(b, 30)
        b.add(_req("x", 200, 2))
        log[fmt] = [_step(b) for _ in range(4)]
    assert [_chunks(s) for s in log["bfloat16"]] == [[50]] * 4
    steps = log["kivi64"]
    assert [_chunks(s) for s in steps] == [[64], [64], [64], [8]]
    assert [s.bucket for s in steps] == [80] * 4 and [s.num_decode for s in steps] == [16, 16, 16, 30]
    out = [{str(i) for i in range(30)} - {s.req.request_id for s in st.seqs[:st.num_decode]} for st in steps[:3]]
    newest, next_ = {str(i) for i in range(16, 30)}, {str(i) for i in range(2, 16)}
    assert out == [newest, next_, newest]                 # never the same decode two steps in a row


def test_kivi64_shortened_chunks_end_at_group_boundaries():
    """A step of mostly decodes runs its chunks shortened to the bucket below: kivi64's to a multiple of 64 (a
    chunk of 200 beside 80 decodes keeps 64, another format's 80), or not at all where none is reached."""
    got = {}
    for fmt in ("kivi64", "bfloat16"):
        for decodes, prompt in ((80, 200), (120, 60)):
            b = _kivi((160, 512), fmt)
            _decoding(b, decodes)
            b.add(_req("x", prompt, 2))
            batch = _step(b)
            got[fmt, decodes] = (batch.bucket, _chunks(batch), batch.seqs[-1].samples)
    assert got["kivi64", 80] == (160, [64], False) and got["bfloat16", 80] == (160, [80], False)
    assert got["kivi64", 120] == (512, [60], True) and got["bfloat16", 120] == (160, [40], False)


def test_kivi64_offers_only_prompt_pages_to_the_prefix_cache():
    """A page holding generated positions was written by decodes that saw their group unquantized: a prefill of
    the same tokens writes another page, so kivi64 shares only pages wholly inside a prompt."""
    for fmt, cached in (("kivi64", 1), ("bfloat16", 3)):
        b = _kivi((256,), fmt)
        b.add(_req("x", 100, 100))
        while b.has_work():
            _step(b)
        assert b.allocator.num_cached == cached, fmt


def _prefill_batcher(prefill_bucket=256, **kw):
    cfg = EngineConfig(model=MODEL, cache=CacheConfig(page_size=16, num_pages=512, max_pages_per_seq=64,
                                                      max_model_len=1024),
                       batcher=BatcherConfig(token_buckets=(16, 64), max_seqs=64, max_prefill_seqs=4,
                                             prefill_bucket=prefill_bucket, **kw))
    return Batcher(cfg)


def test_a_burst_with_nothing_decoding_is_prefilled_in_one_step_of_the_prefill_bucket():
    b = _prefill_batcher()                        # prefill bucket 256: up to 256 // 128 = 2 chunks, at least 4
    for i in range(4):
        b.add(_req(str(i), 60, 8))
    first = _step(b)
    assert first.bucket == 256 and first.num_decode == 0 and first.num_tokens == 240 and len(first.seqs) == 4
    second = _step(b)                              # four decodes: the token buckets' budget again
    assert second.bucket == 16 and second.num_decode == 4 and second.num_tokens == 4
    b.add(_req("late", 200, 4))                    # beside decodes: chunked to the largest token bucket
    third = _step(b)
    assert third.bucket == 64 and third.num_decode == 4 and third.num_tokens == 64


def test_the_prefill_bucket_waits_for_prompts_that_fill_it_and_for_no_full_head():
    b = _prefill_batcher()
    for i in range(3):                             # 3 x 60 = 180 < 0.75 x 256: chunked as before
        b.add(_req(str(i), 60, 8))
    steps = [_step(b) for _ in range(4)]
    assert steps[0].bucket == 64 and steps[0].num_tokens == 64 and max(s.bucket for s in steps) == 64
    b = _prefill_batcher()
    b.add(Request("lp", list(range(1, 61)), SamplingParams.greedy(max_tokens=8, logprobs=2), 0))
    for i in range(4):
        b.add(_req(str(i), 60, 8))
    first = _step(b)                               # a request in line with logprobs: no prefill bucket
    assert first.bucket == 64 and first.num_tokens == 64 and first.seqs[0].req.request_id == "lp"
    b = _prefill_batcher()
    for i in range(4):                             # behind four prompts that fill the step: it waits its turn
        b.add(_req(str(i), 60, 8))
    b.add(Request("lp", list(range(1, 61)), SamplingParams.greedy(max_tokens=8, logprobs=2), 0))
    first = _step(b)
    assert first.bucket == 256 and "lp" not in [s.req.request_id for s in first.seqs]


def test_engine_tokens_unchanged_with_a_prefill_bucket():
    """Greedy tokens of a burst prefilled in one prefill-bucket step equal those of chunked prefills."""
    prompts = ["the cat sat on the mat and", "a dog ran far away from", "in the morning we all",
               "to be or not to be that is", "so it goes on and on and", "one two three four five"]
    params = [SamplingParams.greedy(max_tokens=n, ignore_eos=True) for n in (12, 6, 5, 7, 6, 9)]
    cache = CacheConfig(page_size=8, num_pages=128, max_pages_per_seq=16)
    plain = make_engine(cache, BatcherConfig(token_buckets=(4, 16), max_seqs=8))
    burst = make_engine(cache, BatcherConfig(token_buckets=(4, 16), max_seqs=8, prefill_bucket=160))
    want = [o.token_ids for o in plain.generate(prompts, params)]
    outs = burst.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    assert 0.75 * 160 <= prompt_tokens <= 160
    assert burst.trace.steps[0].bucket == 160 and burst.trace.steps[0].prefill_tokens == prompt_tokens
    assert max(s.bucket for s in plain.trace.steps) == 16 and burst.pages_used == 0


def test_prefill_bucket_must_lie_above_the_token_buckets():
    with pytest.raises(ConfigError, match="prefill_bucket"):
        BatcherConfig(token_buckets=(16, 64), prefill_bucket=64)
    with pytest.raises(ConfigError, match="prefill_bucket"):
        BatcherConfig(prefill_bucket=-1)


def test_prompts_the_prefix_cache_holds_do_not_count_toward_the_prefill_bucket():
    b = _prefill_batcher(prefill_bucket=1024)      # up to 1024 // 128 = 8 chunks, against max_prefill_seqs 4
    for i in range(8):                             # 8 x 128 = 1024 tokens: one prefill-bucket step
        b.add(_req(str(i), 128, 2))
    first = _step(b)
    assert first.bucket == 1024 and len(first.seqs) == 8
    while b.has_work():
        _step(b)
    for i in range(8):                             # the same prompts again: 7 full pages of each cached (the
        b.add(_req(f"again{i}", 128, 2))           # page of the last token is always computed): 16 tokens each
    again = _step(b)                               # 128 tokens to go: the token buckets, 4 chunks, not 1024
    assert again.bucket == 64 and len(again.seqs) == 4 and again.reused_tokens == 4 * 112


def _copy_config(on: bool) -> EngineConfig:
    from nfjax.config import ExecutionConfig
    return EngineConfig(model=MODEL, cache=CacheConfig(page_size=16, num_pages=512, max_pages_per_seq=64,
                                                       max_model_len=1024, kv_dtype="fp8"),
                        batcher=BatcherConfig(token_buckets=(16, 256), max_seqs=64, max_prefill_seqs=16),
                        execution=ExecutionConfig(prefill_dequant_first=on))


def _copy_batcher(on: bool):
    return Batcher(_copy_config(on))


def test_prefill_rows_stay_within_the_dequantized_copy():
    """execution.prefill_dequant_first: a step's prefill rows read at most `prefill_copy_pages` pages (64 of one
    sequence's table + 16 of the 256-token budget + 16 chunks = 96). b's first 960 prompt tokens are in the prefix
    cache, so its 24-token first chunk reads 62 pages: beside a's 63 it waits a step; without the option it comes in
    with the tokens left. A chunk that reads few pages still comes in (the bound is its chunk's end, not its
    prompt's)."""
    from nfjax.config import pages_for, prefill_copy_pages
    from nfjax.engine.request import Request as R
    on, off = _copy_batcher(True), _copy_batcher(False)
    assert prefill_copy_pages(_copy_config(True), 256) == 96 and on._copy_limits == {256: 96}
    assert prefill_copy_pages(_copy_config(False), 256) == 0 and not off._copy_limits
    for b in (on, off):
        b.add(_req("p", 960, 1))                       # its prompt's pages stay in the prefix cache after it ends
        while b.has_work():
            _step(b)
        b.add(R("a", [7] * 1000, SamplingParams.greedy(max_tokens=4, ignore_eos=True), 0))
        for _ in range(3):
            _step(b)                                   # a: 768 of its 1,000 prompt tokens in
        b.add(_req("b", 1000, 4))
    got_on, got_off = _step(on), _step(off)
    assert [s.req.request_id for s in got_off.seqs] == ["a", "b"] and got_off.seqs[1].start == 960
    assert [s.req.request_id for s in got_on.seqs] == ["a"]                # 63 + 62 pages > 96: b waits
    assert on._copy_used == pages_for(1000, 16) == 63
    nxt = _step(on)
    assert [s.req.request_id for s in nxt.seqs][-1] == "b" and nxt.seqs[-1].start == 960   # and comes in next
    # a fresh 600-token prompt beside a 63-page row: its 24-token first chunk reads 2 pages, and comes in
    c = _copy_batcher(True)
    c.add(R("a", [7] * 1000, SamplingParams.greedy(max_tokens=4, ignore_eos=True), 0))
    for _ in range(3):
        _step(c)
    c.add(_req("d", 600, 4))
    assert [s.req.request_id for s in _step(c).seqs] == ["a", "d"] and c._copy_used == 63 + 2


def test_prefill_copy_limit_holds_over_a_random_run():
    rng = random.Random(3)
    b = _copy_batcher(True)
    for i in range(40):
        b.add(_req(f"r{i}", rng.randint(1, 1000 - 8), rng.randint(1, 8)))
    steps = 0
    while b.has_work() and steps < 2000:
        batch = _step(b)
        pre = batch.seqs[batch.num_decode:]
        assert sum(b.cache.pages_for(s.start + s.num_tokens) for s in pre) <= 96
        steps += 1
    assert not b.has_work()
