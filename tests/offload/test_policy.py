"""The policy: JSON round trip, and every policy that cannot hold is an error naming the field, raised before
anything is loaded or written (percentages, sizes, a tier over its cap, options out of range)."""
from __future__ import annotations

import json

import pytest

from nfjax import cli
from nfjax.offload import Policy, PolicyError, Split
from nfjax.offload import budget
from nfjax.offload.engine import OffloadEngine
from tests.offload.common import MAX_LEN, model, tokenizer

FULL = dict(gpu_batch_size=8, num_gpu_batches=4, weights={"gpu": 20, "cpu": 50, "disk": 30},
            cache={"gpu": 0, "cpu": 100, "disk": 0}, activations={"gpu": 100, "cpu": 0, "disk": 0},
            compress_weights=True, host_memory="numpy", schedule="zigzag", gpu_memory_gb=16, cpu_memory_gb=100,
            disk_gb=60, offload_dir="/tmp/x", io_threads=2)


def test_json_round_trip(tmp_path):
    p = Policy.from_json(FULL)
    assert p.weights == Split(20, 50, 30) and p.block_size == 32 and p.uses_disk()
    p.save(tmp_path / "p.json")
    assert Policy.load(tmp_path / "p.json") == p
    assert json.loads((tmp_path / "p.json").read_text())["weights"] == {"gpu": 20, "cpu": 50, "disk": 30}
    assert Policy.from_json({}) == Policy()


@pytest.mark.parametrize("change,field", [
    (dict(weights={"gpu": 50, "cpu": 40, "disk": 0}), "weights"),
    (dict(cache={"gpu": 120, "cpu": -20}), "cache.gpu"),
    (dict(activations={"gpu": 50, "cpu": 50, "ssd": 0}), "activations.ssd"),
    (dict(gpu_batch_size=0), "gpu_batch_size"),
    (dict(num_gpu_batches=1.5), "num_gpu_batches"),
    (dict(cpu_attention="yes"), "cpu_attention"),
    (dict(attention_topk=0), "attention_topk"),
    (dict(attention_topk=120), "attention_topk"),
    (dict(host_memory="cuda"), "host_memory"),
    (dict(schedule="fast"), "schedule"),
    (dict(gpu_memory_gb=0), "gpu_memory_gb"),
    (dict(color="red"), "color"),
])
def test_bad_policies_name_the_field(change, field):
    with pytest.raises(PolicyError, match=field.replace(".", r"\.")):
        Policy.from_json({**FULL, **change})


@pytest.mark.parametrize("change,field", [
    (dict(gpu_memory_gb=1e-4), "gpu_memory_gb"),
    (dict(weights=Split(0, 100, 0), cpu_memory_gb=1e-4), "cpu_memory_gb"),
    (dict(weights=Split(0, 0, 100), disk_gb=1e-4), "disk_gb"),
])
def test_a_tier_over_its_cap_is_an_error_before_anything_loads(tmp_path, change, field):
    pol = Policy(gpu_batch_size=2, num_gpu_batches=2, offload_dir=str(tmp_path / "off"), **change)
    calls = []
    with pytest.raises(PolicyError, match=field):
        OffloadEngine(model("opt").cfg, None, None, lambda j: calls.append(j), tokenizer("opt"), pol,
                      max_model_len=MAX_LEN)
    assert calls == [] and not (tmp_path / "off").exists()


def test_compress_cache_needs_head_dim_in_groups_of_64(tmp_path):
    pol = Policy(compress_cache=True, offload_dir=str(tmp_path / "off"))
    with pytest.raises(PolicyError, match="compress_cache.*head_dim is 16"):
        OffloadEngine.from_model(model("llama"), tokenizer("llama"), pol, max_model_len=MAX_LEN)


def test_a_moe_model_is_refused_before_anything_loads(tmp_path):
    from nfjax.models.random_init import MIXTRAL_SMOKE
    from nfjax.offload.cost_model import Workload
    from nfjax.offload.search import auto_policy
    with pytest.raises(PolicyError, match="mixture-of-experts.*num_experts=4"):
        budget.check(MIXTRAL_SMOKE, Policy(offload_dir=str(tmp_path / "off")), 64, {})
    with pytest.raises(PolicyError, match="mixture-of-experts"):
        auto_policy(MIXTRAL_SMOKE, Workload(prompt_len=8, gen_len=4), Policy())
    assert not (tmp_path / "off").exists()


def test_the_budget_counts_what_each_tier_holds():
    cfg = model("llama").cfg
    pol = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0, 50, 50), cache=Split(0, 0, 100))
    by = budget.check(cfg, pol, MAX_LEN, {"gpu": None, "cpu": None, "disk": None})
    layer = 4 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64)
    kv_block = 2 * 2 * MAX_LEN * 2 * 16 * 4                             # K and V of 2 sequences, 2 kv heads
    assert by["cpu"] + by["disk"] == 3 * layer + 3 * 2 * kv_block       # L x nb blocks on disk
    with_compression = budget.check(cfg, pol.replace(compress_weights=True), MAX_LEN,
                                    {"gpu": None, "cpu": None, "disk": None})
    assert with_compression["cpu"] < by["cpu"] / 4
    head64 = cfg.replace(num_heads=1, num_kv_heads=1, head_dim=64)
    plain = budget.check(head64, pol, MAX_LEN, {"gpu": None, "cpu": None, "disk": None})
    packed = budget.check(head64, pol.replace(compress_cache=True), MAX_LEN, {"gpu": None, "cpu": None, "disk": None})
    kv_plain = 3 * 2 * 2 * MAX_LEN * 2 * 64 * 4                           # L x nb blocks, float32 K and V
    # int4: 32 bytes of codes for K and for V, and one row of 8 bfloat16 scales and centers for both
    assert plain["disk"] - packed["disk"] == kv_plain - kv_plain * (2 * 32 + 16) // (2 * 64 * 4)


def test_generate_offload_flag_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"weights": {"gpu": 10, "cpu": 10, "disk": 10}}))
    assert cli.main(["generate", "--offload", str(bad), "--token-ids", "1 2 3"]) == 2
    err = capsys.readouterr().err
    assert "weights" in err and "100" in err and "Traceback" not in err
    assert cli.main(["generate", "--offload", str(tmp_path / "none.json"), "hi"]) == 2
    assert "no such policy file" in capsys.readouterr().err


@pytest.mark.parametrize("layers,batches,split", [(48, 8, Split(35.15625, 52.86, 11.98)), (48, 2, Split(25, 75, 0)),
                                                  (2, 3, Split(30, 30, 40)), (5, 1, Split(50, 50, 0)),
                                                  (7, 4, Split(0, 100, 0))])
def test_kv_blocks_give_every_layer_the_same_mix(layers, batches, split):
    """The KV blocks' tiers: the counts `index_tiers` gives (what the cost model and the budget count), dealt so that
    each layer's count in each tier differs from any other layer's by at most one."""
    from nfjax.offload.store import index_tiers, kv_tiers
    got = kv_tiers(layers, batches, split)
    flat = index_tiers(layers * batches, split)
    assert sorted(got) == sorted(flat)
    for t in ("gpu", "cpu", "disk"):
        per_layer = [got[j * batches:(j + 1) * batches].count(t) for j in range(layers)]
        assert max(per_layer) - min(per_layer) <= 1, (t, per_layer)

