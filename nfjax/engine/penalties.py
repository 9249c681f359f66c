"""The step's "full" head: penalties, min_tokens and logprobs computed on the device, inside the step.

The host learns a step's tokens one step late (it launches step i+1 before reading step i), so whatever depends
on the generated tokens lives on the device: `PenaltyState` keeps, per *penalty slot*, the count of every token
the request has generated and whether each token is in its prompt. A request with a penalty holds a slot from
admission to finish (through preemption: the state stays on the device while its KV is swapped out). The head
updates the state with each step's prompt tokens and samples; the host only says, per row, which slot to read
and write (`FullInput`), and copies that over with the step only when the batch runs the full head.

A batch runs this head when a request in it needs one of these features (`needs_full`); otherwise a plain head
runs: greedy, sampling, or sampling with top-k / top-p (docs/design.md sections 2 and 10).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int, Int16

from nfjax.engine.sampler import sample
from nfjax.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from nfjax.engine.step_input import StepInput

MAX_BANNED = 16           # ids a row can ban under min_tokens (EOS ids + stop_token_ids); more is a UserError
FAST_TOP_K = 16          # the largest top-k XLA:GPU runs without sorting whole rows (see `top_k`)
COUNT_MAX = np.iinfo(np.int16).max      # counts saturate here (a frequency penalty of 0.001 is then 33 logits)


def num_penalty_slots(max_seqs: int) -> int:
    """Penalty slots the engine keeps: one per sequence a step can hold. More requests with penalties than this
    wait for a slot at admission (`Batcher`)."""
    return max_seqs


def state_bytes(slots: int, vocab: int) -> int:
    """Device bytes of `PenaltyState` (per device: it is replicated): int16 counts + bool prompt flags."""
    return slots * vocab * 3


@jax.tree_util.register_dataclass
@dataclass
class PenaltyState:
    counts: Int16[Array, "P V"]       # tokens generated so far, per penalty slot (saturating at COUNT_MAX)
    in_prompt: Bool[Array, "P V"]     # the tokens of the slot's prompt

    @classmethod
    def create(cls, slots: int, vocab: int, sharding=None) -> "PenaltyState":
        return jax.device_put(cls(jnp.zeros((slots, vocab), jnp.int16), jnp.zeros((slots, vocab), bool)), sharding)


@jax.tree_util.register_dataclass
@dataclass
class FullInput:
    """The full head's per-step inputs (host numpy, packed into one int32 vector like `StepInput`). A slot
    index equal to the number of slots means none: its reads give zeros and its writes are dropped."""
    slot: Int[Array, "S"]             # the row's penalty slot (penalties read it)
    reset_slot: Int[Array, "S"]       # a request's first prompt chunk: clear its slot before this step's writes
    count_slot: Int[Array, "S"]       # a sampling row with a slot: its sampled token is counted there
    token_slot: Int[Array, "T"]       # a prompt token of a request with a slot: marked in its slot's prompt flags
    presence: Float[Array, "S"]
    frequency: Float[Array, "S"]
    repetition: Float[Array, "S"]
    banned: Int[Array, "S B"]         # ids that cannot be sampled this step (min_tokens); padding: vocab size

    @classmethod
    def empty(cls, rows: int, tokens: int, slots: int, vocab: int) -> "FullInput":
        none = np.full(rows, slots, np.int32)
        zero = np.zeros(rows, np.float32)
        return cls(none, none.copy(), none.copy(), np.full(tokens, slots, np.int32), zero, zero.copy(), zero + 1,
                   np.full((rows, MAX_BANNED), vocab, np.int32))


@jax.tree_util.register_dataclass
@dataclass
class Logprobs:
    """Raw logprobs (log_softmax of the model's logits) of each row's sample and its top alternatives."""
    token: Float[Array, "S"]
    top_ids: Int[Array, "S K"]        # best first
    top: Float[Array, "S K"]


# ---- host -----------------------------------------------------------------------------------------------------
def banned_ids(params: SamplingParams, eos: tuple[int, ...] | frozenset) -> list[int]:
    """Ids a request cannot sample while under `min_tokens`: its stop_token_ids, and EOS unless ignore_eos."""
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos)))


def needs_full(sq) -> bool:
    """Does this scheduled sequence (`batcher.ScheduledSeq`) need the full head? A request with penalties in
    every step (its counts and prompt flags follow each step); logprobs and min_tokens only where it samples."""
    r = sq.req
    if r.penalized:
        return True
    if not (sq.samples and r.full_when_sampling):
        return False
    return r.params.logprobs is not None or r.num_launched_outputs - 1 < r.params.min_tokens


def full_input(batch, rows: int, slots: int, vocab: int, eos) -> FullInput:
    """The host `FullInput` of a formed `batch` (its sequences' counters already advanced by the batcher)."""
    f = FullInput.empty(rows, batch.bucket, slots, vocab)
    off = 0
    for i, sq in enumerate(batch.seqs):
        r, p = sq.req, sq.req.params
        if r.penalty_slot is not None:
            f.slot[i] = r.penalty_slot
            f.presence[i] = p.presence_penalty
            f.frequency[i] = p.frequency_penalty
            f.repetition[i] = p.repetition_penalty
            if sq.start == 0:                           # its first prompt chunk: the slot's last owner is done
                f.reset_slot[i] = r.penalty_slot
            if sq.samples:
                f.count_slot[i] = r.penalty_slot
            if sq.start < r.prompt_len:                 # a prompt chunk (it never runs past the prompt)
                f.token_slot[off:off + sq.num_tokens] = r.penalty_slot
        if sq.samples and r.num_launched_outputs - 1 < p.min_tokens:
            ids = banned_ids(p, eos)
            f.banned[i, :len(ids)] = ids
        off += sq.num_tokens
    return f


# ---- device ---------------------------------------------------------------------------------------------------
def apply_penalties(logits: Float[Array, "S V"], counts: Int16[Array, "S V"], in_prompt: Bool[Array, "S V"],
                    presence: Float[Array, "S"], frequency: Float[Array, "S"],
                    repetition: Float[Array, "S"]) -> Float[Array, "S V"]:
    """vLLM's order: the repetition penalty over prompt and generated tokens (positive logits divided by it,
    the others multiplied), then OpenAI's `frequency * count + presence * (count > 0)` over generated ones.
    Neutral values (1, 0, 0) leave a row's logits bit for bit as they were."""
    generated = counts > 0
    rep = repetition[:, None]
    logits = jnp.where(generated | in_prompt, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - frequency[:, None] * counts.astype(jnp.float32)
            - presence[:, None] * generated.astype(jnp.float32))


def ban(logits: Float[Array, "S V"], banned: Int[Array, "S B"]) -> Float[Array, "S V"]:
    """`banned` ids of each row to -inf (ids >= V are padding and change nothing)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, banned].set(-jnp.inf, mode="drop")


def top_k(x: Float[Array, "S V"], k: int) -> tuple[Float[Array, "S K"], Int[Array, "S K"]]:
    """`lax.top_k` in rounds of at most FAST_TOP_K, each round's winners masked out of the next. XLA:GPU runs a
    top-k of up to 16 as its own kernel and a larger one as a full sort of the rows: at 512 x 128,256, top 20
    took 4.66 ms and top 16 then top 4 1.47 ms (H100, bench/results/full_head-20261124.json)."""
    vals, ids = [], []
    rows = jnp.arange(x.shape[0])[:, None]
    while k > 0:
        v, i = lax.top_k(x, min(k, FAST_TOP_K))
        vals.append(v)
        ids.append(i)
        k -= v.shape[-1]
        if k > 0:
            x = x.at[rows, i].set(-jnp.inf)
    return jnp.concatenate(vals, axis=-1), jnp.concatenate(ids, axis=-1).astype(jnp.int32)


def raw_logprobs(logits: Float[Array, "S V"], tokens: Int[Array, "S"]) -> Logprobs:
    logp = jax.nn.log_softmax(logits, axis=-1)
    top, top_ids = top_k(logp, min(MAX_LOGPROBS, logits.shape[-1]))
    return Logprobs(jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0], top_ids, top)


def full_sample(logits: Float[Array, "S V"], inp: StepInput, f: FullInput,
                state: PenaltyState) -> tuple[Int[Array, "S"], Logprobs, PenaltyState]:
    """Samples after penalties and min_tokens bans, raw logprobs, and the state updated with this step."""
    raw = logits.astype(jnp.float32)
    counts = state.counts.at[f.reset_slot].set(0, mode="drop")
    in_prompt = state.in_prompt.at[f.reset_slot].set(False, mode="drop")
    in_prompt = in_prompt.at[f.token_slot, inp.tokens].set(True, mode="drop")
    row_counts = counts.at[f.slot].get(mode="fill", fill_value=0)
    row_prompt = in_prompt.at[f.slot].get(mode="fill", fill_value=False)
    x = apply_penalties(raw, row_counts, row_prompt, f.presence, f.frequency, f.repetition)
    tokens = sample(ban(x, f.banned), inp.temperature, inp.top_k, inp.top_p, inp.seeds, inp.counters,
                    any_sampled=True)
    seen = jnp.take_along_axis(row_counts, tokens[:, None], axis=-1)[:, 0]
    counts = counts.at[f.count_slot, tokens].set(jnp.minimum(seen, COUNT_MAX - 1) + 1, mode="drop")
    return tokens, raw_logprobs(raw, tokens), PenaltyState(counts, in_prompt)
