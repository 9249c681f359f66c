"""Shared engines for the schedule tests: one per TP degree, every strategy precompiled as a variant of one bucket,
so each strategy is compared with `sequential` on the same weights without recompiling (pin_strategy)."""
from pathlib import Path

from nfjax.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig, ExecutionConfig, BatcherConfig,
                          StrategyConfig)
from nfjax.engine import Engine, SamplingParams
from nfjax.models.random_init import random_model
from nfjax.tokenizer.byte import ByteTokenizer

HERE = Path(__file__).parent
TINY_PLAN = str(HERE / "tiny_plan.json")
TINY_BESIDE = str(HERE / "tiny_beside_plan.json")     # a horizontal kernel (decode attention beside up_gate)

CFG = ModelConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
                  head_dim=8, rope_theta=500000.0, max_position_embeddings=256, eos_token_ids=(257,))
CACHE = CacheConfig(page_size=8, num_pages=128, max_pages_per_seq=16)
SCHED = BatcherConfig(token_buckets=(64,), max_seqs=6)

# Splits chosen to cut inside the decode rows (4 of 64), inside prefill chunks (24, 16, 32), and three ways.
ALL = (StrategyConfig("nanobatch", split=(1, 15), align=4),
       StrategyConfig("nanobatch", split=(3, 5), align=4),
       StrategyConfig("comm_overlap", split=(1, 1, 2), align=4),
       StrategyConfig("dual_batch"),
       StrategyConfig("fused_reduce_norm", split=(1, 1), align=4),
       StrategyConfig("nanoflow", plan=TINY_PLAN),
       StrategyConfig("nanoflow", plan=TINY_BESIDE))
LABELS = [s.label for s in ALL]

# More prompts than max_seqs and different lengths: later requests are admitted (prefill chunks, one longer than
# the bucket) while others decode, so most steps mix decode and prefill tokens.
PROMPTS = ["Hello there", "tensor parallel nano batches are fun to schedule " * 2, "a",
           "The quick brown fox jumps over", "x" * 70, "pipelines", "overlap compute with memory", "z",
           "one more prompt to admit late", "decode attention is bandwidth bound", "gemm" * 9, "ok",
           "the last request arrives when others are half done"]
PARAMS = [SamplingParams.greedy(max_tokens=m, ignore_eos=True)
          for m in (64, 20, 40, 64, 10, 30, 64, 50, 25, 12, 35, 18, 40)]

_ENGINES: dict = {}


def engine(tp: int) -> Engine:
    key = tp
    if key not in _ENGINES:
        model = random_model(CFG, seed=1, std=0.2)   # wide logit margins: token equality tests the schedule
        _ENGINES[key] = Engine(model, ByteTokenizer(), EngineConfig(
            CFG, CACHE, SCHED, parallel=ParallelConfig(tp), execution=ExecutionConfig(ALL)))
    return _ENGINES[key]


def run(eng: Engine, label: str):
    """Greedy tokens of the workload with every step pinned to `label`, and the steps it took."""
    eng.runner.pin_strategy(label)
    eng.runner.strategy_counts.clear()
    n0 = len(eng.trace.steps)
    try:
        toks = [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]
    finally:
        eng.runner.pin_strategy(None)
    return toks, eng.trace.steps[n0:], dict(eng.runner.strategy_counts)
