"""Probe (#27): where do the slow tokens of a lone stream come from? `bench.latency`'s batch-1 stream showed
p99 inter-token gaps of 20-27 ms against a 6.3 ms p50 in 3 of 5 runs, in clusters of ~5 consecutive tokens.

One request at a time through `Engine.stream` (as bench.latency), `--repeats` times per mode. For every token
gap it keeps the step record of the step that produced the token (host ms, dispatch, blocked on read) and every
Python garbage collection that ran inside the gap (generation, ms, from `gc.callbacks`). Modes:
- plain: as the engine runs today;
- frozen: after `gc.collect(); gc.freeze()` (what `nfjax serve` does once its engine is built);
- addresses: every step program's call wrapped to record its enqueue time and the device addresses of its array
  arguments (the weights excepted) and outputs. The guess it tests (bench/NOTES.md 24.4): XLA updates a command
  buffer whose buffers moved, so a step whose activations landed at new addresses pays every program's update.
  Each stream then reports, for its slowest-dispatch steps and for the rest, how many programs saw an address
  change since the step before (reading an address may wait for the buffer: its time is recorded apart);
- threads: every step's launch (`Runner.launch`) wrapped to record the engine thread's own rusage over it (user
  and system CPU, page faults, context switches, run-queue wait from /proc's schedstat) and, since the launch
  before, the CPU time of every other thread of the process (by its name), and the hypervisor's steal time (all
  vCPUs, and the one the thread ran on). The question (NOTES 25.1): is the engine thread's slow, CPU-busy launch
  slowed by itself (faults, system time), beside a busy thread, or by a vCPU taken away?
The largest gaps of each repeat are printed with their steps and collections; all gaps go to the JSON.

usage: python -m bench.probes.itl_spikes --shape llama3-8b [--repeats 4] [--out DIR]
CPU:   python -m bench.probes.itl_spikes --shape smoke --prompt-len 16 --output-len 32 --repeats 2
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import threading
import time

from bench.common import GcLog
from bench.setup import add_bench_args


def one_stream(engine, ids: list[int], n: int, log: GcLog) -> dict:
    from nfjax.engine import SamplingParams
    trace = engine.trace.steps
    times, steps = [time.perf_counter()], []
    for out in engine.stream(ids, SamplingParams.greedy(max_tokens=n, ignore_eos=True)):
        if out.new_token_ids:
            times.append(time.perf_counter())
            s = trace[-1] if trace else None
            steps.append(None if s is None else {"bucket": s.bucket, "host_ms": s.host_ms, "wait_ms": s.wait_ms,
                                                  "put_ms": s.put_ms, "dispatch_ms": s.dispatch_ms,
                                                  "step_ms": s.seconds * 1e3})
    gaps = []
    for i in range(2, len(times)):                      # gap i: token i-1 -> token i (the first is TTFT)
        gaps.append({"token": i - 1, "ms": (times[i] - times[i - 1]) * 1e3, "step": steps[i - 1],
                     "gc": log.within(times[i - 1], times[i])})
    ms = sorted(g["ms"] for g in gaps)
    return {"ttft_ms": (times[1] - times[0]) * 1e3, "p50": ms[len(ms) // 2], "p99": ms[min(len(ms) - 1,
            int(0.99 * (len(ms) - 1) + 0.5))], "max": ms[-1], "gc_in_stream": log.within(times[0], times[-1]),
            "gaps": gaps}


def _addresses(tree) -> tuple:
    import jax
    out = []
    for a in jax.tree.leaves(tree):
        if isinstance(a, jax.Array):
            out.append(a.addressable_shards[0].data.unsafe_buffer_pointer())
    return tuple(out)


class AddressLog:
    """Wraps a Runner's step programs (embed, layer groups, heads): per call the program's name, its enqueue
    seconds, and the addresses of its arguments after the first (the weights) and of its outputs."""

    def __init__(self, runner):
        self.calls: list[tuple] = []          # (name, enqueue_s, address_read_s, addresses)
        for table in ("_embed", "_steps", "_decode_steps", "_head", "_full_head"):
            progs = getattr(runner, table)
            for key, fn in list(progs.items()):
                progs[key] = self._wrap(f"{table[1:]}{key}", fn)

    def _wrap(self, name, fn):
        def call(*args):
            t = time.perf_counter()
            ins = _addresses(args[1:])             # before the call: donated arguments are deleted by it
            t0 = time.perf_counter()
            out = fn(*args)
            t1 = time.perf_counter()
            addrs = ins + _addresses(out)
            self.calls.append((name, t1 - t0, (t0 - t) + time.perf_counter() - t1, addrs))
            return out
        return call

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


def address_changes(calls: list[tuple]) -> dict:
    """Steps split at the embed calls; per step, the programs whose addresses differ from the same program's in the
    step before; the slowest fifth of steps by their programs' enqueue time against the rest."""
    steps, cur = [], []
    for c in calls:
        if c[0].startswith("embed") and cur:
            steps.append(cur)
            cur = []
        cur.append(c)
    if cur:
        steps.append(cur)
    last: dict[str, tuple] = {}
    rows = []
    for st in steps:
        moved = [name for name, _, _, a in st if name in last and last[name] != a]
        for name, _, _, a in st:
            last[name] = a
        rows.append({"programs": len(st), "changed": len(moved), "moved": moved,
                     "enqueue_ms": sum(c[1] for c in st) * 1e3,
                     "address_read_ms": sum(c[2] for c in st) * 1e3})
    order = sorted(range(len(rows)), key=lambda i: -rows[i]["enqueue_ms"])
    slow, rest = order[:max(1, len(rows) // 5)], order[max(1, len(rows) // 5):]

    def mean(ix, key):
        return statistics.mean(rows[i][key] for i in ix) if ix else 0.0
    return {"steps": rows, "slow_changed_mean": mean(slow, "changed"), "rest_changed_mean": mean(rest, "changed"),
            "slow_enqueue_ms_mean": mean(slow, "enqueue_ms"), "rest_enqueue_ms_mean": mean(rest, "enqueue_ms")}


def _schedstat(tid) -> tuple[int, int]:
    """(ns on a CPU, ns waiting on a run queue) of one thread of this process; (0, 0) once it has exited."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            run, wait, _ = f.read().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return 0, 0


_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def _steal_ms() -> tuple[float, dict[str, float]]:
    """CPU time the hypervisor took from this machine's vCPUs (/proc/stat's steal column), ms: all CPUs, and by CPU
    ("cpu3": ms). A guest counts a descheduled vCPU's time as its running thread's CPU time, so a thread slowed this
    way looks busy (the slow launches of 25.1). 10 ms ticks."""
    total, per = 0.0, {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                parts = line.split()
                ms = int(parts[8]) * _TICK_MS if len(parts) > 8 else 0.0
                if parts[0] == "cpu":
                    total = ms
                else:
                    per[parts[0]] = ms
    except (OSError, ValueError):
        pass
    return total, per


def _cpu_of(tid) -> str:
    """The CPU a thread last ran on ("cpu3"), from its /proc stat (field 39)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return "cpu" + f.read().rsplit(")", 1)[1].split()[36]
    except (OSError, IndexError):
        return "?"


def _thread_name(tid) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class ThreadLog:
    """Wraps `runner.launch`: per launch its wall ms, the calling thread's rusage deltas over it, and every other
    thread's CPU ns since the launch before (named: `_name`)."""

    def __init__(self, runner):
        import resource
        self._ru, self._who = resource.getrusage, resource.RUSAGE_THREAD
        self.rows: list[dict] = []
        self._names: dict[str, str] = {}
        self._last: dict[str, int] = self._others()
        fn = runner.launch

        def launch(batch):
            me = threading.get_native_id()
            st0 = _steal_ms()
            r0, s0, t0 = self._ru(self._who), _schedstat(me), time.perf_counter()
            out = fn(batch)
            t1, r1, s1 = time.perf_counter(), self._ru(self._who), _schedstat(me)
            st1, cpu = _steal_ms(), _cpu_of(me)
            now = self._others()
            busy = {tid: ns - self._last.get(tid, 0) for tid, ns in now.items()}
            self._last = now
            top = sorted(((ns, tid) for tid, ns in busy.items()), reverse=True)[:4]
            self.rows.append({"ms": (t1 - t0) * 1e3, "user_ms": (r1.ru_utime - r0.ru_utime) * 1e3,
                              "sys_ms": (r1.ru_stime - r0.ru_stime) * 1e3, "minflt": r1.ru_minflt - r0.ru_minflt,
                              "majflt": r1.ru_majflt - r0.ru_majflt, "nvcsw": r1.ru_nvcsw - r0.ru_nvcsw,
                              "nivcsw": r1.ru_nivcsw - r0.ru_nivcsw, "runq_ms": (s1[1] - s0[1]) / 1e6,
                              "others_cpu_ms": sum(busy.values()) / 1e6, "steal_ms": st1[0] - st0[0],
                              "steal_own_cpu_ms": st1[1].get(cpu, 0.0) - st0[1].get(cpu, 0.0),
                              "top_others": [(self._name(tid), ns / 1e6) for ns, tid in top]})
            return out
        runner.launch = launch

    def _others(self) -> dict[str, int]:
        me = str(threading.get_native_id())
        return {tid: _schedstat(tid)[0] for tid in os.listdir("/proc/self/task") if tid != me}

    def _name(self, tid: str) -> str:
        """A Python thread's name where the thread is Python's, else the OS's (comm: XLA's and CUDA's threads)."""
        if tid not in self._names:
            py = {str(t.native_id): t.name for t in threading.enumerate()}
            self._names[tid] = py.get(tid) or _thread_name(tid)
        return self._names[tid]

    def take(self) -> list[dict]:
        rows, self.rows = self.rows, []
        return rows


def thread_summary(rows: list[dict]) -> dict:
    """The slowest fifth of launches against the rest: mean of each rusage field, and the other threads busiest
    in the slow launches' step cycles (summed ms by name)."""
    order = sorted(range(len(rows)), key=lambda i: -rows[i]["ms"])
    k = max(1, len(rows) // 5)
    slow, rest = order[:k], order[k:]
    keys = ("ms", "user_ms", "sys_ms", "minflt", "majflt", "nvcsw", "nivcsw", "runq_ms", "others_cpu_ms",
            "steal_ms", "steal_own_cpu_ms")

    def means(ix):
        return {key: statistics.mean(rows[i][key] for i in ix) if ix else 0.0 for key in keys}
    busiest: dict[str, float] = {}
    for i in slow:
        for name, ms in rows[i]["top_others"]:
            busiest[name] = busiest.get(name, 0.0) + ms
    return {"rows": rows, "slow": means(slow), "rest": means(rest),
            "slow_busiest_others": sorted(busiest.items(), key=lambda x: -x[1])[:8]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_bench_args(p)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--modes", default="plain,frozen")
    p.add_argument("--batch-before", type=int, default=64,
                   help="a batch of this many requests generated before the streams (bench.latency runs batches 1 "
                        "and 64 first)")
    p.add_argument("--out", default=None, help="folder of the JSON (default: print only)")
    args = p.parse_args(argv)
    from bench.common import device_name
    from bench.setup import bench_engine, model_config
    from bench.workloads import fixed
    cfg = model_config(args)
    t = time.perf_counter()
    engine = bench_engine(args, context=args.prompt_len + args.output_len)
    print(f"[engine built in {time.perf_counter() - t:.1f} s]", flush=True)
    warm = fixed(8, args.prompt_len, 4, cfg.vocab_size, seed=7)
    from nfjax.engine import SamplingParams
    engine.generate([q for q, _ in warm], SamplingParams.greedy(max_tokens=4))
    if args.batch_before:
        work = fixed(args.batch_before, args.prompt_len, args.output_len, cfg.vocab_size, seed=1064)
        engine.generate([q for q, _ in work], SamplingParams.greedy(max_tokens=args.output_len, ignore_eos=True))
    log = GcLog()
    gc.callbacks.append(log)
    res = {"device": device_name(), "args": vars(args), "modes": {}}
    addr = threads = None
    for mode in args.modes.split(","):
        if mode == "frozen":
            gc.collect()
            gc.freeze()
        if mode == "addresses" and addr is None:
            addr = AddressLog(engine.runner)
        if mode == "threads" and threads is None:
            threads = ThreadLog(engine.runner)
        runs = []
        for r in range(args.repeats):
            ids = fixed(1, args.prompt_len, args.output_len, cfg.vocab_size, seed=3000 + r)[0][0]
            for log_ in (addr, threads):
                if log_ is not None:
                    log_.take()
            runs.append(one_stream(engine, ids, args.output_len, log))
            x = runs[-1]
            if addr is not None:
                x["addresses"] = address_changes(addr.take())
                a = x["addresses"]
                print(f"[{mode} {r}] programs with moved buffers a step: slowest fifth {a['slow_changed_mean']:.2f} "
                      f"(enqueue {a['slow_enqueue_ms_mean']:.2f} ms), the rest {a['rest_changed_mean']:.2f} "
                      f"({a['rest_enqueue_ms_mean']:.2f} ms)", flush=True)
            if threads is not None:
                x["threads"] = t = thread_summary(threads.take())
                for part in ("slow", "rest"):
                    m = t[part]
                    print(f"[{mode} {r}] {part} launches: {m['ms']:.2f} ms (user {m['user_ms']:.2f}, sys "
                          f"{m['sys_ms']:.2f}, run queue {m['runq_ms']:.2f}), faults {m['minflt']:.0f}, switches "
                          f"{m['nvcsw']:.1f}/{m['nivcsw']:.1f}; other threads {m['others_cpu_ms']:.1f} ms; stolen "
                          f"{m['steal_own_cpu_ms']:.2f} ms on its CPU, {m['steal_ms']:.2f} on all", flush=True)
                print(f"[{mode} {r}] busiest beside the slow ones: "
                      f"{[(n, round(ms, 1)) for n, ms in t['slow_busiest_others'][:5]]}", flush=True)
            gcs = x["gc_in_stream"]
            print(f"[{mode} {r}] p50 {x['p50']:.2f} p99 {x['p99']:.2f} max {x['max']:.2f} ms; "
                  f"{len(gcs)} collections in the stream ({sum(g['ms'] for g in gcs):.1f} ms, gen2: "
                  f"{sum(1 for g in gcs if g['gen'] == 2)})", flush=True)
            for g in sorted(x["gaps"], key=lambda g: -g["ms"])[:4]:
                s = g["step"] or {}
                print(f"    token {g['token']}: {g['ms']:.1f} ms; step {s.get('step_ms', 0):.1f} ms, host "
                      f"{s.get('host_ms', 0):.1f} (dispatch {s.get('dispatch_ms', 0):.1f}), blocked on read "
                      f"{s.get('wait_ms', 0):.1f}; gc {[(c['gen'], round(c['ms'], 1)) for c in g['gc']]}",
                      flush=True)
        res["modes"][mode] = {"p50_ms": statistics.median(x["p50"] for x in runs),
                              "p99_over_p50": [x["p99"] / x["p50"] for x in runs], "runs": runs}
    gc.callbacks.remove(log)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "itl_spikes.json")
        with open(path, "w") as f:
            json.dump(res, f)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
