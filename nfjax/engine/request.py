"""A request's lifecycle: waiting -> prefilling (chunks) -> decoding -> finished; may be swapped out on the way."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from nfjax.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"        # admitted to the queue, no KV yet
    RUNNING = "running"        # holds device pages; prefilling or decoding
    SWAPPED = "swapped"        # preempted: KV pages live in host memory
    FINISHED = "finished"


@dataclass
class Timings:
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None

    def as_dict(self) -> dict:
        ttft = None if self.first_token is None else self.first_token - self.arrival
        e2e = None if self.finished is None else self.finished - self.arrival
        return {"arrival": self.arrival, "ttft_s": ttft, "e2e_s": e2e}


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                                   # resolved per-request seed
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)   # tokens seen on the host
    pages: list[int] = field(default_factory=list)         # device pages, in position order
    num_computed: int = 0        # tokens whose KV is written by launched steps (prompt and generated)
    num_launched_outputs: int = 0  # outputs that launched steps will produce (host learns them one step late)
    finish_reason: str | None = None
    host_kv: object = None       # swapped-out KV (host arrays) while SWAPPED
    penalty_slot: int | None = None   # row of the device's token counts (penalties), held from admission to finish
    logprobs: list = field(default_factory=list)   # TokenLogprob per output (SamplingParams.logprobs set)
    out_text: object = None      # its OutputText (nfjax/engine/detok.py), set by the engine
    cumulative_logprob: float = 0.0
    # prefix cache (nfjax/kv/allocator.py): hashes of its full pages (as far as the host knows the tokens), the
    # leading pages already offered to the cache, and prompt tokens reused at admission per tier
    page_hashes: list = field(default_factory=list)
    num_registered: int = 0
    reused: dict = field(default_factory=dict)
    # What the step's head must do for it (set from params; read per step, so plain flags): penalties in every
    # step, logprobs / min_tokens where it samples (nfjax/engine/penalties.py, `needs_full`)
    penalized: bool = field(init=False, default=False)
    full_when_sampling: bool = field(init=False, default=False)
    # len(prompt_ids), which never changes: a plain attribute because the batcher reads it for every running
    # request in every step (a property's call was a tenth of a 384-row step's formation)
    prompt_len: int = field(init=False, default=0)

    def __post_init__(self):
        p = self.params
        self.penalized = p.has_penalties
        self.full_when_sampling = p.logprobs is not None or p.min_tokens > 0
        if not isinstance(self.prompt_ids, list):      # `tokens` joins slices of it to lists
            self.prompt_ids = list(self.prompt_ids)
        self.prompt_len = len(self.prompt_ids)
    timings: Timings = field(default_factory=Timings)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def total_len(self) -> int:
        """Tokens the sequence will hold once all launched steps land."""
        return self.prompt_len + self.num_launched_outputs

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_at(self, pos: int) -> int | None:
        """Token id at `pos` if the host knows it (prompt or a generated token already read back)."""
        n = self.prompt_len
        if pos < n:
            return self.prompt_ids[pos]
        out = self.output_ids
        return out[pos - n] if pos - n < len(out) else None

    def tokens(self, lo: int, hi: int) -> list[int] | None:
        """Token ids at positions [lo, hi) if the host knows them all, else None."""
        n = self.prompt_len
        if hi <= n:
            return self.prompt_ids[lo:hi]
        if hi - n > len(self.output_ids):
            return None
        return self.prompt_ids[lo:n] + self.output_ids[max(lo - n, 0):hi - n] if lo < n else \
            self.output_ids[lo - n:hi - n]
