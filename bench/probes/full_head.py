"""What the full head costs (penalties, min_tokens, logprobs; nfjax/engine/penalties.py) against the greedy and
sampling heads: the lm_head GEMM plus each head's sampler, at the 8B shape's vocabulary (128,256) and hidden size
(4,096), bf16 weights, for a few row counts (sequences a step); and each head's compile time.

The full head's rows all carry penalties here (every row reads and updates its penalty slot) and min_tokens bans;
its state holds `--slots` penalty slots (the engine keeps one per sequence a step: 512 by default on a GPU).

`--engine`: instead, an engine at the bench flags (default the 8B shape, random weights) runs the same requests
(512 prompt tokens, 256 generated, ignoring EOS) with each kind of sampling parameters, and reports output
tokens/s, the median step of >= 200 decodes, and the engine's compile time.

usage: python -m bench.probes.full_head [--rows 16,64,256,512] [--slots 512] [--vocab 128256] [--hidden 4096]
       python -m bench.probes.full_head --engine [--requests 256] [engine flags]
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def engine_run(a) -> dict:
    from bench.setup import bench_engine
    from nfjax.engine import SamplingParams
    t0 = time.perf_counter()
    eng = bench_engine(a)
    out = {"build_s": round(time.perf_counter() - t0, 1), "compile_s": round(eng.runner.compile_seconds, 1),
           "capacity": eng.capacity_line(), "requests": a.requests, "prompt": 512, "output": 256}
    print(json.dumps(out), flush=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, eng.model_config.vocab_size - 2, 512).tolist() for _ in range(a.requests)]
    eng.generate(prompts[:8], SamplingParams.greedy(max_tokens=4, ignore_eos=True))
    samp = dict(temperature=0.8, top_p=0.95, seed=1, max_tokens=256, ignore_eos=True)
    pen = dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1)
    kinds = {"greedy": SamplingParams.greedy(max_tokens=256, ignore_eos=True),
             "sampled": SamplingParams(**samp),
             "greedy+logprobs5": SamplingParams.greedy(max_tokens=256, ignore_eos=True, logprobs=5),
             "sampled+penalties": SamplingParams(**samp, **pen),
             "sampled+penalties+logprobs20": SamplingParams(**samp, **pen, logprobs=20)}
    for name, sp in kinds.items():
        eng.trace.steps.clear()
        t = time.perf_counter()
        eng.generate(prompts, sp)
        dt = time.perf_counter() - t
        dec = [s.seconds for s in eng.trace.steps if s.prefill_tokens == 0 and s.decode_tokens >= 200]
        out[name] = {"s": round(dt, 2), "output_tok_s": round(a.requests * 256 / dt),
                     "decode_step_ms_median": round(1e3 * float(np.median(dec)), 2) if dec else None,
                     "host_ms_mean": round(float(np.mean([s.host_ms for s in eng.trace.steps])), 2),
                     "steps": len(eng.trace.steps)}
        print(name, json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    from bench.common import time_fn
    from bench.setup import add_bench_args
    from nfjax.engine.penalties import FullInput, PenaltyState, full_sample, state_bytes
    from nfjax.engine.sampler import sample
    from nfjax.engine.step_input import StepInput
    from nfjax.kv.metadata import build_metadata

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64,256,512")
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--engine", action="store_true", help="time an engine's requests instead (see above)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    add_bench_args(ap)
    a = ap.parse_args()
    if a.engine:
        result = {"device": jax.devices()[0].device_kind, "engine": engine_run(a)}
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(result, fh, indent=1)
        return
    v, d = a.vocab, a.hidden
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((d, v), np.float32) * 0.02, jnp.bfloat16)

    def logits(x, w):
        return (x @ w).astype(jnp.float32)

    def greedy(x, w, inp):
        return sample(logits(x, w), inp.temperature, inp.top_k, inp.top_p, inp.seeds, inp.counters, any_sampled=False)

    def sampled(x, w, inp):
        return sample(logits(x, w), inp.temperature, inp.top_k, inp.top_p, inp.seeds, inp.counters, any_sampled=True)

    def full(x, w, inp, f, state):
        return full_sample(logits(x, w), inp, f, state)

    rows_out = []
    for s in (int(r) for r in a.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((s, d), np.float32), jnp.bfloat16)
        z = np.zeros(s, np.int32)
        meta = build_metadata([], s, s, 1, 16)
        inp = jax.device_put(StepInput(np.arange(s, dtype=np.int32), np.full(s, -1, np.int32), meta,
                                       np.ones(s, np.float32), z, np.full(s, 0.95, np.float32),
                                       np.arange(s, dtype=np.uint32), z))
        f = FullInput.empty(s, s, a.slots, v)
        f.slot[:] = f.count_slot[:] = np.arange(s) % a.slots
        f.presence[:], f.frequency[:], f.repetition[:] = 0.5, 0.5, 1.1
        f.banned[:, :3] = [0, 1, 2]
        f = jax.device_put(f)
        state = PenaltyState.create(a.slots, v)
        row = {"rows": s}
        for name, fn, args, donate in (("greedy", greedy, (x, w, inp), ()), ("sampled", sampled, (x, w, inp), ()),
                                       ("full", full, (x, w, inp, f, state), (4,))):
            t0 = time.perf_counter()
            compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
            row[f"{name}_compile_s"] = round(time.perf_counter() - t0, 3)
            if name == "full":
                box = {"state": state}

                def step():
                    out = compiled(x, w, inp, f, box["state"])
                    box["state"] = out[2]
                    return out[0]
                t = time_fn(step, iters=20, reps=5)
            else:
                t = time_fn(compiled, *args, iters=20, reps=5)
            row[f"{name}_ms"] = round(t["median_s"] * 1e3, 3)
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    result = {"device": jax.devices()[0].device_kind, "vocab": v, "hidden": d, "slots": a.slots,
              "state_bytes": state_bytes(a.slots, v), "rows": rows_out}
    print(json.dumps({k: result[k] for k in ("device", "state_bytes")}))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
