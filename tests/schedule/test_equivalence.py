"""Every strategy and split gives the tokens of `sequential` (greedy, 64+ steps of mixed prefill/decode batches),
at TP 1, 2 and 4; merges and cache writes compile to no copies; split variants compile without the dot merger."""
import re

import pytest

from sched_common import ALL, CFG, LABELS, engine, run


# One test per TP degree asserts everything about that degree's engine: its strategies' tokens, and (TP 1, 2) its
# compiled merges and cache writes, (TP 2) its split variants' options. The engines are cached per process
# (sched_common), but pytest-xdist may send tests of one module to different workers: as separate tests, a worker
# that got only the HLO checks compiled the whole engine again (~100 s of a CI run).
@pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda t: f"tp{t}")
def test_every_strategy_matches_sequential(tp):
    eng = engine(tp)
    if tp in (1, 2):
        check_merges_and_cache_writes_compile_without_copies(eng)
    if tp == 2:
        check_split_variants_compile_without_the_dot_merger(eng)
    assert eng.runner.num_compiled == len(ALL) + 1          # every variant compiled for the one bucket
    ref, steps, counts = run(eng, "sequential")
    assert counts == {"sequential": len(steps)}
    assert len(steps) >= 64
    mixed = [s for s in steps if s.decode_tokens and s.prefill_tokens]
    assert len(mixed) >= 8, "the workload must mix prefill chunks into decode steps"
    for label in LABELS:
        got, steps2, counts2 = run(eng, label)
        assert counts2 == {label: len(steps2)}, f"{label} did not run every step"
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        assert got == ref, f"tp={tp} {label}: request {first} differs from sequential"


def _shapes(hlo: str, opcodes: tuple[str, ...]) -> list[str]:
    """Result shapes (dtype[dims]) of every instruction with one of these opcodes."""
    pat = re.compile(r"= (\w+\[[\d,]*\])(?:\{[^}]*\})? (" + "|".join(map(re.escape, opcodes)) + r")\(")
    return [m.group(1) for m in pat.finditer(hlo)]


def _shape(dtype, dims) -> str:
    return f"{'f32' if str(dtype) == 'float32' else 'bf16'}[{','.join(map(str, dims))}]"


def check_merges_and_cache_writes_compile_without_copies(eng):
    """Optimized HLO of each compiled step: no `copy` (nor async copy-start) produces an array of the shape of
    the per-device KV cache, of a merged nano-batch buffer (recorded while tracing), or of a residual-stream piece
    carried between layers. A copy of the cache would mean an in-place write that XLA could not order after its
    readers; a copy of a merged buffer would mean the merge was not built once from complete pieces."""
    r = eng.runner
    kv = r.kv.k.addressable_shards[0].data
    kv_shape = _shape(kv.dtype, kv.shape)
    merged_any = False
    for (bucket, label), compiled in r._steps.items():
        hlo = compiled.as_text()
        copies = _shapes(hlo, ("copy", "copy-start"))
        assert kv_shape not in copies, f"{label}: the KV cache {kv_shape} is copied"
        fn = r.layer_fns[(bucket, label)]
        forbidden = {_shape("float32", shape) for _, _, _, shape in fn.merges}
        if len(fn.layer_schedule.carry_ranges) > 1:
            forbidden |= {_shape("float32", (b - a, CFG.hidden_size)) for a, b in fn.layer_schedule.carry_ranges}
        merged_any |= bool(fn.merges)
        bad = sorted(forbidden & set(copies))
        assert not bad, f"{label}: merged/carried buffers copied: {bad}"
        if label.startswith("nanoflow"):
            assert fn.layer_schedule.buffered and fn.merges      # the test plan really merges nano-batches
    assert merged_any


def check_split_variants_compile_without_the_dot_merger(eng):
    """A split variant compiles with XLA's dot merger off (a DebugOptions field, accepted on CPU); the plain one
    with no options."""
    v = eng.runner.variants.by_bucket[64]
    assert v["dual_batch:1-1"].compiler_options() == {"xla_gpu_dot_merger_threshold_mb": 0}
    assert v["sequential"].compiler_options() == {}
