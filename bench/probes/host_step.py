"""Probe (#27): the engine's host time per step, by phase, at a given occupancy and output length.

The shipped tiny model runs B requests of a short prompt and exactly L generated tokens each (greedy,
ignore_eos), all added at once, so most steps are decode@B at output positions 1..L. Per step it times the
host phases of `Engine.step` and of its caller: `next_batch` (the batcher), `launch` (inputs, their copy and the
dispatch), `read` (tokens to the host: the wait), `process` (tokens -> outputs: detokenization, stop strings,
finishing, output objects) and `consumer` (what the caller does with the outputs). Consumers:
- generate: as `Engine.generate` (keeps the finished outputs);
- stream: as the server's streams (every output's new_text and new_token_ids read each step);
- stop: generate with stop strings that never match (the stop check runs on every token);
- logprobs: generate with logprobs=5 (the full head; logprobs built per token).
By default each launched step is waited for before the host goes on (`--overlap` leaves the step running), so
the model's CPU compute does not share the cores with the host phases being timed; the model's time is not in
any phase. The digest line (finished outputs' tokens, texts, reasons, logprobs) lets two commits be compared for
identical results.

usage: python -m bench.probes.host_step [--batches 16@512,128@512,512@512] [--modes generate,stream,stop]
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import statistics
import time

PHASES = ("next_batch", "launch", "put", "dispatch", "read", "process", "consumer")
# the model's compute (waited for after each launch unless --overlap): not host time, shown for scale
OTHER = ("compute",)
PROMPT = 4                            # prompt tokens: every request's prefill fits in the first step
STOPS = ["\x00never", "@@@@"]         # stop strings the tiny model does not write


def _timed(fn, name: str, acc: dict, after=None, prof: cProfile.Profile | None = None):
    """`fn` timed into acc[name] (ms), profiled by `prof` if given; then `after(result)` (untimed)."""
    def wrapped(*a, **k):
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        out = fn(*a, **k)
        if prof is not None:
            prof.disable()
        acc[name] = acc.get(name, 0.0) + (time.perf_counter() - t) * 1e3
        if after is not None:
            after(out)
        return out
    return wrapped


def make_engine(buckets: tuple[int, ...], max_seqs: int, num_pages: int):
    from nfjax.engine.engine import TINY_MODEL, Engine
    return Engine.from_pretrained(TINY_MODEL, token_buckets=buckets, max_seqs=max_seqs, num_pages=num_pages,
                                  max_prefill_seqs=max_seqs, prefix_cache=False)


def params_for(mode: str, n: int):
    from nfjax.engine.sampling_params import SamplingParams
    kw = {"stop": STOPS} if mode == "stop" else {"logprobs": 5} if mode == "logprobs" else {}
    return SamplingParams.greedy(max_tokens=n, ignore_eos=True, **kw)


def run(engine, mode: str, batch: int, length: int, overlap: bool = False, profile: cProfile.Profile | None = None
        ) -> dict:
    """B = `batch` requests of `length` tokens through `engine` with the `mode` consumer; per-step phase ms."""
    import jax
    acc: dict[str, float] = {}

    def wait(h):                  # the model's compute, out of every phase
        acc["put"] = acc.get("put", 0.0) + h.put_ms
        acc["dispatch"] = acc.get("dispatch", 0.0) + h.dispatch_ms
        if overlap:
            return
        t = time.perf_counter()
        jax.block_until_ready((h.sampled, h.logprobs))
        acc["compute"] = acc.get("compute", 0.0) + (time.perf_counter() - t) * 1e3
    saved = engine.batcher.next_batch, engine.runner.launch, engine.runner.read, engine._process
    engine.batcher.next_batch = _timed(saved[0], "next_batch", acc, prof=profile)
    engine.runner.launch = _timed(saved[1], "launch", acc, after=wait, prof=profile)
    engine.runner.read = _timed(saved[2], "read", acc)
    engine._process = _timed(saved[3], "process", acc, prof=profile)
    prompts = [[256] + [32 + (7 * i + j) % 90 for j in range(PROMPT - 1)] for i in range(batch)]
    p = params_for(mode, length)
    steps, final, streamed = [], {}, {}
    try:
        ids = [engine.add_request(q, p) for q in prompts]
        while len(final) < len(ids) or engine._inflight is not None:
            acc.clear()
            t = time.perf_counter()
            outs = engine.step()
            t1 = time.perf_counter()
            if mode == "stream":        # the server's loop: every output's new text and ids, per request
                for o in outs:
                    streamed.setdefault(o.request_id, []).append(o.new_text)
                    _ = len(o.new_token_ids)
                    if o.finished:
                        final[o.request_id] = o
            else:
                for o in outs:
                    if o.finished:
                        final[o.request_id] = o
            t2 = time.perf_counter()
            rec = dict(acc, consumer=(t2 - t1) * 1e3, total=(t2 - t) * 1e3 - acc.get("compute", 0.0), outs=len(outs))
            steps.append(rec)
    finally:
        engine.batcher.next_batch, engine.runner.launch, engine.runner.read, engine._process = saved
    if mode == "stream":
        assert all("".join(streamed[r]) == final[r].text for r in ids), "streamed text differs from the final text"
    dec = [s for s in steps if s["outs"] == batch][1:]      # decode steps at full occupancy (not the prefill)
    q = max(1, len(dec) // 4)
    res = {"steps": len(steps), "decode_steps": len(dec)}
    for ph in PHASES + OTHER + ("total",):
        res[ph] = statistics.mean(s.get(ph, 0.0) for s in dec) if dec else 0.0
    res["process_first_quarter"] = statistics.mean(s.get("process", 0.0) for s in dec[:q]) if dec else 0.0
    res["process_last_quarter"] = statistics.mean(s.get("process", 0.0) for s in dec[-q:]) if dec else 0.0
    res["host"] = res["total"] - res["read"]
    h = hashlib.sha256()
    for r in ids:
        o = final[r]
        h.update(repr((o.token_ids, o.text, o.finish_reason,
                       [(lp.token_id, round(lp.logprob, 4)) for lp in (o.logprobs or [])])).encode())
    res["digest"] = h.hexdigest()[:16]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16@512,128@512,512@512", help="B@L,...: requests at once @ tokens each")
    ap.add_argument("--modes", default="generate,stream,stop", help="consumers: generate,stream,stop,logprobs")
    ap.add_argument("--buckets", default=None,
                    help="token buckets (default: 16, the batches' sizes and one for all prompts at once)")
    ap.add_argument("--overlap", action="store_true", help="leave launched steps running (the engine's own overlap)")
    ap.add_argument("--profile", type=int, default=0,
                    help="print the top N functions (own time) of a cProfile of the host phases next_batch, launch "
                         "and process over all runs")
    args = ap.parse_args()
    from bench.common import print_table
    from nfjax.config import pages_for
    batches = [tuple(int(x) for x in b.split("@")) for b in args.batches.split(",")]
    buckets = tuple(int(x) for x in args.buckets.split(",")) if args.buckets else \
        tuple(sorted({16} | {b for b, _ in batches}))
    most = max(b for b, _ in batches)
    if not args.buckets and most * PROMPT > most:
        buckets = tuple(sorted(set(buckets) | {most * PROMPT}))
    pages = max(b * (pages_for(PROMPT + n + 1, 16) + 1) for b, n in batches) + 8     # room for the forecast
    t = time.perf_counter()
    engine = make_engine(buckets, most, pages)
    print(f"tiny engine: buckets {buckets}, {most} sequences, {pages} pages; ready in "
          f"{time.perf_counter() - t:.1f} s", flush=True)
    prof = cProfile.Profile() if args.profile else None
    run(engine, "generate", min(4, most), 4)           # warm-up (first calls of every program)
    rows = []
    for mode in args.modes.split(","):
        for b, n in batches:
            r = run(engine, mode, b, n, overlap=args.overlap, profile=prof)
            rows.append([mode, b, n, r["decode_steps"]] + [round(r[k], 3) for k in PHASES + OTHER] +
                        [round(r["host"], 3), round(r["process_first_quarter"], 3),
                         round(r["process_last_quarter"], 3), r["digest"]])
            print(f"  {mode} {b}@{n}: host {r['host']:.2f} ms a step (process {r['process']:.2f})", flush=True)
    print_table(["mode", "B", "L", "steps"] + [f"{p} ms" for p in PHASES + OTHER] +
                ["host ms", "process 1st q", "process last q", "digest"], rows,
                title="ms per decode step at full occupancy (means; host = all but read)")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
