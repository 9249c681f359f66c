"""Per-request sampling parameters, validated on construction (bad values raise UserError naming the field).

The penalties, `min_tokens` and `logprobs` run on the device inside the step (nfjax/engine/penalties.py); a batch
with a request that needs them runs the step's "full" head (docs/design.md section 10)."""
from __future__ import annotations

from dataclasses import dataclass

from nfjax.errors import UserError

MAX_LOGPROBS = 20       # top alternatives a request may ask for; the full head always computes this many


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    seed: int | None = None           # per-request seed: same seed, same tokens, whatever the batch
    max_tokens: int = 16
    stop: tuple[str, ...] = ()        # stop strings (excluded from the returned text)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # OpenAI penalties over the request's generated tokens: logits -= frequency * count + presence * (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's: over prompt and generated tokens, positive logits divided by it, negative ones multiplied
    repetition_penalty: float = 1.0
    min_tokens: int = 0               # until this many are generated, EOS / stop_token_ids / stop strings do not end it
    logprobs: int | None = None       # None = off; k = each generated token's logprob and the top k (0..20)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 100, "temperature",
               "must be a number in [0, 100]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an integer >= 0")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "seed",
               "must be a non-negative integer")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_number(v) and -2 <= v <= 2, name, "must be a number in [-2, 2]")
        _check(_number(self.repetition_penalty) and 0 < self.repetition_penalty < float("inf"), "repetition_penalty",
               "must be a number > 0")
        _check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
               and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be an integer in [0, max_tokens]")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")

    @property
    def has_penalties(self) -> bool:
        """Any penalty away from neutral: the request holds a penalty slot (token counts on the device)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @classmethod
    def greedy(cls, max_tokens: int = 16, **kw) -> "SamplingParams":
        return cls(temperature=0.0, max_tokens=max_tokens, **kw)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v       # not NaN


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise UserError(f"{name} {what}")
