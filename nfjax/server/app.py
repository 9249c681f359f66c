"""The Starlette app: OpenAI-compatible endpoints over one `EngineLoop`.

    POST /v1/completions, POST /v1/chat/completions   (stream: true -> SSE ending in `data: [DONE]`)
    GET  /v1/models, /v1/models/{name}, /health, /metrics

Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for bad input (naming the field
in `param`), 404/405 for unknown routes, 408 (and the connection closed) for a body not received within
`request_timeout_s`, 413 for an oversized body, 429 when the queue is full, 503 while
shutting down. A client that disconnects (streaming or not) has its request aborted and its pages freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nfjax.config import ServerConfig
from nfjax.server import protocol
from nfjax.server.loop import EngineLoop, RequestStream, shutdown_error
from nfjax.server.metrics import ServerMetrics
from nfjax.server.protocol import APIError, GenerateRequest
from nfjax.server.sse import DONE, EventStream, event, wait_for_disconnect

log = logging.getLogger("nfjax.server")

DEFAULT_MODEL_NAME = "nfjax-tiny"


def model_name_for(path: str | Path | None) -> str:
    """The name /v1/models shows: the checkpoint folder's name, or "nfjax-tiny" for the shipped default."""
    return DEFAULT_MODEL_NAME if path is None else Path(path).resolve().name


@dataclass
class ServerState:
    config: ServerConfig
    model_name: str
    loop: EngineLoop
    metrics: ServerMetrics
    tokenizer: object
    vocab_size: int
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    _drain_timer: asyncio.TimerHandle | None = None

    def begin_drain(self, grace_s: float) -> None:
        """Stop taking requests; let in-flight ones finish for `grace_s`, then abort them (event-loop thread)."""
        if self.draining:
            return
        self.draining = True
        self._drain_timer = asyncio.get_running_loop().call_later(grace_s, self.loop.abort_all, shutdown_error())


def error_response(e: APIError) -> JSONResponse:
    headers = {"retry-after": "1"} if e.status == 429 else {"connection": "close"} if e.status == 408 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


# ---- helpers -------------------------------------------------------------------------------------------------
async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, or 413 past `limit` bytes, or 408 if it is not all received within `timeout_s`."""
    cl = request.headers.get("content-length")
    too_big = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise too_big
    chunks, n = [], 0

    async def read():
        nonlocal n
        async for c in request.stream():
            n += len(c)
            if n > limit:
                raise too_big
            chunks.append(c)
    try:
        async with asyncio.timeout(timeout_s):
            await read()
    except TimeoutError:
        raise APIError(408, f"request body not received within {timeout_s:g} s (got {n} of "
                            f"{cl if cl is not None else 'an unknown number of'} bytes)",
                       code="request_timeout") from None
    return b"".join(chunks)


async def _collect(stream: RequestStream):
    """Wait for the request's final output (non-streaming)."""
    while True:
        for item in await stream.get_batch():
            if isinstance(item, APIError):
                raise item
            if item.finished:
                return item


async def _sse_events(st: ServerState, req: GenerateRequest, stream: RequestStream):
    """SSE byte chunks for one request; aborts it in the engine if the stream stops early."""
    name = st.model_name
    finished = False
    try:
        if req.kind == "chat":
            yield event(protocol.chunk(req, name, None, role=True))
        while not finished:
            items = await stream.get_batch()      # outputs of every step since the last chunk
            text, new_tokens, final = [], 0, None
            for item in items:
                if isinstance(item, APIError):
                    finished = True        # the server aborted it: no engine abort needed
                    if new_tokens:
                        yield event(protocol.chunk(req, name, "".join(text)))
                    yield event(item.body())
                    yield DONE
                    return
                text.append(item.new_text)
                new_tokens += len(item.new_token_ids)
                if item.finished:
                    final = item
            delta = "".join(text)
            # a chunk for every batch of new tokens, even when their text is held back (an incomplete UTF-8
            # character, a possible stop-string prefix, a model without a tokenizer): clients see token timing
            if final is None:
                if new_tokens:
                    yield event(protocol.chunk(req, name, delta))
                continue
            finished = True
            if req.kind == "chat":
                if delta:
                    yield event(protocol.chunk(req, name, delta))
                yield event(protocol.chunk(req, name, None, final.finish_reason))
            else:
                yield event(protocol.chunk(req, name, delta, final.finish_reason))
            if req.include_usage:
                yield event(protocol.usage_chunk(req, name, len(final.token_ids)))
            yield DONE
    finally:
        if not finished:
            st.loop.abort(req.request_id)


async def _until_disconnect_or(coro, receive):
    """Run `coro`; returns (True, result) or (False, None) if the client disconnected first."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return True, task.result()
        return False, None
    finally:
        for t in (task, watcher):
            t.cancel()
        for t in (task, watcher):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


# ---- endpoints ------------------------------------------------------------------------------------------------
async def _generate(request: Request, kind: str):
    st: ServerState = request.app.state.nfjax
    arrival = time.perf_counter()
    try:
        if st.draining:
            raise shutdown_error()
        body = protocol.parse_json(await _read_body(request, st.config.max_body_bytes,
                                                    st.config.request_timeout_s))
        protocol.check_model(body, st.model_name)
        parse = protocol.parse_completion if kind == "completion" else protocol.parse_chat
        req = parse(body, st.tokenizer, st.vocab_size, st.max_model_len)
        stream = st.loop.submit(req, arrival)
    except APIError as e:
        st.metrics.rejected.labels(str(e.status)).inc()
        return error_response(e)
    admitted = False
    try:
        await stream.admitted()
        admitted = True
    except APIError as e:
        st.metrics.rejected.labels(str(e.status)).inc()
        return error_response(e)
    finally:
        if not admitted:               # refused, or this handler was cancelled while waiting
            st.loop.abort(req.request_id)
    if req.stream:
        return EventStream(_sse_events(st, req, stream))
    try:
        ok, final = await _until_disconnect_or(_collect(stream), request.receive)
    except APIError as e:
        return error_response(e)
    except BaseException:
        st.loop.abort(req.request_id)
        raise
    if not ok:
        st.loop.abort(req.request_id)
        return Response(status_code=499)     # never sent: the client is gone
    return JSONResponse(protocol.full_response(req, st.model_name, final.text, final.finish_reason,
                                               len(final.token_ids)))


async def completions(request: Request):
    return await _generate(request, "completion")


async def chat_completions(request: Request):
    return await _generate(request, "chat")


def _model_card(st: ServerState) -> dict:
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "nfjax",
            "max_model_len": st.max_model_len}


async def list_models(request: Request):
    st: ServerState = request.app.state.nfjax
    return JSONResponse({"object": "list", "data": [_model_card(st)]})


async def get_model(request: Request):
    st: ServerState = request.app.state.nfjax
    name = request.path_params["name"]
    if name != st.model_name:
        return error_response(APIError(404, f"model '{name}' does not exist; this server serves "
                                            f"'{st.model_name}'", "model", code="model_not_found"))
    return JSONResponse(_model_card(st))


async def health(request: Request):
    st: ServerState = request.app.state.nfjax
    if st.loop.error is not None:
        return JSONResponse({"status": "error", "detail": f"engine failed: {st.loop.error!r}"}, status_code=503)
    if st.draining or not st.loop.alive:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    return JSONResponse({"status": "ok", "model": st.model_name, "queue_depth": st.loop.queue_depth,
                         "running": st.loop.num_running, "kv_pages_used": st.loop.pages_used,
                         "kv_pages_total": st.loop.pages_total})


async def metrics(request: Request):
    st: ServerState = request.app.state.nfjax
    return Response(st.metrics.render(), media_type=st.metrics.content_type)


async def _http_error(request: Request, exc: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = (f"no route {request.method} {request.url.path}" if exc.status_code == 404 else
           f"method {request.method} is not allowed on {request.url.path}" if exc.status_code == 405 else
           str(exc.detail))
    return JSONResponse(APIError(exc.status_code, msg, code=code).body(), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception):
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(APIError(500, f"internal server error: {type(exc).__name__}", type="server_error").body(),
                        status_code=500)


def create_app(engine, config: ServerConfig | None = None, model_name: str = DEFAULT_MODEL_NAME) -> Starlette:
    """The ASGI app serving `engine`. The engine-loop thread starts and stops with the app's lifespan; from
    then on only that thread may call the engine."""
    config = config or ServerConfig()
    m = ServerMetrics()
    st = ServerState(config=config, model_name=model_name, loop=EngineLoop(engine, m, config.max_queue), metrics=m,
                     tokenizer=engine.tokenizer, vocab_size=engine.model_config.vocab_size,
                     max_model_len=engine.max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        st.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            if st._drain_timer is not None:
                st._drain_timer.cancel()
            await st.loop.stop()

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{name:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={HTTPException: _http_error, Exception: _internal_error}, lifespan=lifespan)
    app.state.nfjax = st
    return app
