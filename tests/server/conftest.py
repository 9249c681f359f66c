"""Server test helpers: the model to serve (the shipped tiny model), metrics scraping, bounded polling."""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from nfjax.engine.engine import TINY_MODEL


@pytest.fixture(scope="session")
def model_dir() -> Path | None:
    """The model every server test serves: the shipped tiny model (None = Engine.from_pretrained's default)."""
    assert (TINY_MODEL / "nfjax_config.json").exists(), f"the shipped tiny model is missing from {TINY_MODEL}"
    return None


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
    seen = {}

    def idle():
        seen.update(scrape(url))
        ok = (seen["nfjax_running_requests"] == 0 and seen["nfjax_kv_pages_used"] == 0
              and seen["nfjax_queue_depth"] == 0)
        return dict(seen) if ok else None
    try:
        return wait_until(idle, timeout, what="0 running requests, 0 queued, 0 KV pages used")
    except AssertionError as e:
        keys = ("nfjax_running_requests", "nfjax_queue_depth", "nfjax_kv_pages_used")
        raise AssertionError(f"{e}; last: {({k: seen.get(k) for k in keys})}") from None


def raw_sse(url: str, path: str, body: dict, timeout: float = 30.0) -> tuple[list[dict], list[str]]:
    """POST and parse the SSE stream by hand, curl-style: returns (json chunks, raw data lines)."""
    chunks, lines = [], []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            lines.append(data)
            if data != "[DONE]":
                chunks.append(json.loads(data))
    return chunks, lines
