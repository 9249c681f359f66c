"""What the engine hands back: one RequestOutput per request per step it advanced, plus the final one."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob under the model's raw distribution (log_softmax of the logits before
    temperature, penalties, top-k and top-p: vLLM's default), with the top alternatives."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]     # the top-k (id, logprob), best first (k = SamplingParams.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]            # generated ids so far (all of them)
    text: str                       # generated text so far (stop strings removed)
    new_token_ids: list[int]        # ids added by this step
    new_text: str                   # text released by this step (UTF-8 safe; partial stop strings held back)
    finished: bool
    finish_reason: str | None       # "stop" | "length" | "abort" | None while running
    metrics: dict = field(default_factory=dict)   # arrival, ttft_s, e2e_s
    # With SamplingParams.logprobs set (None when off):
    new_logprobs: list[TokenLogprob] | None = None   # one per id in new_token_ids
    logprobs: list[TokenLogprob] | None = None       # one per id in token_ids
    cumulative_logprob: float | None = None          # sum of the generated tokens' logprobs
