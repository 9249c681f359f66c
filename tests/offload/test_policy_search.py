"""The LP policy search (nfjax/offload/search.py) over the cost model (cost_model.py): its solutions satisfy every
constraint, equal a brute-force enumeration of the same cost model over a grid of placements, never predict slower
with more memory, and a search with no feasible policy names the tier that is too small and by how much.

The hardware profile here is a fixed input (slow links, so that placement matters: the worst feasible placement of
the grid is >= 5x slower than the best), not a claim about any machine; tests/offload/test_hardware.py measures."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from nfjax.offload import Policy, PolicyError, Split, budget
from nfjax.offload.cost_model import FRACS, KINDS, Workload, fractions, layer_cost, predict, value
from nfjax.offload.hardware import HardwareProfile
from nfjax.offload.search import GPU_HEADROOM, search, solve_lp
from tests.offload.common import OPT

HW = HardwareProfile("test", "test", gemm_flops=2e12, hbm_bytes=1e11, h2d_bytes=1e8, h2d_pinned_bytes=2e8,
                     d2h_bytes=1e8, disk_read_bytes=2e7, disk_write_bytes=1e7, cpu_attn_bytes=5e7, dispatch_s=2e-5)
CFG = OPT.replace(num_layers=4)
WL = Workload(32, 8)
PAIRS = [(1, 1), (2, 2), (4, 2)]


def _at(**ones) -> dict:
    return {f: 1.0 if f in ones else 0.0 for f in FRACS}


def _caps(cost, gpu_share: float, cpu_share: float) -> dict:
    """GPU: its fixed share, the loading buffers and `gpu_share` of the rest (the plan's share of the cap: the
    search keeps `GPU_HEADROOM`); CPU: `cpu_share` of everything."""
    floor = value(cost.memory["gpu"], _at(wd=1, cd=1, hd=1))
    full = value(cost.memory["gpu"], _at(wg=1, cg=1, hg=1))
    off = value(cost.memory["cpu"], _at(wc=1, cc=1, hc=1))
    return {"gpu": (floor + cost.kv_buffer + gpu_share * (full - floor)) / GPU_HEADROOM, "cpu": cpu_share * off,
            "disk": None}


def _grid(step_w: float = 0.05, step_h: float = 0.25) -> dict:
    """Every placement whose weight and cache fractions are multiples of `step_w`, activations of `step_h`."""
    def simplex(step):
        n = round(1 / step)
        return np.array([(i * step, j * step, (n - i - j) * step) for i in range(n + 1) for j in range(n + 1 - i)])
    parts = [simplex(step_w), simplex(step_w), simplex(step_h)]
    idx = np.array(list(itertools.product(*(range(len(p)) for p in parts))))
    fr = {}
    for col, (kind, names) in enumerate(KINDS.items()):
        a = parts[col][idx[:, col]]
        for i, f in enumerate(names):
            fr[f] = a[:, i]
    return fr


def _brute(cost, caps, fr) -> tuple[float, float]:
    """(best, worst) block time over the feasible grid points."""
    def lane(e):                          # a lane with no placement term is a constant: broadcast it
        return np.broadcast_to(value(e, fr), fr["wg"].shape)
    pre = np.max([lane(e) for e in cost.prefill.values()], axis=0)
    dec = np.max([lane(e) for e in cost.decode.values()], axis=0)
    t = cost.layers * pre + cost.fixed_prefill + (cost.gen_len - 1) * (cost.layers * dec + cost.fixed_decode)
    ok = np.ones(t.shape, bool)
    for tier, e in cost.memory.items():
        if caps.get(tier) is not None:
            ok &= value(e, fr) + (cost.kv_buffer * (fr["cg"] < 1 - 1e-9) if tier == "gpu" else 0) <= caps[tier]
    return float(t[ok].min()), float(t[ok].max())


@pytest.mark.parametrize("cpu_attention", [False, True])
def test_lp_solutions_satisfy_the_constraints_and_equal_brute_force(cpu_attention):
    grid = _grid()
    best_lp, best_grid = None, None
    for bs, nb in PAIRS:
        cost = layer_cost(CFG, bs, nb, WL, HW, cpu_attention=cpu_attention)
        caps = _caps(cost, 0.4, 0.5)
        caps["gpu"] *= GPU_HEADROOM                 # the LP itself: no headroom
        fr, secs = solve_lp(cost, caps)
        for names in KINDS.values():
            assert all(fr[f] >= -1e-9 for f in names) and sum(fr[f] for f in names) == pytest.approx(1, abs=1e-6)
        used = cost.tier_bytes(fr)
        assert used["gpu"] <= caps["gpu"] * (1 + 1e-6) and used["cpu"] <= caps["cpu"] * (1 + 1e-6)
        assert secs == pytest.approx(cost.total_time(fr), rel=1e-9)
        lo, hi = _brute(cost, caps, grid)
        assert hi > 5 * lo                        # placement matters under these caps
        assert secs <= lo * (1 + 1e-6)            # no grid point beats the LP
        assert lo <= secs * (1 + 1e-6), (bs, nb, secs, lo)    # and the grid reaches it (the optimum is on it)
        tok = bs * nb * WL.gen_len
        best_lp = max(best_lp or 0, tok / secs)
        best_grid = max(best_grid or 0, tok / lo)
    # the search over the pairs: the best pair's LP optimum is the best of the whole enumeration
    assert best_lp == pytest.approx(best_grid, rel=1e-6)


def test_more_memory_never_predicts_slower():
    base = layer_cost(CFG, 2, 2, WL, HW)
    last = 0.0
    for share in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
        caps = _caps(base, share, 0.3 + 0.5 * share)
        res = search(CFG, WL, HW, caps, pairs=PAIRS, cpu_attention=(False, True))
        best = res.solutions[0].out_tok_s
        assert best >= last * (1 - 1e-9), (share, best, last)
        last = best
        # the chosen policy fits the caps as the runtime's budget counts them, and its prediction is its own
        budget.check(CFG, res.policy, WL.context, caps)
        assert predict(CFG, res.policy, WL, HW).out_tok_s == pytest.approx(res.predicted_tok_s, rel=1e-9)
    assert last > 0


def test_the_rounded_policy_is_what_the_runtime_places():
    caps = _caps(layer_cost(CFG, 2, 2, WL, HW), 0.4, 0.5)
    res = search(CFG, WL, HW, caps, pairs=PAIRS, cpu_attention=(False,))
    fr = fractions(CFG, res.policy)
    for kind, names in KINDS.items():
        split = getattr(res.policy, kind)
        assert [fr[f] for f in names] == pytest.approx([split.gpu / 100, split.cpu / 100, split.disk / 100],
                                                       abs=1e-9), kind
    assert res.predicted_tok_s <= res.lp.out_tok_s * (1 + 1e-9)   # rounding never beats the relaxation


def test_no_feasible_policy_names_the_tier_and_the_shortfall():
    cost = layer_cost(CFG, 1, 1, WL, HW)
    floor = value(cost.memory["gpu"], _at(wd=1, cd=1, hd=1)) + cost.kv_buffer
    with pytest.raises(PolicyError, match=r"the gpu tier is .* GB too small .*--gpu-memory-gb") as e:
        search(CFG, WL, HW, {"gpu": 0.5 * floor, "cpu": None, "disk": None}, pairs=PAIRS)
    short = float(str(e.value).split("the gpu tier is ")[1].split(" GB")[0])
    assert short == pytest.approx((floor / GPU_HEADROOM - 0.5 * floor) / 1e9, rel=1e-3)
    # 8 layers: the GPU at its floor can take no weights (8 layers cost more than the 4 in flight); everything must
    # fit in host memory + disk, and the disk is 10% of the data short
    cfg8 = CFG.replace(num_layers=8)
    cost = layer_cost(cfg8, 1, 1, WL, HW)
    floor = value(cost.memory["gpu"], _at(wd=1, cd=1, hd=1)) + cost.kv_buffer
    data = value(cost.memory["cpu"], _at(wc=1, cc=1, hc=1))
    caps = {"gpu": floor / GPU_HEADROOM, "cpu": 0.5 * data, "disk": 0.4 * data}
    with pytest.raises(PolicyError, match=r"the disk tier is .* GB too small .*--disk-gb to at least") as e:
        search(cfg8, WL, HW, caps, pairs=[(1, 1)])
    assert "gpu tier" not in str(e.value) and "cpu tier" not in str(e.value)
    short = float(str(e.value).split("the disk tier is ")[1].split(" GB")[0])
    assert short == pytest.approx(0.1 * data / 1e9, rel=0.02)


def test_search_policy_is_a_valid_policy_json():
    caps = _caps(layer_cost(CFG, 2, 2, WL, HW), 0.4, 0.5)
    res = search(CFG, WL, HW, caps, pairs=PAIRS, base=Policy(gpu_memory_gb=7.0))
    assert Policy.from_json(res.policy.to_json()) == res.policy and res.policy.gpu_memory_gb == 7.0
    assert (res.policy.gpu_batch_size, res.policy.num_gpu_batches) in PAIRS


def test_row_by_row_is_a_serial_sum():
    """The baseline's schedule (every batch in turn loads the layer's weights and KV block, computes, stores):
    one lane, the sum of what the zig-zag overlaps, so never faster than it, and twice the batches take twice
    the layer time (the weights are loaded once a batch)."""
    zig = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0, 100, 0), cache=Split(0, 100, 0))
    rbr = zig.replace(schedule="row_by_row")
    pz, pr = predict(CFG, zig, WL, HW), predict(CFG, rbr, WL, HW)
    for ph in ("prefill", "decode"):
        assert set(pr.lanes[ph]) == {"serial"}
        assert pr.lanes[ph]["serial"] > max(pz.lanes[ph].values())
    assert pr.out_tok_s < pz.out_tok_s
    p4 = predict(CFG, rbr.replace(num_gpu_batches=4), WL, HW)
    assert p4.decode_layer_s == pytest.approx(2 * pr.decode_layer_s)


def test_a_disk_held_kv_block_is_read_then_staged_in_one_lane():
    """KV blocks load one at a time, and a disk-held one is its file's read and then its staging (one I/O task):
    the staging lane of a block on disk holds both, so disk never looks like a free parallel lane."""
    on_cpu = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(100, 0, 0), cache=Split(0, 100, 0),
                    host_memory="numpy")                    # a host-held block staged too (pinned: a DMA)
    on_disk = on_cpu.replace(cache=Split(0, 0, 100))
    s = -(-(WL.prompt_len + WL.gen_len) // 16) * 16                # the block's positions, padded as loaded
    blk = 2 * s * CFG.num_kv_heads * 2 * CFG.head_dim * (2 if CFG.dtype == "bfloat16" else 4)
    for ph in ("prefill", "decode"):
        cpu, disk = predict(CFG, on_cpu, WL, HW).lanes[ph], predict(CFG, on_disk, WL, HW).lanes[ph]
        assert disk["h2d_stage"] - cpu["h2d_stage"] == pytest.approx(2 * blk / HW.disk_read_bytes, rel=0.05)
        assert disk["h2d_stage"] > disk["disk_read"]


def test_a_pinned_host_kv_block_loads_on_the_link_not_through_staging():
    """Under host memory "pinned" a host-held KV block is a pinned array (KVStore): its load is a DMA, priced on
    the link with a transfer's fixed cost and nothing in the staging lane; under "numpy" it is staged."""
    hw = HW.__class__(**{**HW.to_json(), "transfer_s": 1e-4})
    pinned = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(100, 0, 0), cache=Split(0, 100, 0))
    numpy_ = pinned.replace(host_memory="numpy")
    s = -(-(WL.prompt_len + WL.gen_len) // 16) * 16
    blk = 2 * s * CFG.num_kv_heads * 2 * CFG.head_dim * (2 if CFG.dtype == "bfloat16" else 4)
    for ph in ("prefill", "decode"):
        p, n = predict(CFG, pinned, WL, hw).lanes[ph], predict(CFG, numpy_, WL, hw).lanes[ph]
        assert p["h2d_stage"] == 0.0 and n["h2d_stage"] == pytest.approx(2 * (blk / hw.h2d_bytes + 1e-4))
        assert p["h2d"] - n["h2d"] == pytest.approx(2 * 1e-4)
        assert p["h2d"] == pytest.approx(2 * (blk / hw.link_h2d() + 1e-4))
