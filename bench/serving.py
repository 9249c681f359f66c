"""Online serving: latency vs request rate through the HTTP server, with Poisson arrivals.

An asyncio httpx client sends streaming /v1/completions requests (token-id prompts, `ignore_eos`, fixed output
lengths) at Poisson arrival times, one rate after another. Per rate: NanoFlow's normalized latency (end-to-end
latency / output tokens) mean and p99, TTFT (first streamed chunk) and TPOT ((e2e - TTFT) / (output tokens - 1)),
achieved request and token rates. Headline figures: the highest tested rate up to which every tested rate keeps
the mean normalized latency at or under 200 ms in steady state (`max_rate_under_200ms_normalized_latency`, 0 if
the lowest rate misses; see meets_slo) and the mean TPOT at the lightest rate (`tpot_ms_light_load`). Past
saturation a rate's latency stops meaning steady state: the queue then grows for as long as arrivals last, and
the latency is bounded by how many requests the rate sends (--num-requests, --duration-per-rate).
`first_rate_past_saturation` is the lowest tested rate whose queue grew: its last third of arrivals waited for
their first token at least SATURATED_GROWTH x as long as its first third (`ttft_growth`; a request never started
counts its whole wait). The headline stops below it; `max_rate_under_200ms_including_saturated` does not.
`first_rate_asking_more_than_delivered` (rate x mean output length above the most output any rate delivered) is a
weaker sign: a sweep whose rates all keep up still delivers less than it asks, since each rate's output rate counts
the drain after its last arrival.

The server: `--server-process` (default with --shape) runs bench/server.py in a process of its own (the
client never shares the engine loop's GIL) and stops it with SIGTERM at the end; `--in-process` serves from a
thread of this process (default otherwise: quick CPU runs); `--url` drives a server that is already running.

Bounded runs: per rate at most --num-requests requests and --duration-per-rate seconds of arrivals;
--rate-timeout ends a rate that long after it starts, cancelling open requests (`timed_out`): one that has
streamed gets its latency estimated from its own pace so far (erring high; `extrapolated`), one with no token yet
fails the rate. (One 2048-token ShareGPT-shaped output takes a minute at 30 ms a token.) --time-budget (seconds
from start) shortens or skips later rates. A run stopped early (SIGTERM, Ctrl-C, an error) still stops the server
and writes what it measured, marked `partial`.

usage (GPU):  python -m bench.serving --shape llama3-8b --workload sharegpt --rates 2,4,8,12,16 \
                  --duration-per-rate 20 --rate-timeout 55 --time-budget 390 --out DIR
CPU smoke:    python -m bench.serving --shape smoke --rates 1,4 --num-requests 8 --workload 32x16 \
                  --token-buckets 32,128 --max-seqs 8 --name serving-smoke --out /tmp/serv
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import threading
import time
import traceback

from bench.server import ServerProcess, engine_info, served_engine
from bench.setup import add_bench_args

SLO_S = 0.200     # normalized-latency bound of the headline figure
SATURATED_GROWTH = 2.0      # late arrivals' wait for a first token over early ones' where the queue grows


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def make_workload(spec: str, n: int, vocab: int, max_len: int, seed: int,
                  max_output: int | None = None) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) pairs, clipped so prompt + output fits the context (and to max_output)."""
    from bench.workloads import parse
    out = []
    for ids, lout in parse(spec, n, vocab, seed):
        ids = ids[:max(1, max_len - 2)]
        lout = max(1, min(lout, max_len - len(ids), max_output or lout))
        out.append((ids, lout))
    return out


async def one_request(client, url: str, model: str, ids: list[int], max_tokens: int, temperature: float,
                      rec: dict) -> None:
    """Send one streaming request and fill `rec` as it goes (so a cancelled request leaves what it saw)."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t_arrival = rec["t_arrival"]
    n_out = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                ch = json.loads(data)
                if "error" in ch:
                    rec["error"] = ch["error"]["message"]
                    return
                if ch.get("choices"):
                    rec["chunks"] += 1
                    rec["last_chunk_s"] = time.perf_counter() - t_arrival
                    if "ttft_s" not in rec:
                        rec["ttft_s"] = rec["last_chunk_s"]
                if ch.get("usage"):
                    n_out = ch["usage"]["completion_tokens"]
    except asyncio.CancelledError:
        raise
    except Exception as e:   # noqa: BLE001 - a failed request is recorded, the run goes on
        rec["error"] = f"{type(e).__name__}: {e}"
        return
    e2e = time.perf_counter() - t_arrival
    if n_out is None or "ttft_s" not in rec:
        rec["error"] = "stream ended without usage or tokens"
        return
    ttft = rec["ttft_s"]
    rec.update(ok=True, output_tokens=n_out, e2e_s=e2e, normalized_s=e2e / max(n_out, 1),
               tpot_s=(e2e - ttft) / (n_out - 1) if n_out > 1 else None, finished_at=time.perf_counter())


def _stats(xs: list[float]) -> dict:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return {"mean": None, "p50": None, "p99": None}

    def pct(q):
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]
    return {"mean": sum(xs) / len(xs), "p50": pct(0.50), "p99": pct(0.99)}


async def run_rate(url: str, model: str, work, rate: float, temperature: float, seed: int, timeout: float,
                   rate_timeout: float | None = None, recs: list | None = None) -> dict:
    """Poisson arrivals at `rate`; requests still open `rate_timeout` s after the start are cancelled. `recs`
    (the caller's list) collects the per-request records as they are made: an interrupted rate leaves them."""
    import httpx
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    recs = [] if recs is None else recs
    tasks = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + rate_timeout if rate_timeout else math.inf
        t_next = t0
        for ids, lout in work:
            t_next += rng.expovariate(rate)
            if t_next >= deadline:
                break
            delay = t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = {"prompt_tokens": len(ids), "max_tokens": lout, "ok": False, "chunks": 0,
                   "t_arrival": time.perf_counter()}
            recs.append(rec)
            tasks.append(asyncio.create_task(one_request(client, url, model, ids, lout, temperature, rec)))
        left = deadline - time.perf_counter()
        _, pending = await asyncio.wait(tasks, timeout=None if left == math.inf else max(left, 0.0))
        t_stop = time.perf_counter()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for rec, task in zip(recs, tasks):
        if task in pending:
            rec["timed_out"] = True
            rec["elapsed_s"] = t_stop - rec["t_arrival"]
    return summarize(recs, rate, t0, not_sent=len(work) - len(recs))


def extrapolate(r: dict) -> None:
    """A request cut off by the rate's deadline after its first token: its final latency estimated from its own
    pace so far, (last chunk - first chunk) / (chunks - 1) per token (chunks <= tokens: a chunk carries one or
    more tokens, so the estimate errs high; with one chunk, the time since it). Without a first token it stays
    unestimated (a certain failure)."""
    k, left = r["chunks"], r["max_tokens"] - r["chunks"]
    if "ttft_s" not in r:
        return
    pace = (r["last_chunk_s"] - r["ttft_s"]) / (k - 1) if k > 1 else r["elapsed_s"] - r["ttft_s"]
    e2e = r["elapsed_s"] + max(left, 0) * pace
    r.update(est_e2e_s=e2e, est_normalized_s=e2e / r["max_tokens"], est_tpot_s=pace)


def ttft_growth(recs: list[dict]) -> float | None:
    """Mean wait for a first token of the last third of arrivals over the first third's (None: under 6 requests
    started or cut off). Requests that failed are left out; one cut off before its first token waited at least
    its elapsed time."""
    waits = sorted((r["t_arrival"], r["ttft_s"] if "ttft_s" in r else r["elapsed_s"]) for r in recs
                   if "ttft_s" in r or r.get("timed_out"))
    k = len(waits) // 3
    if k < 2:
        return None
    early = sum(w for _, w in waits[:k]) / k
    return sum(w for _, w in waits[-k:]) / k / early if early > 0 else None


def summarize(recs: list[dict], rate: float, t0: float, not_sent: int = 0) -> dict:
    ok = [r for r in recs if r["ok"]]
    late = [r for r in recs if r.get("timed_out")]
    for r in late:
        extrapolate(r)
    est = [r for r in late if "est_e2e_s" in r]
    failed = [r for r in recs if not r["ok"] and not r.get("timed_out")]
    span = (max(r["finished_at"] for r in ok) - t0) if ok else None
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {"rate": rate, "requests": len(recs), "completed": len(ok), "errors": len(failed),
            "timed_out": len(late), "extrapolated": len(est), "timed_out_before_first_token": len(late) - len(est),
            "not_sent": not_sent, "first_errors": [r["error"] for r in failed][:5],
            "seconds": span, "achieved_req_s": len(ok) / span if span else None,
            "output_tok_s": out_tokens / span if span else None, "output_tokens": out_tokens,
            # what the rate asks for: its arrivals times their mean output length
            "offered_output_tok_s": rate * sum(r["max_tokens"] for r in recs) / len(recs) if recs else None,
            "ttft_growth": ttft_growth(recs),
            # completed requests exactly, plus the timed-out ones that had started, estimated (see extrapolate)
            "normalized_latency_s": _stats([r["normalized_s"] for r in ok] + [r["est_normalized_s"] for r in est]),
            "ttft_s": _stats([r["ttft_s"] for r in ok + est]),
            "tpot_s": _stats([r["tpot_s"] for r in ok] + [r["est_tpot_s"] for r in est]),
            "e2e_s": _stats([r["e2e_s"] for r in ok] + [r["est_e2e_s"] for r in est]),
            "normalized_latency_completed_only_s": _stats([r["normalized_s"] for r in ok]),
            # a request with no token by the deadline: its normalized latency is at least elapsed / output tokens
            "unstarted_normalized_lower_bound_s": _stats([r["elapsed_s"] / r["max_tokens"] for r in late
                                                          if "est_e2e_s" not in r])}


def meets_slo(r: dict) -> bool:
    """Every request sent and answered without error, each one started (a first token) by the rate's deadline,
    and the mean normalized latency (exact, or estimated for requests cut off mid-stream) within the bound."""
    nl = r["normalized_latency_s"]["mean"]
    return not (r["errors"] or r["timed_out_before_first_token"] or r["not_sent"] or nl is None or nl > SLO_S)


def wait_idle(url: str, timeout: float = 120.0) -> bool:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            h = httpx.get(f"{url}/health", timeout=10).json()
            if h.get("running", 0) == 0 and h.get("queue_depth", 0) == 0:
                return True
        except Exception:   # noqa: BLE001
            pass
        time.sleep(0.2)
    return False


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap, shape=None)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--url", default=None, help="drive an already running server instead of starting one")
    where.add_argument("--server-process", dest="server_process", action="store_true", default=None,
                       help="start the server in a process of its own (default with --shape)")
    where.add_argument("--in-process", dest="server_process", action="store_false",
                       help="serve from a thread of this process (default without --shape)")
    ap.add_argument("--rates", type=_floats, default=_floats("1,2,4,8,16"), help="requests/s, comma-separated")
    ap.add_argument("--num-requests", type=int, default=200, help="at most this many requests per rate")
    ap.add_argument("--duration-per-rate", "--duration", dest="duration", type=float, default=None,
                    help="at most about this many seconds of arrivals per rate (fewer requests at low rates)")
    ap.add_argument("--rate-timeout", type=float, default=None,
                    help="stop a rate this many seconds after it starts; open requests count as timed out")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the whole run from start; later rates are shortened or skipped to fit")
    ap.add_argument("--server-start-timeout", type=float, default=300.0)
    ap.add_argument("--workload", default="sharegpt", help="sharegpt (log-normal lengths) or INxOUT, e.g. 512x128")
    ap.add_argument("--max-output-tokens", type=int, default=None, help="clip each request's output length")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="serving")
    ap.add_argument("--out-dir", "--out", dest="out_dir", default=None,
                    help="results folder (default: bench/results)")
    args = ap.parse_args(argv)
    if args.server_process is None:
        args.server_process = args.shape is not None and not args.url
    return args


class Run:
    """One benchmark run: the server (started or given), the rates measured so far, the time budget."""

    def __init__(self, args):
        self.args, self.t_start = args, time.perf_counter()
        self.srv = self.thread = None
        self.results, self.skipped, self.note, self.current = [], [], None, None
        self.model, self.info = None, {}

    def remaining(self) -> float:
        a = self.args
        return math.inf if a.time_budget is None else a.time_budget - (time.perf_counter() - self.t_start)

    def start_server(self) -> None:
        a = self.args
        if a.url:
            import httpx
            self.url = a.url.rstrip("/")
            card = httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]
            self.model, self.max_len, self.vocab = card["id"], card["max_model_len"], 256
            if a.shape:
                from nfjax.models.random_init import SHAPES
                self.vocab = SHAPES[a.shape].vocab_size
            self.info = {"external_server": self.url}
        elif a.server_process:
            self.srv = ServerProcess(a)          # set before waiting: an interrupted start still stops it
            self.srv.wait_ready(min(a.server_start_timeout, self.remaining()))
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # this process's JAX: results only
            i = self.srv.info
            self.url, self.model, self.vocab, self.max_len = i["url"], i["model"], i["vocab_size"], i["max_model_len"]
            self.info = {"server_process": True, "server_startup_s": i["startup_s"], **i["engine"]}
        else:
            from nfjax.config import ServerConfig
            from nfjax.server import ServerThread
            engine, self.model = served_engine(a)
            self.vocab, self.max_len = engine.model_config.vocab_size, engine.max_model_len
            self.info = {"server_process": False, **engine_info(engine)}
            cfg = ServerConfig(port=0, max_queue=1 << 20, log_level="warning")
            self.thread = ServerThread(engine, cfg, self.model).start()
            self.url = self.thread.url
        self.info["startup_s"] = time.perf_counter() - self.t_start
        print(f"server ready at {self.url} after {self.info['startup_s']:.1f}s", flush=True)

    def run_rates(self) -> None:
        a = self.args
        warm = make_workload(a.workload, 4, self.vocab, self.max_len, seed=a.seed + 999)
        asyncio.run(run_rate(self.url, self.model, [(ids, min(lout, 8)) for ids, lout in warm], 100.0,
                             a.temperature, a.seed, a.timeout, rate_timeout=min(120.0, self.remaining())))
        wait_idle(self.url, min(60.0, max(self.remaining(), 1.0)))
        for i, rate in enumerate(a.rates):
            budget = self.remaining() - 15.0          # keep time to stop the server and write the results
            if self.srv is not None and not self.srv.alive():
                self.note = f"server process exited with {self.srv.proc.returncode}"
            elif budget < 10.0:
                self.note = "time budget spent"
            if self.note:
                self.skipped += list(a.rates[i:])
                return
            n = a.num_requests if not a.duration else max(1, min(a.num_requests, math.ceil(rate * a.duration)))
            rt = min(a.rate_timeout or math.inf, budget)
            rt = None if rt == math.inf else rt
            work = make_workload(a.workload, n, self.vocab, self.max_len, seed=a.seed + i,
                                 max_output=a.max_output_tokens)
            self.current = (rate, [], time.perf_counter(), len(work))
            res = asyncio.run(run_rate(self.url, self.model, work, rate, a.temperature, a.seed + i, a.timeout,
                                       rate_timeout=rt, recs=self.current[1]))
            self.current = None
            res["rate_timeout_s"] = rt
            self.results.append(res)
            nl = res["normalized_latency_s"]
            print(f"rate {rate:g}/s: {res['completed']}/{res['requests']} ok ({res['timed_out']} timed out, "
                  f"{res['extrapolated']} of them estimated, {res['errors']} errors), normalized latency mean "
                  f"{_ms(nl['mean'])} ms p99 {_ms(nl['p99'])} ms [{time.perf_counter() - self.t_start:.0f}s]",
                  flush=True)
            wait_idle(self.url, min(60.0, max(self.remaining() - 15.0, 1.0)))

    def interrupted(self, e: BaseException) -> None:
        """Keep what the rate in progress measured: its open requests count as timed out."""
        self.note = f"stopped early: {e!r}"
        print(self.note, flush=True)
        if self.current and self.current[1]:
            rate, recs, t0, n = self.current
            now = time.perf_counter()
            for r in recs:
                if not r["ok"] and "error" not in r:
                    r.update(timed_out=True, elapsed_s=now - r["t_arrival"])
            self.results.append({**summarize(recs, rate, t0, not_sent=n - len(recs)), "interrupted": True})
        self.skipped += [r for r in self.args.rates if r not in {x["rate"] for x in self.results}]

    def stop_server(self) -> None:
        if self.thread is not None:
            self.thread.stop()
        if self.srv is not None:
            self.info["server_exit_code"] = self.srv.stop()


def main(argv=None) -> None:
    args = parse_args(argv)
    run = Run(args)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_on_sigterm)
    exit_code = 0
    try:
        run.start_server()
        run.run_rates()
    except BaseException as e:     # noqa: BLE001 - SIGTERM, Ctrl-C, a failure: stop the server, keep the numbers
        exit_code = e.code if isinstance(e, SystemExit) else 1
        if isinstance(e, Exception):
            traceback.print_exc()
        run.interrupted(e)
    finally:
        run.stop_server()
    report(args, run.results, run.model, run.info, run.skipped, bool(run.skipped) or exit_code != 0, run.note,
           time.perf_counter() - run.t_start)
    if exit_code:
        sys.exit(exit_code)


def report(args, results, model, info, skipped, partial, note, wall_s) -> None:
    from bench.common import print_table, save_plot, write_results
    rows = []
    for r in results:
        nl, tt, tp = r["normalized_latency_s"], r["ttft_s"], r["tpot_s"]
        rows.append([r["rate"], f"{r['completed']}/{r['requests']}", f"{r['extrapolated']}/{r['timed_out']}",
                     r["achieved_req_s"], r.get("offered_output_tok_s"),
                     r["output_tok_s"], r.get("ttft_growth"), _ms(nl["mean"]), _ms(nl["p99"]), _ms(tt["mean"]),
                     _ms(tt["p99"]), _ms(tp["mean"]), _ms(tp["p99"])])
    print_table(["rate/s", "ok", "est/late", "got req/s", "asked tok/s", "out tok/s", "TTFT growth", "norm ms",
                 "norm p99", "TTFT ms", "TTFT p99", "TPOT ms", "TPOT p99"], rows,
                title=f"serving: {model}, workload {args.workload}")
    under = []          # rates, lowest first, up to the first one that misses the bound (or has errors)
    for r in sorted(results, key=lambda r: r["rate"]):
        if not meets_slo(r):
            break
        under.append(r["rate"])
    light = min(results, key=lambda r: r["rate"]) if results else None
    delivered = max((r["output_tok_s"] or 0) for r in results) if results else None
    # Past saturation the queue grows for as long as arrivals last, so a rate's latency says how many requests
    # were sent (--num-requests, the window), not how the server holds up: the headline stops below the first
    # such rate (`steady`).
    grew = sorted(r["rate"] for r in results if (r.get("ttft_growth") or 0) >= SATURATED_GROWTH)
    steady = [x for x in under if not grew or x < grew[0]]
    asks = sorted(r["rate"] for r in results if (r.get("offered_output_tok_s") or 0) > (delivered or 0) > 0)
    if grew:
        print(f"rates from {grew[0]}/s grew a queue (late arrivals waited >= {SATURATED_GROWTH:g}x as long for a "
              f"first token as early ones): their latency is bounded by the request cap, not steady state",
              flush=True)
    if asks:
        print(f"rates from {asks[0]}/s ask for more output than any rate delivered ({delivered:,.0f} tok/s)",
              flush=True)
    summary = {
        "max_rate_under_200ms_normalized_latency": max(steady) if steady else 0.0,
        "max_rate_under_200ms_including_saturated": max(under) if under else 0.0,
        "tpot_ms_light_load": _ms(light["tpot_s"]["mean"]) if light else None,
        "ttft_ms_light_load": _ms(light["ttft_s"]["mean"]) if light else None,
        "normalized_latency_ms_light_load": _ms(light["normalized_latency_s"]["mean"]) if light else None,
        "max_output_tok_s": delivered,
        "max_achieved_req_s": max((r["achieved_req_s"] or 0) for r in results) if results else None,
        "first_rate_past_saturation": grew[0] if grew else None,
        "first_rate_asking_more_than_delivered": asks[0] if asks else None,
        "rates_tested": len(results), "extrapolated_requests": sum(r["extrapolated"] for r in results),
        "partial": partial,
    }
    path = write_results(args.name, summary, {
        "args": vars(args), "model": model, "workload": args.workload, "slo_normalized_latency_s": SLO_S,
        "wall_s": wall_s, "skipped_rates": skipped, "note": note, "engine": info, "results": results},
        out_dir=args.out_dir)
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
