"""Online serving: latency vs request rate through the HTTP server, with Poisson arrivals.

The server (real uvicorn on 127.0.0.1, same process, own threads) is driven by an asyncio httpx client that
sends streaming /v1/completions requests (token-id prompts, `ignore_eos`, fixed output lengths) at Poisson
arrival times, one rate after another. Per rate: NanoFlow's normalized latency (end-to-end latency / output
tokens) mean and p99, TTFT (first streamed chunk) and TPOT ((e2e - TTFT) / (output tokens - 1)), achieved
request and token rates. Headline figures: the highest tested rate up to which every tested rate keeps the mean
normalized latency at or under 200 ms with no failed request (`max_rate_under_200ms_normalized_latency`, 0 if
the lowest rate already misses) and the mean TPOT at the lightest rate (`tpot_ms_light_load`).

The client shares the server's process (and its GIL): at hundreds of concurrent streams its SSE parsing competes
with the engine loop. To rule that out, start the server separately (`python serve.py ...`) and pass `--url`.

usage (GPU):  python bench/serving.py --shape llama3-8b --workload sharegpt --rates 2,4,8,16,32 --num-requests 300
              python bench/serving.py --model PATH --rates ...       (a checkpoint; default: the tiny model)
CPU smoke:    python bench/serving.py --rates 1,2 --num-requests 6 --workload 32x16 --token-buckets 32,128 \
                  --max-seqs 8 --name serving-smoke
              (--url http://HOST:PORT drives a server that is already running instead of starting one)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SLO_S = 0.200     # normalized-latency bound of the headline figure


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def build_engine(args):
    """The engine to serve: a checkpoint (default: the tiny model) or a random-weight model of a named shape."""
    from nfjax.engine import Engine
    if args.shape is None:
        engine = Engine.from_pretrained(args.model, dtype=args.dtype, page_size=args.page_size,
                                        num_pages=args.num_pages, max_pages_per_seq=args.max_pages_per_seq,
                                        token_buckets=args.token_buckets, max_seqs=args.max_seqs, tp=args.tp)
        from nfjax.server import model_name_for
        return engine, model_name_for(args.model)
    from nfjax.config import CacheConfig, EngineConfig, SchedulerConfig
    from nfjax.kv.cache import pages_that_fit
    from nfjax.models.random_init import SHAPES, random_model
    from nfjax.tokenizer.silent import SilentTokenizer
    cfg = SHAPES[args.shape]
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    model = random_model(cfg)
    ps = args.page_size or 16
    num_pages = args.num_pages or pages_that_fit(cfg, ps, 0.9)
    per_seq = args.max_pages_per_seq or -(-cfg.max_position_embeddings // ps)
    cache = CacheConfig(page_size=ps, num_pages=num_pages, max_pages_per_seq=min(per_seq, num_pages - 1))
    sched = SchedulerConfig(token_buckets=args.token_buckets or (256, 512, 1024, 2048),
                            max_seqs=args.max_seqs or 256)
    tok = SilentTokenizer(cfg.vocab_size, cfg.eos_token_ids)
    return Engine(model, tok, EngineConfig(cfg, cache, sched)), args.shape


def make_workload(spec: str, n: int, vocab: int, max_len: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) pairs, clipped so prompt + output fits the context."""
    from bench.workloads import parse
    out = []
    for ids, lout in parse(spec, n, vocab, seed):
        ids = ids[:max(1, max_len - 2)]
        lout = max(1, min(lout, max_len - len(ids)))
        out.append((ids, lout))
    return out


async def one_request(client, url: str, model: str, ids: list[int], max_tokens: int, temperature: float,
                      t_arrival: float) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    rec = {"prompt_tokens": len(ids), "max_tokens": max_tokens, "ok": False}
    ttft = None
    n_out = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                ch = json.loads(data)
                if "error" in ch:
                    rec["error"] = ch["error"]["message"]
                    return rec
                if ch.get("choices") and ttft is None:
                    ttft = time.perf_counter() - t_arrival
                if ch.get("usage"):
                    n_out = ch["usage"]["completion_tokens"]
    except Exception as e:   # noqa: BLE001 - a failed request is recorded, the run goes on
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    e2e = time.perf_counter() - t_arrival
    if n_out is None or ttft is None:
        rec["error"] = "stream ended without usage or tokens"
        return rec
    rec.update(ok=True, output_tokens=n_out, e2e_s=e2e, ttft_s=ttft, normalized_s=e2e / max(n_out, 1),
               tpot_s=(e2e - ttft) / (n_out - 1) if n_out > 1 else None, finished_at=time.perf_counter())
    return rec


def _stats(xs: list[float]) -> dict:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return {"mean": None, "p50": None, "p99": None}

    def pct(q):
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]
    return {"mean": sum(xs) / len(xs), "p50": pct(0.50), "p99": pct(0.99)}


async def run_rate(url: str, model: str, work, rate: float, temperature: float, seed: int, timeout: float) -> dict:
    import httpx
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        t_next = t0
        for ids, lout in work:
            t_next += rng.expovariate(rate)
            delay = t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            arrival = time.perf_counter()
            tasks.append(asyncio.create_task(one_request(client, url, model, ids, lout, temperature, arrival)))
        recs = await asyncio.gather(*tasks)
    ok = [r for r in recs if r["ok"]]
    span = (max(r["finished_at"] for r in ok) - t0) if ok else None
    out_tokens = sum(r["output_tokens"] for r in ok)
    res = {"rate": rate, "requests": len(recs), "completed": len(ok), "errors": len(recs) - len(ok),
           "first_errors": [r["error"] for r in recs if not r["ok"]][:5],
           "seconds": span, "achieved_req_s": len(ok) / span if span else None,
           "output_tok_s": out_tokens / span if span else None, "output_tokens": out_tokens,
           "normalized_latency_s": _stats([r["normalized_s"] for r in ok]),
           "ttft_s": _stats([r["ttft_s"] for r in ok]), "tpot_s": _stats([r["tpot_s"] for r in ok]),
           "e2e_s": _stats([r["e2e_s"] for r in ok])}
    return res


def wait_idle(url: str, timeout: float = 120.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            h = httpx.get(f"{url}/health", timeout=10).json()
            if h.get("running", 0) == 0 and h.get("queue_depth", 0) == 0:
                return
        except Exception:   # noqa: BLE001
            pass
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="nfjax checkpoint folder (default: the shipped tiny model)")
    ap.add_argument("--shape", default=None, help="serve a random-weight model of this shape instead "
                                                  "(llama3-8b, llama3-70b, smoke); token-id prompts only")
    ap.add_argument("--url", default=None, help="drive an already running server instead of starting one")
    ap.add_argument("--rates", type=_floats, default=_floats("1,2,4,8,16"), help="requests/s, comma-separated")
    ap.add_argument("--num-requests", type=int, default=200, help="requests per rate")
    ap.add_argument("--duration", type=float, default=None,
                    help="cap each rate at about this many seconds of arrivals (fewer requests at low rates)")
    ap.add_argument("--workload", default="sharegpt", help="sharegpt (log-normal lengths) or INxOUT, e.g. 512x128")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--token-buckets", type=_ints, default=None)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (with --model)")
    ap.add_argument("--max-seqs", type=int, default=None)
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--max-pages-per-seq", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="serving")
    ap.add_argument("--out-dir", default=None, help="results folder (default: bench/results)")
    args = ap.parse_args()

    from bench.common import print_table, save_plot, write_results

    srv = None
    t = time.perf_counter()
    if args.url:
        import httpx
        url = args.url.rstrip("/")
        card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        model, vocab, max_len = card["id"], 256, card["max_model_len"]
        engine_info = {"external_server": url}
    else:
        from nfjax.config import ServerConfig
        from nfjax.server import ServerThread
        engine, model = build_engine(args)
        vocab, max_len = engine.model_config.vocab_size, engine.max_model_len
        engine_info = {"model_config": engine.model_config.to_json(), "cache": vars(engine.config.cache),
                       "scheduler": vars(engine.config.scheduler), "compile_s": engine.runner.compile_seconds}
        srv = ServerThread(engine, ServerConfig(port=0, max_queue=1 << 20, log_level="warning"), model).start()
        url = srv.url
    startup_s = time.perf_counter() - t
    try:
        warm = make_workload(args.workload, 4, vocab, max_len, seed=args.seed + 999)
        asyncio.run(run_rate(url, model, [(ids, min(lout, 8)) for ids, lout in warm], 100.0, args.temperature,
                             args.seed, args.timeout))
        wait_idle(url)
        results = []
        for i, rate in enumerate(args.rates):
            n = args.num_requests
            if args.duration:
                n = max(1, min(n, math.ceil(rate * args.duration)))
            work = make_workload(args.workload, n, vocab, max_len, seed=args.seed + i)
            res = asyncio.run(run_rate(url, model, work, rate, args.temperature, args.seed + i, args.timeout))
            results.append(res)
            nl = res["normalized_latency_s"]
            print(f"rate {rate:g}/s: {res['completed']}/{res['requests']} ok, normalized latency mean "
                  f"{_ms(nl['mean'])} ms p99 {_ms(nl['p99'])} ms", flush=True)
            wait_idle(url)
    finally:
        if srv is not None:
            srv.stop()

    rows = []
    for r in results:
        nl, tt, tp = r["normalized_latency_s"], r["ttft_s"], r["tpot_s"]
        rows.append([r["rate"], f"{r['completed']}/{r['requests']}", r["achieved_req_s"], r["output_tok_s"],
                     _ms(nl["mean"]), _ms(nl["p99"]), _ms(tt["mean"]), _ms(tt["p99"]), _ms(tp["mean"]),
                     _ms(tp["p99"])])
    print_table(["rate/s", "ok", "got req/s", "out tok/s", "norm ms", "norm p99", "TTFT ms", "TTFT p99",
                 "TPOT ms", "TPOT p99"], rows, title=f"serving: {model}, workload {args.workload}")
    under = []          # rates, lowest first, up to the first one that misses the bound (or has errors)
    for r in sorted(results, key=lambda r: r["rate"]):
        nl = r["normalized_latency_s"]["mean"]
        if r["errors"] or nl is None or nl > SLO_S:
            break
        under.append(r["rate"])
    light = min(results, key=lambda r: r["rate"]) if results else None
    summary = {
        "max_rate_under_200ms_normalized_latency": max(under) if under else 0.0,
        "tpot_ms_light_load": _ms(light["tpot_s"]["mean"]) if light else None,
        "ttft_ms_light_load": _ms(light["ttft_s"]["mean"]) if light else None,
        "normalized_latency_ms_light_load": _ms(light["normalized_latency_s"]["mean"]) if light else None,
        "max_output_tok_s": max((r["output_tok_s"] or 0) for r in results) if results else None,
    }
    path = write_results(args.name, summary, {"args": vars(args), "model": model, "workload": args.workload,
                                              "slo_normalized_latency_s": SLO_S, "startup_s": startup_s,
                                              "engine": engine_info, "results": results}, out_dir=args.out_dir)
    rates = [r["rate"] for r in results]

    def series(key):
        return {"mean": (rates, [_ms(r[key]["mean"]) for r in results]),
                "p99": (rates, [_ms(r[key]["p99"]) for r in results])}
    save_plot(path[:-len(".json")] + ".png", [
        {"title": "normalized latency (e2e / output tokens)", "xlabel": "request rate (req/s)", "ylabel": "ms",
         "series": series("normalized_latency_s"), "hlines": {"200 ms": SLO_S * 1e3}},
        {"title": "time to first token", "xlabel": "request rate (req/s)", "ylabel": "ms", "series": series("ttft_s")},
        {"title": "time per output token", "xlabel": "request rate (req/s)", "ylabel": "ms",
         "series": series("tpot_s")}])
    print(json.dumps(summary), flush=True)


def _ms(x):
    return None if x is None else 1e3 * x


if __name__ == "__main__":
    main()
