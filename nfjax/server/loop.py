"""The engine-loop thread: the only thread that touches the `Engine`.

HTTP handlers (on the asyncio event loop) talk to it through a command queue (`submit`, `abort`, `abort_all`,
`stop`); it answers through one asyncio queue per request, filled with one `call_soon_threadsafe` per engine
step. While the engine has work the thread steps it back to back (draining new commands between steps); when
idle it blocks on the command queue. Nothing here ever blocks the event loop.

One HTTP request may be several engine requests (`GenerateRequest.subs`: n choices, best_of candidates, batched
prompts); they are added together (all or none) and aborted together. Items a request's stream receives, in
order: `ADMITTED` (or an `APIError` if the engine refused the request), then the `RequestOutput`s of all its
engine requests (told apart by `request_id`) until each is finished, or an `APIError` when the server aborts it
(shutdown, engine failure). A request aborted by its client (`abort`) gets nothing more.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from typing import Any

from nfjax.engine.outputs import RequestOutput
from nfjax.errors import UserError
from nfjax.server.metrics import ServerMetrics
from nfjax.server.protocol import APIError, GenerateRequest

log = logging.getLogger("nfjax.server")

ADMITTED = "admitted"


def shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down; the request was aborted", type="server_error",
                    code="server_shutting_down")


class RequestStream:
    """One request's output channel (consumed on the event loop)."""

    def __init__(self, req: GenerateRequest, arrival: float):
        self.req = req
        self.request_id = req.request_id
        self.arrival = arrival               # perf_counter() at HTTP arrival
        self._q: asyncio.Queue = asyncio.Queue()
        # engine-thread-side bookkeeping
        self.unfinished: set[str] = set()            # engine request ids not finished yet
        self.last_token_at: dict[str, float] = {}    # engine request id -> time of its last token

    def _put(self, item: Any) -> None:
        self._q.put_nowait(item)

    async def get_batch(self) -> list:
        """Wait for at least one item; return everything available (so slow readers coalesce steps)."""
        items = [await self._q.get()]
        while not self._q.empty():
            items.append(self._q.get_nowait())
        return items

    async def admitted(self) -> None:
        item = await self._q.get()
        if isinstance(item, APIError):
            raise item
        assert item == ADMITTED, item


class EngineLoop:
    def __init__(self, engine, metrics: ServerMetrics, max_queue: int):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.pages_total = engine.pages_total
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}     # engine request id -> stream (engine thread only)
        self._groups: dict[str, RequestStream] = {}      # HTTP request id -> stream with unfinished requests
        self._pending = 0                                 # submitted, not yet added to the engine
        self._pending_lock = threading.Lock()
        # snapshots published by the engine thread after every step (plain attribute reads are atomic)
        self._waiting = 0
        self._running = 0
        self._pages_used = 0
        self._aio: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.steps = 0
        metrics.bind(lambda: self.queue_depth, lambda: self._running, lambda: self._pages_used,
                     lambda: self.pages_total)
        self._prefix: dict = {}
        metrics.bind_prefix(lambda: self._prefix)

    # ---- event-loop side ---------------------------------------------------------------------------------------
    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop
        self._thread = threading.Thread(target=self._run, name="nfjax-engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self.error is None
                and not self._stopping)

    @property
    def queue_depth(self) -> int:
        return self._pending + self._waiting

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def pages_used(self) -> int:
        return self._pages_used

    def submit(self, req: GenerateRequest, arrival: float) -> RequestStream:
        """Queue a validated request. Raises APIError 429 when the queue is full, 503 when not serving."""
        if not self.alive:
            raise APIError(503, "the server is not accepting requests" + (
                " (the engine failed)" if self.error is not None else ""), type="server_error",
                code="unavailable")
        if self.queue_depth >= self.max_queue:
            raise APIError(429, f"the server is overloaded: {self.queue_depth} requests are queued (limit "
                                f"{self.max_queue}); retry later", type="rate_limit_error", code="queue_full")
        stream = RequestStream(req, arrival)
        with self._pending_lock:
            self._pending += 1
        self._cmds.put(("add", stream))
        return stream

    def abort(self, request_id: str) -> None:
        """The client went away: free the pages of every engine request of HTTP request `request_id` (no further
        items are delivered)."""
        self._cmds.put(("abort", request_id))

    def abort_all(self, error: APIError | None = None) -> None:
        """Abort every request in flight; each gets `error` (default: shutting down) as its last item."""
        self._cmds.put(("abort_all", error or shutdown_error()))

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop serving: abort what is left, drain the engine, end the thread."""
        self._stopping = True
        self._cmds.put(("stop", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # ---- engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        out: list[tuple[RequestStream, Any]] = []
        try:
            while True:
                busy = self.engine.has_unfinished()
                stop = self._handle_commands(self._take(block=not busy), out)
                if stop:
                    break
                if self.engine.has_unfinished():
                    self._dispatch(self.engine.step(), out)
                    self.steps += 1
                self._publish(out)
            self._abort_everything(shutdown_error(), out)
            for _ in range(4):           # consume the one step still in flight
                if not self.engine.has_unfinished():
                    break
                self.engine.step()
            self._publish(out)
        except BaseException as e:       # an engine bug: fail every request, keep answering until stopped
            self.error = e
            log.error("engine loop failed:\n%s", traceback.format_exc())
            err = APIError(500, f"internal engine error: {type(e).__name__}: {e}", type="server_error",
                           code="engine_error")
            for s in self._groups.values():
                out.append((s, err))
            self._streams.clear()
            self._groups.clear()
            self._publish(out)
            self._dead_loop(err)

    def _take(self, block: bool) -> list:
        cmds = []
        if block:
            cmds.append(self._cmds.get())
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return cmds

    def _handle_commands(self, cmds: list, out: list) -> bool:
        stop = False
        for kind, arg in cmds:
            if kind == "add":
                self._add(arg, out)
            elif kind == "abort":
                stream = self._groups.get(arg)
                if stream is not None:
                    self._drop(stream, abort=True)
            elif kind == "abort_all":
                self._abort_everything(arg, out)
            elif kind == "stop":
                stop = True
        return stop

    def _add(self, stream: RequestStream, out: list) -> None:
        """Add every engine request of `stream` (all or none)."""
        try:
            if self._stopping:
                out.append((stream, shutdown_error()))
                return
            req = stream.req
            added: list[str] = []
            try:
                for sub in req.subs:
                    self.engine.add_request(sub.prompt_ids, sub.params, request_id=sub.request_id)
                    added.append(sub.request_id)
            except UserError as e:
                for rid in added:
                    self.engine.abort(rid)
                out.append((stream, APIError(400, str(e), "prompt" if "prompt" in str(e) else None)))
                return
            for rid in added:
                self._streams[rid] = stream
            stream.unfinished = set(added)
            self._groups[req.request_id] = stream
            self.metrics.prompt_tokens.inc(req.prompt_tokens)
            out.append((stream, ADMITTED))
        finally:
            with self._pending_lock:
                self._pending -= 1

    def _drop(self, stream: RequestStream, abort: bool) -> None:
        """Forget `stream`; with `abort`, abort its unfinished engine requests."""
        self._groups.pop(stream.request_id, None)
        for rid in stream.unfinished:
            self._streams.pop(rid, None)
            if abort:
                self.engine.abort(rid)
                self.metrics.finished.labels("abort").inc()
        stream.unfinished = set()

    def _abort_everything(self, err: APIError, out: list) -> None:
        for s in list(self._groups.values()):
            self._drop(s, abort=True)
            out.append((s, err))

    def _dispatch(self, outputs: list[RequestOutput], out: list) -> None:
        now = time.perf_counter()
        m = self.metrics
        for o in outputs:
            s = self._streams.get(o.request_id)
            if s is None:
                continue                    # aborted by its client meanwhile
            n = len(o.new_token_ids)
            if n:
                last = s.last_token_at.get(o.request_id)
                if not s.last_token_at:
                    m.ttft.observe(now - s.arrival)
                elif last is not None:
                    for _ in range(n):
                        m.itl.observe((now - last) / n)
                s.last_token_at[o.request_id] = now
                m.add_tokens(n, now)
            if o.finished:
                del self._streams[o.request_id]
                s.unfinished.discard(o.request_id)
                m.finished.labels(o.finish_reason or "stop").inc()
                if not s.unfinished:
                    self._groups.pop(s.request_id, None)
                    m.e2e.observe(now - s.arrival)
            out.append((s, o))

    def _publish(self, out: list) -> None:
        if self.error is None:
            e = self.engine
            self._waiting = e.num_waiting
            self._running = e.num_running
            self._pages_used = e.pages_used
            self._prefix = e.prefix_stats() if hasattr(e, "prefix_stats") else {}
        if out:
            batch = list(out)
            out.clear()
            try:
                self._aio.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:            # the event loop is closed: nobody is listening any more
                pass

    def _dead_loop(self, err: APIError) -> None:
        while True:
            kind, arg = self._cmds.get()
            if kind == "add":
                with self._pending_lock:
                    self._pending -= 1
                try:
                    self._aio.call_soon_threadsafe(_deliver, [(arg, err)])
                except RuntimeError:
                    pass
            elif kind == "stop":
                return


def _deliver(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream._put(item)
