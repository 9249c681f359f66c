import jax
import pytest
from flax import nnx

from nfjax.config import CacheConfig, EngineConfig, ModelConfig, ExecutionConfig, BatcherConfig
from nfjax.engine import Engine
from nfjax.models.llama import LlamaModel
from nfjax.tokenizer.byte import ByteTokenizer

TINY = ModelConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=512, eos_token_ids=(257,), bos_token_id=256)


def make_engine(cache: CacheConfig, sched: BatcherConfig, cfg: ModelConfig = TINY, seed: int = 0,
                execution: ExecutionConfig | None = None) -> Engine:
    # init scale 0.2 keeps greedy argmax margins wide, so token equality checks test the engine, not rounding
    model = LlamaModel(cfg, nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    scaled = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 10.0 if getattr(path[-2], "key", None) in ("kernel", "embedding") else x, state)
    nnx.update(model, scaled)
    return Engine(model, ByteTokenizer(), EngineConfig(cfg, cache, sched, execution=execution or ExecutionConfig()))


class CompileCounter:
    """A jax.monitoring duration listener counting programs compiled, or loaded from the persistent compilation
    cache (tests/conftest.py: a program another test compiled loads from there instead of compiling, and counts
    the same)."""
    def __init__(self):
        self.count = 0

    def __call__(self, event, *args, **kw):
        self.count += "backend_compile" in event or "compilation_cache/cache_retrieval" in event


@pytest.fixture(scope="module")
def roomy_engine():
    return make_engine(CacheConfig(page_size=8, num_pages=256, max_pages_per_seq=32),
                       BatcherConfig(token_buckets=(32, 128), max_seqs=16))
