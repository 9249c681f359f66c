"""Per-request sampling parameters, validated on construction (bad values raise UserError naming the field)."""
from __future__ import annotations

from dataclasses import dataclass, field

from nfjax.errors import UserError


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

    @classmethod
    def greedy(cls, max_tokens: int = 16, **kw) -> "SamplingParams":
        return cls(temperature=0.0, max_tokens=max_tokens, **kw)


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise UserError(f"{name} {what}")
