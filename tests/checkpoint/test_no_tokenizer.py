"""A converted checkpoint without tokenizer files: token-id prompts work (Engine, `nfjax generate --token-ids`,
the server with `prompt` as token ids); text prompts are a clear error (UserError, exit 2, HTTP 400 naming the
field)."""
from __future__ import annotations

import openai
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from nfjax import cli  # noqa: E402
from nfjax.checkpoint import convert as conv  # noqa: E402
from nfjax.config import ServerConfig  # noqa: E402
from nfjax.engine import Engine, SamplingParams  # noqa: E402
from nfjax.errors import UserError  # noqa: E402
from nfjax.server import ServerThread  # noqa: E402

SMALL = dict(token_buckets=(32,), max_seqs=4, num_pages=32)


@pytest.fixture
def no_tok(tiny_hf, tmp_path):
    out = tmp_path / "converted"
    conv.convert(tiny_hf, out, progress=False)
    for name in conv.AUX_FILES:                       # whatever the HF folder had: no tokenizer files remain
        (out / name).unlink(missing_ok=True)
    assert not (out / "tokenizer.json").exists() and not (out / "nfjax_tokenizer.json").exists()
    return out


def test_token_ids_work_and_text_is_a_clear_error(no_tok):
    engine = Engine.from_pretrained(no_tok, dtype="float32", **SMALL)
    greedy = SamplingParams.greedy(max_tokens=4, ignore_eos=True)
    out = engine.generate([5, 6, 7], greedy)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    with pytest.raises(UserError, match=r"no tokenizer \(no tokenizer.json in .*converted\): pass prompts as token"):
        engine.generate("hello", greedy)

    with ServerThread(engine, ServerConfig(port=0, log_level="warning"), "converted") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", timeout=30, max_retries=0)
        r = client.completions.create(model="converted", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 4
        assert r.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="converted", prompt="hello", max_tokens=4)
        assert e.value.body["param"] == "prompt" and "no tokenizer.json" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="converted", messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["param"] == "messages" and "no tokenizer.json" in e.value.body["message"]



def test_cli_generate_token_ids_without_tokenizer(no_tok, capsys):
    common = ["generate", "--model", str(no_tok), "--dtype", "float32", "--token-buckets", "32", "--max-seqs", "4",
              "--num-pages", "32", "--max-tokens", "3", "--temperature", "0", "--ignore-eos"]
    capsys.readouterr()
    assert cli.main([*common, "--token-ids", "5,6,7", "1 2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(len(ln.split()) == 3 for ln in lines), lines
    assert cli.main([*common, "hello", "world"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("nfjax generate: error: this model has no tokenizer"), err
    assert cli.main([*common, "--token-ids", "5,x"]) == 2
    assert "--token-ids: prompt '5,x' is not a list of integers" in capsys.readouterr().err
