"""The Starlette app: OpenAI-compatible endpoints over one `EngineLoop`.

    POST /v1/completions, POST /v1/chat/completions   (stream: true -> SSE ending in `data: [DONE]`)
    POST /tokenize, /detokenize                       (as vLLM's)
    GET  /v1/models, /v1/models/{name}, /health, /metrics, /version, /openapi.json

Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for bad input (naming the field
in `param`), 404 for a `model` other than the served one ("The model `X` does not exist.", as vLLM) and for
unknown routes, 405 for a wrong method, 408 (and the connection closed) for a body not received within
`request_timeout_s`, 413 for an oversized body, 429 when the queue is full, 503 while
shutting down. A client that disconnects (streaming or not) has its request aborted and its pages freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
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
from nfjax.errors import UserError
from nfjax.server import protocol, schemas
from nfjax.server.errors import APIError, model_not_found
from nfjax.server.generate import generate
from nfjax.server.loop import EngineLoop, shutdown_error
from nfjax.server.metrics import ServerMetrics
from nfjax.server.openapi import openapi_document

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


async def completions(request: Request):
    return await generate(request, "completion", _body_reader, error_response)


async def chat_completions(request: Request):
    return await generate(request, "chat", _body_reader, error_response)


async def _body_reader(request: Request) -> bytes:
    st: ServerState = request.app.state.nfjax
    return await _read_body(request, st.config.max_body_bytes, st.config.request_timeout_s)


async def tokenize(request: Request):
    try:
        body = protocol.parse_json(await _body_reader(request))
        chat = "messages" in body
        st, r, body = _validated(request, body, schemas.TokenizeChatRequest if chat else
                                       schemas.TokenizeCompletionRequest)
        if chat:
            ids = protocol.encode_chat(st.tokenizer, body["messages"], bool(r.add_generation_prompt),
                                       bool(r.add_special_tokens))
        else:
            try:
                ids = st.tokenizer.encode(r.prompt, add_special_tokens=bool(r.add_special_tokens))
            except UserError as e:
                raise protocol.bad("prompt", str(e)) from None
    except APIError as e:
        return error_response(e)
    return JSONResponse(schemas.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=st.max_model_len)
                        .model_dump())


async def detokenize(request: Request):
    try:
        st, r, _ = _validated(request, protocol.parse_json(await _body_reader(request)),
                                    schemas.DetokenizeRequest)
        protocol.vocab_check(r.tokens, st.vocab_size, "tokens")
        try:
            text = st.tokenizer.decode(r.tokens)
        except ValueError as e:         # an id the model has but its tokenizer does not
            raise protocol.bad("tokens", f"'tokens': {e}") from None
    except APIError as e:
        return error_response(e)
    return JSONResponse(schemas.DetokenizeResponse(prompt=text).model_dump())


def _validated(request: Request, body: dict, model: type) -> tuple[ServerState, object, dict]:
    st: ServerState = request.app.state.nfjax
    protocol.check_model(body, st.model_name)
    return st, schemas.validate(model, body), body


def nfjax_version() -> str:
    try:
        return importlib.metadata.version("nfjax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def version(request: Request):
    return JSONResponse(schemas.VersionResponse(version=nfjax_version()).model_dump())


async def openapi(request: Request):
    return JSONResponse(openapi_document(nfjax_version()))


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
        return error_response(model_not_found(name))
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
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ], exception_handlers={HTTPException: _http_error, Exception: _internal_error}, lifespan=lifespan)
    app.state.nfjax = st
    return app
