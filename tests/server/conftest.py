"""Server test helpers: the model to serve, metrics scraping, bounded polling."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from nfjax.engine.engine import TINY_MODEL


def make_random_checkpoint(out: Path) -> Path:
    """A random tiny byte-level Llama saved as an nfjax checkpoint (used only while the shipped model is absent).
    Weights are scaled up so greedy argmax margins are wide (batch-shape rounding cannot flip a token)."""
    import jax
    from flax import nnx

    from nfjax.checkpoint.orbax_io import save_model
    from nfjax.config import ModelConfig
    from nfjax.models.llama import LlamaModel
    from nfjax.tokenizer.loader import save_byte_tokenizer
    cfg = ModelConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_ids=(257,),
                      bos_token_id=256)
    model = LlamaModel(cfg, nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree_util.tree_map_with_path(
        lambda p, x: x * 10.0 if getattr(p[-2], "key", None) in ("kernel", "embedding") else x, state))
    save_model(model, out)
    save_byte_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path | None:
    """None = the shipped tiny model (Engine.from_pretrained's default); a temp folder when it is not there."""
    if (TINY_MODEL / "nfjax_config.json").exists():
        return None
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-random")


def scrape(url: str) -> dict[str, float]:
    """Prometheus samples by name (labels folded into the name as name{k=v})."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def wait_until(pred, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """Wait until the server holds no request and no KV page; returns the final metrics."""
    def idle():
        m = scrape(url)
        ok = (m["nfjax_running_requests"] == 0 and m["nfjax_kv_pages_used"] == 0
              and m["nfjax_queue_depth"] == 0)
        return m if ok else None
    return wait_until(idle, timeout, what="0 running requests, 0 queued, 0 KV pages used")
