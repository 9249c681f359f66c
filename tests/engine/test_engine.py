"""Engine behaviour on a tiny random model: correctness vs a plain greedy loop, sampling options, streaming."""
import pytest

from nfjax.config import CacheConfig
from nfjax.engine import SamplingParams
from nfjax.errors import UserError
from nfjax.models import reference


def naive_greedy(engine, prompt_ids, n):
    """Greedy decoding by the reference forward over the whole sequence every token (no cache, no batching)."""
    return reference.greedy(engine.runner.model(), prompt_ids, n)


def test_greedy_matches_naive_loop_for_ragged_batch(roomy_engine):
    prompts = ["Hello", "The quick brown fox jumps over", "a" * 70, "x"]
    outs = roomy_engine.generate(prompts, SamplingParams.greedy(max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == naive_greedy(roomy_engine, roomy_engine.tokenizer.encode(p), 12), p
        assert o.finish_reason == "length" and len(o.token_ids) == 12
    assert roomy_engine.pages_used == 0


def test_token_id_prompts_and_single_prompt(roomy_engine):
    ids = roomy_engine.tokenizer.encode("Hello")
    a = roomy_engine.generate(ids, SamplingParams.greedy(max_tokens=5, ignore_eos=True))
    b = roomy_engine.generate("Hello", SamplingParams.greedy(max_tokens=5, ignore_eos=True))
    assert len(a) == len(b) == 1 and a[0].token_ids == b[0].token_ids
    assert a[0].text == roomy_engine.tokenizer.decode(a[0].token_ids)


def test_seeded_sampling_is_batch_invariant_and_seed_dependent(roomy_engine):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = roomy_engine.generate("Sampling test", sp)[0].token_ids
    crowd = roomy_engine.generate(["other prompt"] * 5 + ["Sampling test"],
                                  [SamplingParams(temperature=1.0, seed=i, max_tokens=7) for i in range(5)] + [sp])
    assert crowd[-1].token_ids == alone
    other = roomy_engine.generate("Sampling test", SamplingParams(temperature=1.0, seed=99, max_tokens=10,
                                                                  ignore_eos=True))[0].token_ids
    assert other != alone


def test_plain_sampled_request_draws_the_same_beside_a_top_p_request(roomy_engine):
    """A temperature-only request draws in the sampling head alone and in the sorting (top-k / top-p) head
    beside a top-p request (the batch's head follows its neighbours): the same tokens either way."""
    sp = SamplingParams(temperature=1.0, seed=4321, max_tokens=10, ignore_eos=True)
    alone = roomy_engine.generate("plain draw", sp)[0].token_ids
    beside = roomy_engine.generate(["plain draw", "nucleus"],
                                   [sp, SamplingParams(temperature=0.8, top_p=0.5, seed=1, max_tokens=10,
                                                       ignore_eos=True)])
    assert beside[0].token_ids == alone


def test_top_k_one_is_greedy(roomy_engine):
    g = roomy_engine.generate("abc", SamplingParams.greedy(max_tokens=8, ignore_eos=True))[0].token_ids
    k1 = roomy_engine.generate("abc", SamplingParams(temperature=2.0, top_k=1, seed=3, max_tokens=8,
                                                     ignore_eos=True))[0].token_ids
    assert g == k1


def test_stop_token_and_stop_string(roomy_engine):
    full = roomy_engine.generate("stop here", SamplingParams.greedy(max_tokens=16, ignore_eos=True))[0]
    tok = full.token_ids[5]
    first = full.token_ids.index(tok)
    o = roomy_engine.generate("stop here", SamplingParams.greedy(max_tokens=16, ignore_eos=True,
                                                                 stop_token_ids=(tok,)))[0]
    assert o.finish_reason == "stop" and o.token_ids == full.token_ids[:first + 1]
    text = full.text
    stop = text[6:8]
    assert stop
    o = roomy_engine.generate("stop here", SamplingParams.greedy(max_tokens=16, ignore_eos=True, stop=(stop,)))[0]
    assert o.finish_reason == "stop" and o.text == text[:text.index(stop)]


def test_streaming_deltas_add_up(roomy_engine):
    sp = SamplingParams.greedy(max_tokens=20, ignore_eos=True)
    final = roomy_engine.generate("stream me", sp)[0]
    outs = list(roomy_engine.stream("stream me", sp))
    assert outs[-1].finished and "".join(o.new_text for o in outs) == final.text
    assert sum((o.new_token_ids for o in outs), []) == final.token_ids


def test_abort_frees_pages(roomy_engine):
    rid = roomy_engine.add_request("abort me please", SamplingParams.greedy(max_tokens=50))
    for _ in range(3):
        roomy_engine.step()
    assert roomy_engine.pages_used > 0
    roomy_engine.abort(rid)
    while roomy_engine.has_unfinished():
        roomy_engine.step()
    assert roomy_engine.pages_used == 0


@pytest.mark.parametrize("kw,field", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                                      (dict(max_tokens=0), "max_tokens"), (dict(top_k=-2), "top_k")])
def test_bad_sampling_params(kw, field):
    with pytest.raises(UserError, match=field):
        SamplingParams(**kw)


def test_prompt_too_long_and_bad_ids(roomy_engine):
    with pytest.raises(UserError, match="context"):
        roomy_engine.add_request("x" * 1000)
    with pytest.raises(UserError, match="out of range"):
        roomy_engine.add_request([1, 2, 99999])



def test_layer_groups_with_a_remainder_match_the_naive_loop():
    """Three layers, two per program: a step runs a 2-layer and a 1-layer program."""
    from nfjax.config import ExecutionConfig, BatcherConfig
    from tests.engine.conftest import TINY, make_engine
    eng = make_engine(CacheConfig(page_size=8, num_pages=64, max_pages_per_seq=16),
                      BatcherConfig(token_buckets=(32,), max_seqs=4), cfg=TINY.replace(num_layers=3),
                      execution=ExecutionConfig(layers_per_program=2))
    assert eng.runner.groups == [(0, 2), (2, 1)] and (32, "sequential", 1) in eng.runner._steps
    # decode-only steps run their own programs (no prefill kernel); the tokens below cover them too
    assert set(eng.runner._decode_steps) == {(32, "sequential"), (32, "sequential", 1)}
    launched = []
    run_step = eng.runner.run_step
    eng.runner.run_step = lambda *a, **kw: launched.append(kw.get("decode_only")) or run_step(*a, **kw)
    prompts = ["layer groups", "x"]
    outs = eng.generate(prompts, SamplingParams.greedy(max_tokens=8, ignore_eos=True))
    assert True in launched and False in launched
    for p, o in zip(prompts, outs):
        assert o.token_ids == naive_greedy(eng, eng.tokenizer.encode(p), 8), p


def test_command_buffers_off_compiles_and_matches():
    """The XLA option that turns CUDA-graph command buffers off is accepted (it is a no-op on CPU)."""
    from nfjax.config import ExecutionConfig, BatcherConfig
    from tests.engine.conftest import make_engine
    eng = make_engine(CacheConfig(page_size=8, num_pages=32, max_pages_per_seq=16),
                      BatcherConfig(token_buckets=(32,), max_seqs=4), execution=ExecutionConfig(command_buffers=False))
    assert eng.runner.xla_options == {"xla_gpu_enable_command_buffer": "", "xla_disable_hlo_passes": "rematerialization"}
    out = eng.generate("command buffers", SamplingParams.greedy(max_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == naive_greedy(eng, eng.tokenizer.encode("command buffers"), 6)


def test_rematerialization_pass_off_unless_asked():
    """Every step program compiles without XLA's rematerialization pass (it counts the in-place KV pool twice and
    recomputes GEMMs on a GPU); `xla_remat=True` keeps XLA's pipeline, with the same tokens."""
    from nfjax.config import ExecutionConfig, BatcherConfig
    from tests.engine.conftest import make_engine
    cache, batcher = CacheConfig(page_size=8, num_pages=32, max_pages_per_seq=16), BatcherConfig(token_buckets=(32,),
                                                                                                  max_seqs=4)
    off = make_engine(cache, batcher)
    on = make_engine(cache, batcher, execution=ExecutionConfig(xla_remat=True))
    assert off.runner.xla_options == {"xla_disable_hlo_passes": "rematerialization"}
    assert on.runner.xla_options == {}
    prompt = "remat"
    params = SamplingParams.greedy(max_tokens=6, ignore_eos=True)
    assert off.generate(prompt, params)[0].token_ids == on.generate(prompt, params)[0].token_ids


def test_kernel_lowering_cache_is_turned_on_by_its_setting():
    """`kernel_lowering_cache=True` wraps the Pallas kernels' lowering before the engine's programs are lowered
    (on a CPU no program calls a Mosaic GPU kernel, so the tokens are the plain engine's)."""
    from nfjax.config import ExecutionConfig, BatcherConfig
    from pallas_kernels import _lowering_cache
    from tests.engine.conftest import make_engine
    cache, batcher = CacheConfig(page_size=8, num_pages=32, max_pages_per_seq=16), BatcherConfig(token_buckets=(32,),
                                                                                                  max_seqs=4)
    _lowering_cache.disable()
    try:
        plain = make_engine(cache, batcher)
        assert not _lowering_cache.stats()["enabled"]
        cached = make_engine(cache, batcher, execution=ExecutionConfig(kernel_lowering_cache=True))
        assert _lowering_cache.stats()["enabled"]
        params = SamplingParams.greedy(max_tokens=6, ignore_eos=True)
        assert plain.generate("lowering", params)[0].token_ids == cached.generate("lowering", params)[0].token_ids
    finally:
        _lowering_cache.disable()


def test_step_inputs_staged_in_the_same_buffers():
    """Every step of a bucket reads its inputs from the same device buffers (the staging copy writes over the
    donated previous ones), and the tokens equal those of an engine that hands each step fresh buffers."""
    import jax
    from nfjax.config import ExecutionConfig, BatcherConfig
    from tests.engine.conftest import make_engine
    cache, sched = CacheConfig(page_size=8, num_pages=64, max_pages_per_seq=16), BatcherConfig((32, 64), max_seqs=4)
    prompts = ["staged inputs, a longer prompt than the rest", "ab", "c"]
    sp = SamplingParams.greedy(max_tokens=10, ignore_eos=True)
    eng = make_engine(cache, sched)
    seen: dict[int, set] = {}
    run_step = eng.runner.run_step

    def spy(bucket, label, inp, **kw):
        out = run_step(bucket, label, inp, **kw)
        staged = jax.tree.leaves(eng.runner._staged[bucket])
        assert [a.dtype for a in staged] == [a.dtype for a in jax.tree.leaves(inp)]
        seen.setdefault(bucket, set()).add(tuple(a.unsafe_buffer_pointer() for a in staged))
        return out

    eng.runner.run_step = spy
    outs = eng.generate(prompts, sp)
    assert sum(len(v) for v in seen.values()) == len(seen) and 32 in seen    # one address set per bucket
    fresh = make_engine(cache, sched, execution=ExecutionConfig(stable_inputs=False))
    assert not fresh.runner._staged
    assert [o.token_ids for o in fresh.generate(prompts, sp)] == [o.token_ids for o in outs]


def test_largest_program_temps_are_reported_largest_first(roomy_engine):
    """XLA's scratch per compiled program, for the KV sizing's headroom: named by table and key, sorted."""
    temps = roomy_engine.runner.largest_temps(n=4)
    assert len(temps) == 4
    sizes = [b for _, b in temps]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 0
    assert all(name.split("(")[0].rstrip("0123456789") in ("embed", "head", "full_head", "layers", "decode_layers")
               for name, _ in temps)
