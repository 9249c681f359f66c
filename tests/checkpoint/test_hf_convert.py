"""`nfjax convert`: HF safetensors -> nfjax checkpoint; bad inputs give one clear error and leave no output."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import ml_dtypes  # noqa: E402,F401  (numpy bfloat16, needed by safetensors' numpy reader)
from safetensors.numpy import load_file, save_file  # noqa: E402

from nfjax import cli  # noqa: E402
from nfjax.checkpoint import convert as conv  # noqa: E402
from nfjax.checkpoint.orbax_io import load_model  # noqa: E402
from nfjax.errors import UserError  # noqa: E402

Q0 = "model.layers.0.self_attn.q_proj.weight"


def _edit_weights(hf_dir, fn, file="model.safetensors"):
    f = hf_dir / file
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _listing(path):
    return sorted(os.listdir(path))


def _fails(hf_dir, out, match, **kw):
    """Conversion fails with a UserError matching `match` and leaves the output's folder as it was."""
    before = _listing(out.parent) if out.parent.exists() else None
    with pytest.raises(UserError, match=match) as ei:
        conv.convert(hf_dir, out, progress=False, **kw)
    after = _listing(out.parent) if out.parent.exists() else None
    assert after == before, "conversion left files behind"
    return str(ei.value)


@pytest.fixture
def one_cli(monkeypatch):
    """Run `nfjax ...` in-process with only the convert subcommand registered."""
    assert cli.SUBCOMMANDS["convert"] == "nfjax.checkpoint.convert"
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"convert": "nfjax.checkpoint.convert"})
    return lambda *argv: cli.main([str(a) for a in argv])


# ---- success paths ----------------------------------------------------------------------------------------------
def test_convert_writes_params_config_and_tokenizer(tiny_hf, tmp_path, one_cli, capsys):
    (tiny_hf / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    (tiny_hf / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    (tiny_hf / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    gen = json.loads((tiny_hf / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 7]
    (tiny_hf / "generation_config.json").write_text(json.dumps(gen))
    out = tmp_path / "deep" / "out"            # parent folders are created

    assert one_cli("convert", "--hf", tiny_hf, "--out", out) == 0
    assert "wrote" in capsys.readouterr().out
    assert _listing(out.parent) == ["out"]     # the temp folder was renamed, nothing else left
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tiny_hf / name).read_bytes()
    assert (out / "hf_config.json").read_bytes() == (tiny_hf / "config.json").read_bytes()
    assert not any(p.name.startswith(".") for p in out.iterdir())
    assert os.stat(out).st_mode & 0o055, "output folder must not be private (mkdtemp's 0700)"

    model = load_model(out)
    assert model.cfg.eos_token_ids == (2, 7) and model.cfg.dtype == "float32"
    hf = load_file(tiny_hf / "model.safetensors")
    L = model.layers
    np.testing.assert_array_equal(L.q_proj.kernel[...][0], hf[Q0].T)
    np.testing.assert_array_equal(L.k_proj.kernel[...][1], hf["model.layers.1.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(L.o_proj.kernel[...][1], hf["model.layers.1.self_attn.o_proj.weight"].T)
    np.testing.assert_array_equal(L.down_proj.kernel[...][0], hf["model.layers.0.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(L.post_norm.scale[...][1], hf["model.layers.1.post_attention_layernorm.weight"])
    np.testing.assert_array_equal(model.embed.embedding[...], hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(model.norm.scale[...], hf["model.norm.weight"])
    np.testing.assert_array_equal(model.lm_head.kernel[...], hf["lm_head.weight"].T)


def test_load_restores_into_given_shardings(tiny_hf, tmp_path):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    conv.convert(tiny_hf, tmp_path / "out", progress=False)
    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1])
    asked = {}

    def sharding_fn(path, x):       # column-parallel q_proj, everything else replicated
        asked[path] = x.shape
        spec = P(None, None, "tp") if path == ("layers", "q_proj", "kernel") else P()
        return NamedSharding(mesh, spec)

    model = load_model(tmp_path / "out", sharding_fn=sharding_fn)
    assert asked[("layers", "q_proj", "kernel")] == (2, 32, 32) and ("lm_head", "kernel") in asked
    assert model.layers.q_proj.kernel[...].sharding == NamedSharding(mesh, P(None, None, "tp"))
    assert model.norm.scale[...].sharding == NamedSharding(mesh, P())


def test_bfloat16_checkpoint_keeps_dtype_unless_asked(save_hf, tmp_path):
    hf_model = save_hf(tmp_path / "hf", dtype="bfloat16")
    ref = hf_model.model.layers[1].mlp.up_proj.weight.float().detach().numpy().T
    conv.convert(tmp_path / "hf", tmp_path / "bf16", progress=False)
    m = load_model(tmp_path / "bf16")
    assert m.cfg.dtype == "bfloat16" and m.layers.up_proj.kernel[...].dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(np.asarray(m.layers.up_proj.kernel[...][1], np.float32), ref)

    conv.convert(tmp_path / "hf", tmp_path / "f32", dtype="float32", progress=False)
    m = load_model(tmp_path / "f32")
    assert m.cfg.dtype == "float32" and m.layers.up_proj.kernel[...].dtype == np.float32
    np.testing.assert_array_equal(m.layers.up_proj.kernel[...][1], ref)


def test_tied_embeddings_with_and_without_lm_head(save_hf, tmp_path):
    hf_dir = tmp_path / "hf"
    save_hf(hf_dir, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(hf_dir / "model.safetensors")
    conv.convert(hf_dir, tmp_path / "a", progress=False)
    assert load_model(tmp_path / "a").lm_head is None

    # Some tied checkpoints also ship lm_head.weight: fine when it equals the embedding, an error otherwise.
    _edit_weights(hf_dir, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    conv.convert(hf_dir, tmp_path / "b", progress=False)
    _edit_weights(hf_dir, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    msg = _fails(hf_dir, tmp_path / "c", "lm_head.weight differs")
    assert "tie_word_embeddings" in msg


def test_sharded_checkpoint_and_missing_shard(save_hf, tmp_path):
    hf_dir = tmp_path / "hf"
    save_hf(hf_dir, max_shard_size="20KB")
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    conv.convert(hf_dir, tmp_path / "ok", progress=False)
    np.testing.assert_array_equal(load_model(tmp_path / "ok").layers.q_proj.kernel[...][0],
                                  load_file(hf_dir / index["weight_map"][Q0])[Q0].T)

    (hf_dir / shards[1]).unlink()
    _fails(hf_dir, tmp_path / "bad", f"shard {shards[1]} is missing")


def test_ignores_rotary_buffers(tiny_hf, tmp_path):
    _edit_weights(tiny_hf, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq":
                                                   np.ones(4, np.float32)}))
    conv.convert(tiny_hf, tmp_path / "out", progress=False)


def test_empty_output_dir_is_fine_and_force_replaces(tiny_hf, tmp_path, one_cli):
    out = tmp_path / "out"
    out.mkdir()
    assert one_cli("convert", "--hf", tiny_hf, "--out", out, "--no-progress") == 0
    (out / "stale.txt").write_text("old")
    assert one_cli("convert", "--hf", tiny_hf, "--out", out, "--force", "--no-progress") == 0
    assert not (out / "stale.txt").exists() and (out / "nfjax_config.json").exists()
    assert _listing(tmp_path) == ["hf", "out"]


# ---- bad inputs: one clear error naming the culprit, nothing written ------------------------------------------
def test_truncated_safetensors(tiny_hf, tmp_path):
    f = tiny_hf / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    msg = _fails(tiny_hf, tmp_path / "out", "model.safetensors")
    assert "truncated" in msg


def test_missing_tensor(tiny_hf, tmp_path):
    _edit_weights(tiny_hf, lambda t: t.pop("model.layers.1.mlp.gate_proj.weight"))
    _fails(tiny_hf, tmp_path / "out", r"missing tensor model\.layers\.1\.mlp\.gate_proj\.weight")


def test_wrong_shape(tiny_hf, tmp_path):
    _edit_weights(tiny_hf, lambda t: t.update({Q0: t[Q0][:, :-1].copy()}))
    msg = _fails(tiny_hf, tmp_path / "out", f"tensor {Q0} .* has shape")
    assert "[32, 31]" in msg and "expected [32, 32]" in msg


@pytest.mark.parametrize("name, match", [
    ("model.layers.0.mlp.extra.weight", "unexpected tensor model.layers.0.mlp.extra.weight"),
    ("model.layers.0.self_attn.q_proj.bias", "attention_bias=false"),
    ("model.layers.2.input_layernorm.weight", "num_hidden_layers=2"),
])
def test_unexpected_tensor(tiny_hf, tmp_path, name, match):
    _edit_weights(tiny_hf, lambda t: t.update({name: np.ones(32, np.float32)}))
    _fails(tiny_hf, tmp_path / "out", match)


def test_non_float_tensor(tiny_hf, tmp_path):
    _edit_weights(tiny_hf, lambda t: t.update({Q0: t[Q0].astype(np.int8)}))
    _fails(tiny_hf, tmp_path / "out", f"tensor {Q0} .* dtype I8")


def test_unknown_model_type(tiny_hf, tmp_path):
    cfg = json.loads((tiny_hf / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tiny_hf / "config.json").write_text(json.dumps(cfg))
    _fails(tiny_hf, tmp_path / "out", "unsupported model_type 'gpt2'")


def test_no_safetensors(tiny_hf, tmp_path):
    (tiny_hf / "model.safetensors").rename(tiny_hf / "pytorch_model.bin")
    _fails(tiny_hf, tmp_path / "out", "no \\*.safetensors weights found .*bin")


def test_existing_output_is_kept(tiny_hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    _fails(tiny_hf, out, "not empty; pass --force")
    assert _listing(out) == ["precious.txt"]
    _fails(tiny_hf, tiny_hf, "would replace the input", force=True)
    _fails(tiny_hf, tmp_path, "would replace the input", force=True)   # --out is a parent of --hf


@pytest.mark.parametrize("existing", [False, True])
def test_failure_while_writing_leaves_nothing(tiny_hf, tmp_path, monkeypatch, existing):
    out = tmp_path / "new" / "deeper" / "out"
    if existing:
        out.mkdir(parents=True)
        (out / "old.txt").write_text("old")

    def boom(*a, **k):
        raise OSError("disk full")                # after params/ has been written to the temp folder

    monkeypatch.setattr(conv, "_write_metadata", boom)
    with pytest.raises(UserError, match="disk full"):
        conv.convert(tiny_hf, out, force=True, progress=False)
    if existing:
        assert _listing(out) == ["old.txt"] and _listing(out.parent) == ["out"]
    else:
        assert _listing(tmp_path) == ["hf"]      # the temp folder and the parents it created are gone


def test_cli_prints_one_line_error(tiny_hf, tmp_path, one_cli, capsys):
    _edit_weights(tiny_hf, lambda t: t.pop(Q0))
    assert one_cli("convert", "--hf", tiny_hf, "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.startswith("nfjax convert: error: missing tensor " + Q0), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()
