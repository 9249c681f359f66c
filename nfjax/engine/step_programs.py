"""The jitted pieces of a step (embed, a group of layers, the heads) and the split of a model into its layers
and the rest; `Runner` (nfjax/engine/runner.py) compiles them per bucket and launches them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int

from nfjax.engine.penalties import FullInput, Logprobs, PenaltyState, full_sample
from nfjax.engine.sampler import sample
from nfjax.engine.step_input import StepInput, unpack
from nfjax.kv.cache import KVCache
from nfjax.kv.metadata import AttentionMetadata
from nfjax.models.llama import ForwardOptions, LlamaModel, layer_forward
from nfjax.parallel import TP_AXIS, kv_spec


def on_leaves(fn, tdef):
    """`fn(tree, *rest)` as a function of the tree's leaves (one flat tuple): a compiled program called with nnx
    States flattens them in Python on every call (265 us against 54 for a 4-layer group on a CPU host, so a
    32-layer step paid milliseconds of dispatch); a tuple of arrays flattens in C++."""
    def f(leaves, *rest):
        return fn(jax.tree.unflatten(tdef, leaves), *rest)
    return f


def embed_step(rest_gd, rest_state, prev: Int[Array, "S"], inp: StepInput) -> Float[Array, "T D"]:
    tokens = jnp.where(inp.token_src >= 0, prev[jnp.maximum(inp.token_src, 0)], inp.tokens)
    return nnx.merge(rest_gd, rest_state).embed_input(tokens, inp.meta.positions)


def layers_step(layer_gd, layer_specs, mesh: Mesh, layer_fn, opts: ForwardOptions, inv_freq, layer_states: tuple,
            kv: KVCache, x: Float[Array, "T D"], meta: AttentionMetadata, i0: Int[Array, ""]):
    """Consecutive layers i0, i0 + 1, ... (one per state in `layer_states`) under the shard_map (local weight
    shards and KV heads; explicit psums in the ops). With one device there is no shard_map, so stream regions
    (`compute_on`) sit directly in the program's entry computation."""
    tp = mesh.shape[TP_AXIS]

    def body(layer_states, kv, x, meta, i0):
        x = getattr(layer_fn, "split_carry", lambda v: v)(x)
        for j, st in enumerate(layer_states):
            x, kv = layer_forward(nnx.merge(layer_gd, st), i0 + j, x, kv, meta, inv_freq, layer_fn,
                                  TP_AXIS if tp > 1 else None, opts)
        return getattr(layer_fn, "join_carry", lambda v: v)(x), kv

    if tp == 1:
        return body(layer_states, kv, x, meta, i0)
    kvs = kv.like(kv_spec())
    specs = (layer_specs,) * len(layer_states)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, kvs, P(), P(), P()), out_specs=(P(), kvs),
                         check_vma=not opts.skip_collectives)(layer_states, kv, x, meta, i0)


# The plain heads compiled per bucket: greedy (argmax only), sample (temperature draws, no sort), limits (a sort
# per row for top-k / top-p); nfjax/engine/sampler.py
HEAD_MODES = ("greedy", "sample", "limits")


def head_mode(any_sampled: bool, limits: bool) -> str:
    """The plain head a batch runs: `any_sampled` some row has temperature > 0, `limits` some such row a top-k
    or top-p."""
    return ("limits" if limits else "sample") if any_sampled else "greedy"


def head_step(rest_gd, mode: str, max_seqs: int, rest_state, x: Float[Array, "T D"],
          inp: StepInput) -> Int[Array, "M"]:
    """Samples of the bucket's S rows, padded to `max_seqs` rows: every bucket's embed reads the same shape."""
    model = nnx.merge(rest_gd, rest_state)
    logits = model.logits(model.norm(x[inp.meta.logits_index]))      # the norm is per row: only S rows
    out = sample(logits, inp.temperature, inp.top_k, inp.top_p, inp.seeds, inp.counters,
                 any_sampled=mode != "greedy", limits=mode == "limits")
    return jnp.pad(out, (0, max_seqs - out.shape[0]))


def full_head_step(rest_gd, max_seqs: int, like: FullInput, rest_state, x: Float[Array, "T D"], inp: StepInput,
               packed: Int[Array, "N"], state: PenaltyState) -> tuple[Int[Array, "M"], Logprobs, PenaltyState]:
    """The head of a batch with penalties, min_tokens or logprobs (nfjax/engine/penalties.py): `packed` holds
    the step's `FullInput` (shaped like `like`), `state` the penalty slots (donated, updated in place)."""
    model = nnx.merge(rest_gd, rest_state)
    logits = model.logits(model.norm(x[inp.meta.logits_index]))
    out, logprobs, state = full_sample(logits, inp, unpack(like, packed), state)
    return jnp.pad(out, (0, max_seqs - out.shape[0])), logprobs, state


def seed_slot(state: PenaltyState, slot: Int[Array, ""], tokens: Int[Array, "N"]) -> PenaltyState:
    """The slot's counts cleared and its prompt flags set to `tokens` (padding: ids >= vocab, dropped)."""
    return PenaltyState(state.counts.at[slot].set(0),
                        state.in_prompt.at[slot].set(False).at[slot, tokens].set(True, mode="drop"))


def layer_groups(num_layers: int, size: int) -> list[tuple[int, int]]:
    """(first layer, count) of each program's layers: `size` at a time, the remainder last."""
    return [(i, min(size, num_layers - i)) for i in range(0, num_layers, size)]


def split_layers(model: LlamaModel):
    """(graphdef, state) of the model without its layers, and (graphdef, stacked state) of the layers."""
    layers = model.layers
    model.layers = None
    try:
        rest_gd, rest_state = nnx.split(model)
    finally:
        model.layers = layers
    layer_gd, stacked = nnx.split(layers)
    return rest_gd, rest_state, layer_gd, stacked
