"""A step's token bucket (docs/design.md section 9): the smallest compiled bucket that holds the formed batch, or the
one below it when that costs the run nothing. A decode-only step just past a bucket, with nothing waiting, leaves
out decodes that end before the longest running request even at half speed (never the same decode two steps in a
row, and only if their pages at their predicted ends still fit); a step of mostly decodes whose prefill chunks would
leave more than `SHORTEN_PAD` of the bucket above as padding runs in the one below with shorter chunks. Mixed into
`nfjax.engine.batcher.Batcher`, whose state (buckets, running and waiting requests, the allocator) it reads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from nfjax.engine.request import Request

if TYPE_CHECKING:
    from nfjax.engine.batcher import Batch


def predicted(req: Request, max_len: int, mean_out: int | None) -> tuple[int, int, int]:
    """(decode steps `req` surely has left, steps it has at most left, positions at its predicted end). At most:
    to max_tokens or the context; surely: that where its length is exact (ignore_eos, no stop condition), else to
    min_tokens. Its end: max_tokens where exact, else at most the finished requests' `mean_out` (None: none yet)
    outputs, and past what it has launched. A request that ignores EOS and has no stop condition runs to
    max_tokens: the mean of other requests (a warm-up's 4-token outputs, say) must not stand in for it, or
    admission over-commits the cache and every later step preempts (docs/design.md section 8)."""
    p, launched, plen = req.params, req.num_launched_outputs, req.prompt_len
    most = min(p.max_tokens - launched, max_len - plen - launched)
    exact = p.ignore_eos and not p.stop and not p.stop_token_ids
    est = p.max_tokens if exact or mean_out is None else min(p.max_tokens, mean_out)
    return (most if exact else max(0, min(p.min_tokens - launched, most))), most, \
        min(plen + max(est, launched + 1), max_len)


def held_from(req: Request) -> int:
    """Positions `req` holds once its prompt is in: where its memory forecast starts (`Batcher._span`)."""
    return max(req.num_computed, req.prompt_len)


class BucketFit:
    DEFER_SLACK = 0.5          # a decode-only step of up to (1 + this) x a bucket may run in that bucket
    SHORTEN_PAD = 0.25         # a mixed step padding its bucket by more than this share may run in the one below

    def _fit_bucket(self, batch: Batch) -> int:
        """The step's token bucket: the smallest that holds the batch, or the one below for a decode-only step
        whose decodes past it have slack (`_defer`) and for a mostly-decode step whose prefill chunks would pad
        the bucket above by more than `SHORTEN_PAD` of it (`_shorten_chunks`)."""
        n = batch.num_tokens
        chunks = len(batch.seqs) - batch.num_decode
        copy = self._copy_limits.get(self.budget)           # a normal bucket's prefill copy (prefill_dequant_first)
        if n > self.budget or chunks > self.cfg.max_prefill_seqs or (copy and self._copy_used > copy):
            self._deferred = set()
            return self.prefill_budget                # only a step `_step_limits` gave the prefill bucket's room
        lower = max((b for b in self.cfg.token_buckets if b < n), default=0)
        deferred: set[int] = set()
        if chunks:
            upper = min((b for b in self.cfg.token_buckets if b >= n), default=self.budget)
            if (upper - n > self.SHORTEN_PAD * upper and 2 * batch.num_decode >= lower
                    and lower >= batch.num_decode + chunks):
                n -= self._shorten_chunks(batch, n - lower)
        elif lower and n <= lower * (1 + self.DEFER_SLACK) and self._can_defer(batch):
            deferred = self._defer(batch, n - lower)
            n = batch.num_tokens
        self._deferred = deferred | self._made_room
        return min((b for b in self.cfg.token_buckets if b >= n), default=self.budget)

    def _shorten_chunks(self, batch: Batch, cut: int) -> int:
        """Take `cut` tokens off the prefill chunks, newest first, each keeping one: the rest of those prompts
        goes in later steps (first in line: running prefills come before admissions), in their padding where
        they have some. Pages grown for the longer chunk stay with the request for its next chunk. kivi64: a
        chunk is cut to a multiple of 64 (keeping one group), so at least `cut` tokens, or none at all when that
        cannot reach `cut`. Returns the tokens taken."""
        g, plan, left = self.group, [], cut
        for s in reversed(batch.seqs[batch.num_decode:]):
            if left <= 0:
                break
            if g:
                end, first = s.start + s.num_tokens, s.start + g       # first: the chunk's first group boundary
                take = end - max((end - left) // g * g, first) if first < end else 0
            else:
                take = min(left, s.num_tokens - 1)
            plan.append((s, take))
            left -= take
        if left > 0:
            return 0
        for s, take in plan:
            s.num_tokens -= take
            s.samples = s.start + s.num_tokens == s.req.prompt_len
        return cut - left

    def _can_defer(self, batch: Batch) -> bool:
        """Only a step of every running request's decode (those whose last token is in flight aside), with
        nothing waiting or swapped out: then leaving a decode out delays no admission, and the pages it holds
        longer are checked in `_defer`."""
        return not (batch.num_decode != len(batch.seqs) or self._missed or self.waiting or self.swapped
                    or batch.swap_in or batch.swap_out)

    def _defer(self, batch: Batch, k: int) -> set[int]:
        """Leave `k` decodes out of `batch` if that many have slack: at half speed (never left out two steps in
        a row) they still end before the running request with the most steps surely left, so the run does not
        get longer; and if the pages of all of them at their predicted ends still fit beside the others'
        forecast peak. Returns id() of those left out (none if the step cannot shrink by `k`).
        Runs for every row of most decode-only steps: one `predicted` call a row."""
        reqs = [s.req for s in batch.seqs]
        max_len, mean_out = self.max_model_len, self._mean_out()
        least, most, final = zip(*(predicted(r, max_len, mean_out) for r in reqs))
        longest = max(least)
        slack = [i for i, m in enumerate(most) if 2 * m <= longest and id(reqs[i]) not in self._deferred]
        if len(slack) < k:
            return set()
        slack.sort(key=most.__getitem__)            # the nearest ends first
        out = set(slack[:k])
        forecast, held = self.FORECAST(self.cache.page_size), 0
        for i in range(len(reqs)):
            if i in out:
                held += self.cache.pages_for(final[i])
            else:
                forecast.add(held_from(reqs[i]), final[i])       # `_span`
        if forecast.peak() + held > self.allocator.capacity:
            return set()
        deferred = {id(reqs[i]) for i in out}
        batch.seqs = [s for i, s in enumerate(batch.seqs) if i not in out]
        batch.num_decode = len(batch.seqs)
        return deferred
