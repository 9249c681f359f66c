"""The cost model of the zig-zag block schedule (FlexGen section 4.3), for our runtime (nfjax/offload/schedule.py).

A pass runs every layer over the block's `nb` GPU batches of `bs` sequences. Within a layer, computations and
the transfers of the layer's data overlap (the next layer's weights, the next batch's KV block and activations,
the previous batch's stores all run on the I/O threads while the device computes), so a layer takes the longest
of seven lanes, each summed over the block's batches:

  compute    the device's matmuls (a roofline: max(flops / the GEMM rate at the batch's tokens, weight bytes /
             memory bandwidth), per batch), attention (the runtime's dense masked attention over the whole block
             of S positions), one program dispatch a batch, 4-bit weights decompressed once a layer
  cpu        under `cpu_attention`, the decode attention of CPU-held KV on the CPU thread (with one batch a block
             it is in series with the device, so it is counted in `compute` instead), at the rate of the threads
             its block's pieces keep busy (`hw.cpu_attention_s`: a one-sequence block runs on ~3 of them)
  h2d        the host -> device link: every byte that crosses it (weights in host memory or read from disk, KV
             blocks held off the device, as `KVStore.load` moves them whole, activations held off the device) at
             the link's rate (a pinned buffer's DMA), and the pinned weights' and KV blocks' per-transfer cost
  h2d_stage  the pageable copies' host side: a numpy (or disk-read) array crosses through a staging buffer, at
             the measured numpy -> device rate (a KV block's K and V pair at the block's size), with each transfer's
             fixed cost. The I/O threads run it beside the pinned weights' DMA (a pinned weight does not wait for
             a KV block's staging), so the link and the staging are two lanes, not one sum. KV blocks load one
             at a time, so a disk-held block's file read is in this lane too, before its staging (the LP's
             first pick balanced a disk lane against this one and ran at the sum: 60 ms a layer, modelled 41).
             Under host memory "pinned" a host-held KV block is a pinned array whose load is a DMA (the h2d lane's):
             only disk-held blocks are staged. (Staged host blocks ran 1.3-3.5x slower than alone while a weight's
             DMA was in flight, small blocks the most: docs/design.md section 11; not modelled for host memory "numpy".)
  d2h        device -> host: the KV rows a computation wrote (a prefill's through pinned memory where the
             policy's host memory is pinned: `hw.kv_store_rate`), activations
  disk read  weights, KV blocks and activations read from the disk tier
  disk write the KV rows and activations written to it

  T = L x (t_prefill + (n - 1) x t_decode) + per-pass fixed costs (embedding, head, sampling, one host sync)
  throughput = bs x nb x n / T                                     (n generated tokens a sequence)

Every lane and every tier's memory is linear in the nine placement fractions (weights, KV cache, activations on
gpu / cpu / disk), so the same expressions are evaluated here for a policy and handed to the LP
(nfjax/offload/search.py). Memory per tier follows `budget.needs` (the totals are taken from it at the
all-on-one-tier placements, where its tensor and block granularity is exact).

Not modelled (stated in docs/design.md): the page cache (disk rates are measured cold, with fsync), Top-K
attention (the runtime computes every score, so it saves nothing here), thread contention between lanes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from nfjax.config import ModelConfig
from nfjax.offload import budget
from nfjax.offload.hardware import HardwareProfile
from nfjax.offload.cpu_attention import piece_count
from nfjax.offload.policy import Policy, Split
from nfjax.offload.store import index_tiers, kv_tiers, weight_tiers
from pallas_kernels import kv_quant

FRACS = ("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd")
KINDS = {"weights": ("wg", "wc", "wd"), "cache": ("cg", "cc", "cd"), "activations": ("hg", "hc", "hd")}
LANES = ("compute", "cpu", "h2d", "h2d_stage", "d2h", "disk_read", "disk_write")
ALIGN = 16                         # the engine pads prefill and the block's positions to multiples of this


Lin = dict          # a linear expression: variable name -> coefficient, "" -> the constant


def lin(const: float = 0.0, **coefs: float) -> Lin:
    out = {"": float(const)}
    out.update({k: float(v) for k, v in coefs.items()})
    return out


def add(*exprs: Lin) -> Lin:
    out: Lin = {"": 0.0}
    for e in exprs:
        for k, v in e.items():
            out[k] = out.get(k, 0.0) + v
    return out


def value(e: Lin, fr) -> float:
    """`e` at the fractions `fr` (a dict of numbers, or of numpy arrays: evaluated elementwise)."""
    return e.get("", 0.0) + sum(c * fr[k] for k, c in e.items() if k)


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    gen_len: int
    max_len: int | None = None           # the engine's context (the KV cache's and the budget's size); None:
    #                                      prompt_len + gen_len

    @property
    def context(self) -> int:
        return self.max_len or self.prompt_len + self.gen_len


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class LayerCost:
    """The linear expressions of one (bs, nb, flags) choice: lanes per phase, fixed costs, memory per tier."""
    prefill: dict[str, Lin]
    decode: dict[str, Lin]
    fixed_prefill: float                       # seconds a pass outside the layers
    fixed_decode: float
    memory: dict[str, Lin]                     # bytes per tier, without the 2 loaded KV blocks
    kv_buffer: float                           # the 2 loaded KV blocks on the GPU (when any block is off it)
    layers: int
    block: int
    gen_len: int
    info: dict = field(default_factory=dict)

    def phase_time(self, phase: str, fr) -> float:
        lanes = self.prefill if phase == "prefill" else self.decode
        return max(value(e, fr) for e in lanes.values())

    def total_time(self, fr) -> float:
        return (self.layers * self.phase_time("prefill", fr) + self.fixed_prefill
                + (self.gen_len - 1) * (self.layers * self.phase_time("decode", fr) + self.fixed_decode))

    def throughput(self, fr) -> float:
        return self.block * self.gen_len / self.total_time(fr)

    def total_time_by_layer(self, frs: list) -> float:
        """`total_time` with each layer at its own fractions (`layer_fractions`): the sum of each layer's longest
        lane, not the longest of the averaged lanes (the runtime puts a policy's disk blocks in its last layers,
        and a layer with them waits for their reads)."""
        pre = sum(max(value(e, fr) for e in self.prefill.values()) for fr in frs)
        dec = sum(max(value(e, fr) for e in self.decode.values()) for fr in frs)
        return pre + self.fixed_prefill + (self.gen_len - 1) * (dec + self.fixed_decode)

    def tier_bytes(self, fr) -> dict[str, float]:
        out = {t: value(e, fr) for t, e in self.memory.items()}
        if fr["cg"] < 1 - 1e-9:
            out["gpu"] += self.kv_buffer
        return out


def queue_wait_s(cfg: ModelConfig, hw: HardwareProfile) -> float:
    """How long a small host -> device copy waits when a layer's weights are crossing: the device takes host copies
    in order, so it waits out the rest of the weight tensor in flight, on average half of a tensor drawn by its
    bytes (sum s^2 / (2 sum s) at the link's rate: 3.0 ms for OPT-30B's layer on an H100 host). Traced: a CPU
    attention step's output upload, 3-6 ms a step more than its attention; a 16 MB staged KV block, 13 ms with a
    weight in flight against 3.7 without (docs/design.md section 11)."""
    _, shapes = budget.layer_shapes(cfg)
    item = 2 if cfg.dtype == "bfloat16" else 4
    sizes = [math.prod(x) * item for x in shapes]
    return sum(x * x for x in sizes) / (2 * sum(sizes)) / hw.link_h2d()


def _by_what(ns: list, tier: str, prefix: str) -> int:
    return sum(n.bytes for n in ns if n.tier == tier and n.what.startswith(prefix))


def layer_cost(cfg: ModelConfig, bs: int, nb: int, workload: Workload, hw: HardwareProfile,
               compress_weights: bool = False, compress_cache: bool = False, cpu_attention: bool = False,
               host_memory: str = "pinned", schedule: str = "zigzag", weights_off: float = 1.0) -> LayerCost:
    """The lanes of one layer of a pass (see the module's docstring). `schedule="row_by_row"`: the baseline, every
    batch in turn fetching the layer's weights, loading its KV block, computing and storing its rows, nothing
    overlapping: one lane, "serial", their sum (not used by the search; the bench's baseline records it).
    `weights_off`: the share of a layer's weight bytes off the GPU, the chance a small host -> device copy finds a
    weight's DMA ahead of it (`queue_wait_s`; a product of placements, so the LP takes 1, its worst case, and
    `predict` the policy's own)."""
    item = 2 if cfg.dtype == "bfloat16" else 4
    L, d, v = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    h, kh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ctx = workload.context
    base = Policy(gpu_batch_size=bs, num_gpu_batches=nb, compress_weights=compress_weights,
                  compress_cache=compress_cache)
    # totals at the all-on-one-tier placements (budget.needs is exact there)
    on_gpu = budget.needs(cfg, base, ctx)
    off = budget.needs(cfg, base.replace(weights=Split(0, 100, 0), cache=Split(0, 100, 0),
                                         activations=Split(0, 100, 0)), ctx)
    w_dense = _by_what(on_gpu, "gpu", "weights") / L            # a layer's weights on the GPU, bytes
    w_store = _by_what(off, "cpu", "weights") / L               # stored off the GPU (packed where compressed)
    kv_all = _by_what(off, "cpu", "KV cache")                   # every (layer, batch) block at the context
    act_all = _by_what(off, "cpu", "activations")
    rest = _by_what(on_gpu, "gpu", "embedding")
    work = _by_what(on_gpu, "gpu", "working buffers")
    inflight = _by_what(off, "gpu", "3 layers")                 # 3 stored + 1 decompressed, all weights off
    kv_block = kv_all / (L * nb)

    # transfers of one pass, as the runtime makes them
    t_pre = _pad(workload.prompt_len)
    s = _pad(min(workload.prompt_len + workload.gen_len, ctx))   # positions of a block's KV arrays
    tok_head = (kv_quant.token_head_bytes("int4", hd, None) if compress_cache else 2 * hd * item)
    kv_blk = bs * s * kh * tok_head                             # one block as loaded (S positions)
    rows = {"prefill": bs * t_pre * kh * tok_head, "decode": bs * kh * tok_head}
    act = {"prefill": bs * t_pre * d * item, "decode": bs * d * item}
    qo = 2 * bs * h * hd * item                                  # q down and the attention output up (cpu attn)
    h2d, d2h = hw.h2d_bytes, hw.d2h_bytes                       # pageable: numpy arrays (staged), device -> numpy
    stage = hw.stage_rate(kv_blk)                                # a KV block's K and V pair, at its size
    link = hw.link_h2d()                                         # every host -> device byte crosses the link
    pinned_w = host_memory == "pinned" and bool(hw.h2d_pinned_bytes)
    pinned_kv = pinned_w                                         # host-held KV blocks are pinned arrays too
    rd, wr = hw.disk_read_bytes, hw.disk_write_bytes
    params = w_dense / item                                      # a layer's parameters (matmuls dominate)
    dec_unpack = (w_store + w_dense) / hw.hbm_bytes if compress_weights else 0.0

    def gemm(tokens: int) -> float:
        return max(2 * tokens * params / hw.gemm_rate(tokens), w_dense / hw.hbm_bytes)

    def attn_gpu(tq: int) -> float:
        flops = 4 * bs * tq * s * h * hd
        traffic = kv_blk + 2 * bs * s * kh * hd * 4 + 3 * bs * h * tq * s * 4     # block, f32 K/V, scores
        return max(flops / hw.gemm_flops, traffic / hw.hbm_bytes)

    io = hw.transfer_s                                           # each transfer's fixed cost (an I/O thread's)
    wait = weights_off * queue_wait_s(cfg, hw)
    lanes = {}
    for phase, tq in (("prefill", t_pre), ("decode", 1)):
        delegate = cpu_attention and phase == "decode"
        store = hw.kv_store_rate(host_memory, rows[phase])         # the rows' device -> host rate
        comp = lin(nb * (gemm(bs * tq) + hw.dispatch_s))
        unpack = lin(0, wc=dec_unpack, wd=dec_unpack)
        cpu_lane = lin(0)
        if delegate:       # CPU-held blocks: two programs around the CPU's attention (the new rows and q down, the
            #                output up; no block crosses), on the CPU thread while the device runs the next batch's
            #                first program; with one batch a block, in series with the device
            pieces = None if compress_cache else piece_count(bs, s, kh * hd * item)
            cpu = (hw.cpu_attention_s(kv_blk, pieces) + hw.cpu_attn_fixed_s + (rows[phase] + qo / 2) / d2h
                   + qo / 2 / h2d + wait)                      # the output's copy up queues behind the weights
            if nb > 1:
                att = lin(nb * attn_gpu(tq), cc=nb * (hw.dispatch_s - attn_gpu(tq)),
                          cd=nb * (hw.dispatch_s - attn_gpu(tq)))
                cpu_lane = lin(0, cc=nb * cpu, cd=nb * cpu)
            else:
                att = lin(attn_gpu(tq), cc=cpu + hw.dispatch_s - attn_gpu(tq), cd=cpu + hw.dispatch_s - attn_gpu(tq))
            kv_in, kv_stage, kv_out = lin(0), lin(0), lin(0)
        else:
            att = lin(nb * attn_gpu(tq))
            # a host-held block under pinned host memory is a pinned array: its load is a DMA on the link (no
            # staging); a numpy or disk-held block is staged
            kv_in = lin(0, cc=nb * (kv_blk / link + (io if pinned_kv else 0.0)), cd=nb * kv_blk / link)
            # one KV load in flight (the next batch's, while this one computes), and a disk-held block's is its
            # file's read and then its staging, on one I/O thread: the two in series, not two lanes
            kv_stage = lin(0, cc=0.0 if pinned_kv else nb * (kv_blk / stage + io + wait),
                           cd=nb * (kv_blk / rd + kv_blk / stage + io + wait))
            kv_out = lin(0, cc=nb * (rows[phase] / store + io), cd=nb * (rows[phase] / store + io))
        if schedule == "row_by_row":        # (schedule.py `_row_by_row`: x stays on the device, no activations move)
            w_in = lin(0, wc=(w_store / link if pinned_w else w_store / h2d) + io, wd=w_store / rd + w_store / h2d + io)
            kv_host = kv_blk / link if pinned_kv else kv_blk / stage
            kv_ser = lin(0) if delegate else lin(0, cc=kv_host + rows[phase] / store + 2 * io,
                                                  cd=kv_blk / rd + kv_blk / stage + rows[phase] / store + 2 * io)
            att_one = lin(attn_gpu(tq), cc=cpu + hw.dispatch_s - attn_gpu(tq),
                          cd=cpu + hw.dispatch_s - attn_gpu(tq)) if delegate else lin(attn_gpu(tq))
            one = add(lin(gemm(bs * tq) + hw.dispatch_s), att_one, lin(0, wc=dec_unpack, wd=dec_unpack), w_in, kv_ser)
            lanes[phase] = {"serial": {k: nb * c for k, c in one.items()}}
            continue
        act_link, act_stage = nb * act[phase] / link, nb * (act[phase] / h2d + io)
        w_link = w_store / link
        lanes[phase] = {
            "compute": add(comp, att, unpack),
            "cpu": cpu_lane,
            "h2d": add(lin(0, wc=w_link + (io if pinned_w else 0.0), wd=w_link), kv_in,
                       lin(0, hc=act_link, hd=act_link)),
            "h2d_stage": add(lin(0, wc=0.0 if pinned_w else w_store / h2d + io, wd=w_store / h2d + io), kv_stage,
                             lin(0, hc=act_stage, hd=act_stage)),
            "d2h": add(kv_out, lin(0, hc=nb * (act[phase] / d2h + io), hd=nb * (act[phase] / d2h + io))),
            "disk_read": lin(0, wd=w_store / rd, cd=nb * kv_blk / rd, hd=nb * act[phase] / rd),
            "disk_write": lin(0, cd=nb * rows[phase] / wr, hd=nb * act[phase] / wr),
        }
    head_w = v * d * item

    def fixed(tokens: int) -> float:
        """A pass outside the layers: each batch's head, the host's pass work (measured on one batch), and each
        further batch's embedding and head calls."""
        head = max(2 * bs * v * d / hw.gemm_rate(bs), head_w / hw.hbm_bytes)     # the last position's logits
        return nb * head + hw.pass_s + (nb - 1) * 2 * hw.dispatch_s

    memory = {
        "gpu": lin(rest + work, wg=L * w_dense, wc=inflight, wd=inflight, cg=kv_all, hg=act_all),
        "cpu": lin(0, wc=L * w_store, cc=kv_all, hc=act_all),
        "disk": lin(0, wd=L * w_store, cd=kv_all, hd=act_all),
    }
    return LayerCost(lanes["prefill"], lanes["decode"], fixed(t_pre), fixed(1), memory, 2 * kv_block, L, bs * nb,
                     workload.gen_len, info=dict(layer_bytes=w_dense, layer_stored_bytes=w_store, kv_block=kv_block))


def fractions(cfg: ModelConfig, policy: Policy) -> dict[str, float]:
    """The placement a policy really gets (tensors by bytes, KV blocks and batches by index), as fractions."""
    _, shapes = budget.layer_shapes(cfg)
    sizes = [math.prod(s) for s in shapes]
    wt = weight_tiers(sizes, policy.weights)
    total = float(sum(sizes))
    fr = {f"w{t[0]}": sum(n for n, x in zip(sizes, wt) if x == t) / total for t in ("gpu", "cpu", "disk")}
    n_kv = cfg.num_layers * policy.num_gpu_batches
    kt = kv_tiers(cfg.num_layers, policy.num_gpu_batches, policy.cache)
    at = index_tiers(policy.num_gpu_batches, policy.activations)
    for t in ("gpu", "cpu", "disk"):
        fr[f"c{t[0]}"] = kt.count(t) / n_kv
        fr[f"h{t[0]}"] = at.count(t) / policy.num_gpu_batches
    return fr


@dataclass(frozen=True)
class Prediction:
    out_tok_s: float
    seconds: float
    prefill_layer_s: float
    decode_layer_s: float
    lanes: dict
    tier_bytes: dict
    fractions: dict


def layer_fractions(cfg: ModelConfig, policy: Policy, base: dict[str, float]) -> list[dict[str, float]]:
    """`base` (the policy's `fractions`) layer by layer: the weights' and activations' are every layer's, the KV
    cache's are the layer's own blocks' (`kv_tiers` numbers them layer by layer, so a split puts whole layers in
    one tier)."""
    nb = policy.num_gpu_batches
    kt = kv_tiers(cfg.num_layers, nb, policy.cache)
    out = []
    for j in range(cfg.num_layers):
        mine = kt[j * nb:(j + 1) * nb]
        out.append(base | {f"c{t[0]}": mine.count(t) / nb for t in ("gpu", "cpu", "disk")})
    return out


def predict(cfg: ModelConfig, policy: Policy, workload: Workload, hw: HardwareProfile) -> Prediction:
    """The cost model's throughput and per-lane times for a policy, at the placement the runtime gives it, layer by
    layer (`LayerCost.total_time_by_layer`); the lanes and layer times reported are the layers' means."""
    fr = fractions(cfg, policy)
    frs = layer_fractions(cfg, policy, fr)
    c = cost_of(cfg, policy, workload, hw, fr)
    lanes = {ph: {k: sum(value(e, f) for f in frs) / len(frs) for k, e in
                  (c.prefill if ph == "prefill" else c.decode).items()} for ph in ("prefill", "decode")}
    per = {ph: sum(c.phase_time(ph, f) for f in frs) / len(frs) for ph in ("prefill", "decode")}
    secs = c.total_time_by_layer(frs)
    return Prediction(c.block * c.gen_len / secs, secs, per["prefill"], per["decode"], lanes, c.tier_bytes(fr), fr)


def cost_of(cfg: ModelConfig, policy: Policy, workload: Workload, hw: HardwareProfile, fr: dict) -> LayerCost:
    """The policy's `layer_cost`, its queue wait at its own off-GPU weight share (`fr`: its `fractions`)."""
    return layer_cost(cfg, policy.gpu_batch_size, policy.num_gpu_batches, workload, hw, policy.compress_weights,
                      policy.compress_cache, policy.cpu_attention, policy.host_memory, policy.schedule,
                      weights_off=fr["wc"] + fr["wd"])
