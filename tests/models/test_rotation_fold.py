"""V's rotation folded into o_proj (nfjax/models/rotation_fold.py): the folded weight undoes the rotation of the
rows it takes, shard by shard, and an int4 engine with the fold computes what one rotating every step computes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from nfjax.config import BatcherConfig, CacheConfig, EngineConfig, ExecutionConfig, ModelConfig, ParallelConfig
from nfjax.engine import Engine, SamplingParams
from nfjax.models import reference
from nfjax.models.random_init import random_model
from nfjax.models.rotation_fold import fold_v_rotation, folds
from nfjax.parallel import make_mesh
from nfjax.tokenizer.byte import ByteTokenizer
from pallas_kernels.kv_quant import rotate
from tests.parallel.tp_common import prompt_logits

# head_dim 64: int4's groups are 64 wide
CFG = ModelConfig(vocab_size=258, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=64, max_position_embeddings=256, eos_token_ids=(257,))
PROMPTS = [[5, 9, 44, 100, 3], [7, 7, 8], [200, 1, 2, 3, 4, 5, 6, 7, 8]]
CACHE = CacheConfig(page_size=8, num_pages=32, max_pages_per_seq=8, kv_dtype="int4")
SCHED = BatcherConfig(token_buckets=(32,), max_seqs=4)


class _Attention(nnx.Module):
    """A layer's o_proj alone (what `fold_v_rotation` touches)."""
    v_rotation_folded = False

    def __init__(self, w, mesh):
        self.o_proj = nnx.Linear(*w.shape, use_bias=False, rngs=nnx.Rngs(0))
        self.o_proj.kernel.set_value(jax.device_put(jnp.asarray(w), NamedSharding(mesh, P("tp", None))))


@pytest.mark.parametrize("head_dim,tp", [(64, 1), (64, 2), (192, 2)], ids=["d64", "d64-tp2", "d192-blocks-tp2"])
def test_folded_o_proj_takes_rotated_rows(head_dim, tp):
    """rotate(o) @ folded W == o @ W, with o_proj's rows (4 heads) sharded over `tp` devices (at D = 192 the
    rotation is three blocks of 64)."""
    if jax.device_count() < tp:
        pytest.skip(f"needs {tp} devices")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4 * head_dim, 96)).astype(np.float32)
    mesh = make_mesh(tp)
    layer = _Attention(w, mesh)
    fold_v_rotation(layer, mesh, head_dim)
    folded = layer.o_proj.kernel[...]
    assert layer.v_rotation_folded and folded.sharding.spec == P("tp", None)
    o = rng.standard_normal((5, 4, head_dim)).astype(np.float32)
    rows = np.asarray(rotate(jnp.asarray(o))).reshape(5, -1)
    np.testing.assert_allclose(rows @ np.asarray(folded), o.reshape(5, -1) @ w, rtol=1e-4, atol=1e-3)
    assert not np.allclose(np.asarray(folded), w, atol=1e-2)        # the weight did change


def _engine(fold: bool, tp: int = 1, cfg=CFG):
    model = random_model(cfg, seed=3, std=0.2)
    return Engine(model, ByteTokenizer(), EngineConfig(cfg, CACHE, SCHED, parallel=ParallelConfig(tp),
                                                       execution=ExecutionConfig(fold_v_rotation=fold)))


def test_only_int4_is_folded():
    """kivi64 also stores V rotated but keeps the per-step rotation (rotation_fold.FOLDED says why); formats that
    do not rotate V have nothing to fold."""
    assert folds("int4") and not any(folds(f) for f in ("kivi64", "bfloat16", "fp8", "int8"))


@pytest.mark.parametrize("tp", [1, 2])
def test_folded_engine_computes_what_per_step_rotation_does(tp):
    """int4 with f32 weights: the fold changes nothing but rounding."""
    if jax.device_count() < tp:
        pytest.skip(f"needs {tp} devices")
    sp = SamplingParams.greedy(max_tokens=10, ignore_eos=True)
    out = {}
    for fold in (True, False):
        eng = _engine(fold, tp)
        layer = eng.runner.model().layers
        assert layer.v_rotation_folded == fold
        out[fold] = (prompt_logits(eng, PROMPTS, 32), [o.token_ids for o in eng.generate(PROMPTS, sp)],
                     reference.greedy(eng.runner.model(), PROMPTS[0], 10))
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-4, atol=1e-4)
    assert out[True][1] == out[False][1]
    # the reference forward (no cache) honours the fold: the folded engine's model gives the unfolded one's tokens
    assert out[True][2] == out[False][2]


def test_folded_bfloat16_weights_stay_within_their_rounding(monkeypatch):
    """The serving dtype: o_proj folded and rounded to bfloat16 once, against the rows rotated in bfloat16 every
    step. With int4's discontinuous rounding of the next layer's K and V the logits move by a few percent of their
    range (measured 5%) and the argmax holds; a wrong frame (the weight folded, the layer not told) moves them by
    several times more."""
    import nfjax.engine.runner as runner_mod
    cfg = CFG.replace(dtype="bfloat16")
    folded, unfolded = (prompt_logits(_engine(fold, cfg=cfg), PROMPTS, 32) for fold in (True, False))
    scale = np.abs(unfolded).max()
    err = np.abs(folded - unfolded).max()
    assert err <= 0.1 * scale and (folded.argmax(-1) == unfolded.argmax(-1)).all()

    def fold_unmarked(layer, mesh, head_dim):
        fold_v_rotation(layer, mesh, head_dim)
        layer.v_rotation_folded = False
    monkeypatch.setattr(runner_mod, "fold_v_rotation", fold_unmarked)
    wrong = prompt_logits(_engine(True, cfg=cfg), PROMPTS, 32)
    assert np.abs(wrong - unfolded).max() > 3 * err
