"""`--offload auto`: the policy the search picks runs and gives the all-on-device engine's greedy tokens, end to end
through `nfjax generate` on the shipped tiny model (this machine's profile measured into a fresh cache), and through
the API on an 8-layer OPT whose GPU cap forces part of its weights off the GPU; caps too small are an error naming
the tier and the shortfall, before anything loads."""
from __future__ import annotations

import json

from nfjax import cli
from nfjax.config import BatcherConfig, CacheConfig, EngineConfig
from nfjax.engine import Engine, SamplingParams
from nfjax.models.random_init import random_model
from nfjax.offload.cost_model import FRACS, Workload, layer_cost, value
from nfjax.offload.engine import OffloadEngine
from nfjax.offload.hardware import HardwareProfile
from nfjax.offload.search import GPU_HEADROOM, search
from nfjax.tokenizer.silent import SilentTokenizer
from tests.offload.common import OPT, PROMPTS, engine_tokens_of, tokenizer

ARGS = ["--token-ids", "1 2 3 4", "5 6 7 8 9 10", "11 12", "--max-tokens", "8", "--temperature", "0"]


def _tokens(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln and not ln.startswith("[")]


def _paged_engine_tokens() -> list[str]:
    """The shipped tiny model (float32) on the paged engine, all on the device (a few buckets: quick to compile)."""
    from nfjax.checkpoint.orbax_io import load_model
    from nfjax.engine.engine import TINY_MODEL
    m = load_model(TINY_MODEL, dtype="float32")
    prompts = [[int(t) for t in p.split()] for p in ARGS[1:4]]
    eng = Engine(m, SilentTokenizer(m.cfg.vocab_size), EngineConfig(
        m.cfg, CacheConfig(page_size=16, num_pages=16, max_pages_per_seq=2),
        BatcherConfig(token_buckets=(16,), max_seqs=4)), take_weights=False)
    return [" ".join(map(str, o.token_ids)) for o in eng.generate(prompts, SamplingParams.greedy(max_tokens=8))]


def test_generate_offload_auto_gives_the_engines_tokens(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NFJAX_CACHE", str(tmp_path / "cache"))
    want = _paged_engine_tokens()
    # 16 MB of GPU (float32): the weights fit with little room. Whether the KV cache and activations then stay on
    # the GPU is a close call of the measured rates (~2% apart in predicted tok/s on a 2-core CPU, flipped by load),
    # so the check is that the CLI ran the search's choice for the profile it measured and cached.
    off = str(tmp_path / "off")
    assert cli.main(["generate", "--offload", "auto", "--gpu-memory-gb", "0.016", "--offload-dir", off,
                     "--dtype", "float32", *ARGS]) == 0
    cap = capsys.readouterr()
    assert _tokens(cap.out) == want and len(want) == 3
    assert "hardware (" in cap.err and "predicted" in cap.err and "tok/s" in cap.err
    policy = json.loads(cap.err.split("offload auto policy: ")[1].split("]\n")[0])
    assert policy["gpu_memory_gb"] == 0.016 and policy["gpu_batch_size"] * policy["num_gpu_batches"] <= 3
    from nfjax.checkpoint.orbax_io import load_config
    from nfjax.engine.engine import TINY_MODEL
    from nfjax.offload.policy import Policy
    from nfjax.offload.search import auto_policy
    cfg = load_config(TINY_MODEL).replace(dtype="float32")
    again = auto_policy(cfg, Workload(6, 8, 14), Policy(gpu_memory_gb=0.016, offload_dir=off), max_block=3)
    assert again.policy.to_json() == policy                  # the cached profile, not a new measurement


def test_generate_offload_auto_caps_too_small(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NFJAX_CACHE", str(tmp_path / "cache"))
    assert cli.main(["generate", "--offload", "auto", "--gpu-memory-gb", "0.004", *ARGS]) == 2
    err = capsys.readouterr().err
    assert "the gpu tier is" in err and "GB too small" in err and "--gpu-memory-gb" in err
    assert "Traceback" not in err


HW = HardwareProfile("test", "test", gemm_flops=2e12, hbm_bytes=1e11, h2d_bytes=1e9, h2d_pinned_bytes=2e9,
                     d2h_bytes=1e9, disk_read_bytes=2e8, disk_write_bytes=1e8, cpu_attn_bytes=5e8, dispatch_s=2e-5)


def test_searched_policy_with_weights_off_the_gpu_gives_the_engines_tokens(tmp_path):
    cfg = OPT.replace(num_layers=8)
    m = random_model(cfg, seed=3, std=0.25, host=True)
    want = engine_tokens_of(m)
    wl = Workload(24, 16, 64)
    cost = layer_cost(cfg, 2, 2, wl, HW)
    floor = value(cost.memory["gpu"], {f: float(f in ("wd", "cd", "hd")) for f in FRACS}) + cost.kv_buffer
    full = value(cost.memory["gpu"], {f: float(f in ("wg", "cg", "hg")) for f in FRACS})
    res = search(cfg, wl, HW, {"gpu": (floor + 0.3 * (full - floor)) / GPU_HEADROOM, "cpu": None, "disk": None},
                 pairs=[(1, 2), (2, 2), (2, 3)])
    pol = res.policy.replace(offload_dir=str(tmp_path))
    assert pol.weights.gpu < 100
    with OffloadEngine.from_model(m, tokenizer("opt"), pol, max_model_len=64) as eng:
        outs = eng.generate(PROMPTS, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
    assert tuple(tuple(o.token_ids) for o in outs) == want
