"""What the engine hands back: one RequestOutput per request per step it advanced, plus the final one."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob under the model's raw distribution (log_softmax of the logits before
    temperature, penalties, top-k and top-p: vLLM's default), with the top alternatives."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]     # the top-k (id, logprob), best first (k = SamplingParams.logprobs)


_UNSET = object()
# the constructor's arguments, in order: what copies, pickles, equality and repr read
_FIELDS = ("request_id", "prompt_token_ids", "token_ids", "text", "new_token_ids", "new_text", "finished",
           "finish_reason", "metrics", "new_logprobs", "logprobs", "cumulative_logprob")


class RequestOutput:
    """A request's state after one step. Fields:

    request_id, prompt_token_ids;
    token_ids: generated ids so far (all of them); text: generated text so far (stop strings removed);
    new_token_ids: ids added by this step; new_text: text released by this step (UTF-8 safe; partial stop strings
    held back); finished; finish_reason: "stop" | "length" | "abort" | None while running;
    metrics: arrival, ttft_s, e2e_s;
    with SamplingParams.logprobs set (None when off): new_logprobs (one per id in new_token_ids), logprobs (one
    per id in token_ids), cumulative_logprob (the sum of the generated tokens' logprobs).

    The engine's outputs are views of their request as it was after the step (`RequestOutput.view`): token_ids,
    text, logprobs and metrics are copied out of it when first read, so a step costs no copy of a whole output
    (O(output length) per sequence per step), and a reader gets the same values whenever it reads them.
    """

    __slots__ = ("request_id", "prompt_token_ids", "new_token_ids", "new_text", "finished", "finish_reason",
                 "new_logprobs", "cumulative_logprob", "_token_ids", "_text", "_metrics", "_logprobs", "_req",
                 "_n", "_chars")

    def __init__(self, request_id: str, prompt_token_ids: list[int], token_ids: list[int], text: str,
                 new_token_ids: list[int], new_text: str, finished: bool, finish_reason: str | None,
                 metrics: dict | None = None, new_logprobs: list[TokenLogprob] | None = None,
                 logprobs: list[TokenLogprob] | None = None, cumulative_logprob: float | None = None):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.new_token_ids, self.new_text = new_token_ids, new_text
        self.finished, self.finish_reason = finished, finish_reason
        self.new_logprobs, self.cumulative_logprob = new_logprobs, cumulative_logprob
        self._token_ids, self._text, self._logprobs = token_ids, text, logprobs
        self._metrics = {} if metrics is None else metrics
        self._req = None

    @classmethod
    def view(cls, req, new_token_ids: list[int], new_text: str, new_logprobs: list[TokenLogprob] | None
             ) -> "RequestOutput":
        """The output of `req` (a Request whose `out_text` is its OutputText) as it stands now."""
        o = cls.__new__(cls)
        o.request_id, o.prompt_token_ids = req.request_id, req.prompt_ids
        o.new_token_ids, o.new_text, o.new_logprobs = new_token_ids, new_text, new_logprobs
        o.finished, o.finish_reason = req.finished, req.finish_reason
        on = req.params.logprobs is not None
        o.cumulative_logprob = req.cumulative_logprob if on else None
        o._token_ids = o._text = o._metrics = _UNSET
        o._logprobs = _UNSET if on else None
        # output_ids and logprobs only grow, and the text only grows past what was released (a stop string is
        # never cut inside released text), so their prefixes are what they were at this step
        o._req, o._n, o._chars = req, len(req.output_ids), req.out_text.released
        return o

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is _UNSET:
            self._token_ids = self._req.output_ids[:self._n]
        return self._token_ids

    @property
    def text(self) -> str:
        if self._text is _UNSET:
            self._text = self._req.out_text.released_text[:self._chars]
        return self._text

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        if self._logprobs is _UNSET:
            self._logprobs = self._req.logprobs[:self._n]
        return self._logprobs

    @property
    def metrics(self) -> dict:
        if self._metrics is _UNSET:
            m = self._req.timings.as_dict()
            if not self.finished:         # the request may have finished since
                m["e2e_s"] = None
            self._metrics = m
        return self._metrics

    def _fields(self) -> tuple:
        return tuple(getattr(self, k) for k in _FIELDS)

    def __reduce__(self):                 # copies and pickles hold the values, not the request
        return RequestOutput, self._fields()

    def __eq__(self, other) -> bool:
        return isinstance(other, RequestOutput) and self._fields() == other._fields()

    __hash__ = None

    def __repr__(self) -> str:
        return "RequestOutput(" + ", ".join(f"{k}={v!r}" for k, v in zip(_FIELDS, self._fields())) + ")"
