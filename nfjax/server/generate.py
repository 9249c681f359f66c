"""POST /v1/completions and /v1/chat/completions: submit the engine requests, then answer whole or streamed.

A stream carries one choice per chunk, with its `index` (prompt_i * n + j); chat sends each choice's
`{"role": "assistant"}` delta first, completions with `echo` each choice's prompt text first. Each choice ends
with a chunk holding its `finish_reason`; then the usage chunk (with `stream_options.include_usage`) and
`data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from nfjax.server import protocol, responses
from nfjax.server.errors import APIError
from nfjax.server.loop import RequestStream, shutdown_error
from nfjax.server.protocol import GenerateRequest
from nfjax.server.sse import DONE, EventStream, event, wait_for_disconnect


async def _collect(stream: RequestStream, req: GenerateRequest) -> dict:
    """Wait for every engine request's final output (non-streaming): request id -> output."""
    finals: dict = {}
    while len(finals) < len(req.subs):
        for item in await stream.get_batch():
            if isinstance(item, APIError):
                raise item
            if item.finished:
                finals[item.request_id] = item
    return finals


class _Choice:
    """A streamed choice: its index, and the running text offsets of its tokens when logprobs are asked for."""

    def __init__(self, req: GenerateRequest, sub, tokenizer, tt):
        self.index = sub.prompt_index * req.n + sub.candidate
        self.echo = req.echo_texts[sub.prompt_index] if req.echo_texts is not None else ""
        self.offsets = (responses.Offsets(tokenizer, sub.prompt_ids, len(self.echo), sub.params.skip_special_tokens)
                        if tt is not None and req.kind == "completion" else None)


def _logprobs(req: GenerateRequest, ch: _Choice, tt, new_ids: list[int], lps: list) -> dict | None:
    if tt is None:
        return None
    if req.kind == "chat":
        return responses.chat_logprobs(tt, lps, req.logprobs)
    return responses.completion_logprobs(tt, lps, ch.offsets.add(new_ids[:len(lps)]))


async def _sse_events(st, req: GenerateRequest, stream: RequestStream):
    """SSE byte chunks for one HTTP request; aborts its engine requests if the stream stops early."""
    name = st.model_name
    tt = responses.TokenTexts(st.tokenizer) if req.logprobs is not None else None
    choices = {s.request_id: _Choice(req, s, st.tokenizer, tt) for s in req.subs}
    finished = False
    left = len(choices)
    n_out = 0

    def chunk(ch: _Choice, text, reason=None, lps=None, role=False) -> bytes:
        return event(responses.chunk(req, name, ch.index, text, reason, role=role, logprobs=lps))
    try:
        for ch in choices.values():
            if req.kind == "chat":
                yield chunk(ch, None, role=True)
            elif ch.echo:
                yield chunk(ch, ch.echo)
        while not finished:
            items = await stream.get_batch()      # outputs of every step since the last chunk
            groups: dict[str, list] = {}          # per engine request, in order of arrival
            for item in items:
                if isinstance(item, APIError):
                    finished = True        # the server aborted it: no engine abort needed
                    for rid, outs in groups.items():
                        if any(o.new_token_ids for o in outs):
                            yield chunk(choices[rid], "".join(o.new_text for o in outs))
                    yield event(item.body())
                    yield DONE
                    return
                groups.setdefault(item.request_id, []).append(item)
            for rid, outs in groups.items():
                ch = choices[rid]
                delta = "".join(o.new_text for o in outs)
                new_ids = [t for o in outs for t in o.new_token_ids]
                lps = _logprobs(req, ch, tt, new_ids, [lp for o in outs for lp in (o.new_logprobs or ())]) \
                    if tt is not None else None
                final = outs[-1] if outs[-1].finished else None
                # a chunk for every batch of new tokens, even when their text is held back (an incomplete UTF-8
                # character, a possible stop-string prefix, a model without a tokenizer): clients see token timing
                if final is None:
                    if new_ids:
                        yield chunk(ch, delta, lps=lps)
                    continue
                left -= 1
                n_out += len(final.token_ids)
                if req.kind == "chat":
                    if delta or lps:
                        yield chunk(ch, delta, lps=lps)
                    yield chunk(ch, None, final.finish_reason)
                else:
                    yield chunk(ch, delta, final.finish_reason, lps=lps)
            if left == 0:
                finished = True
                if req.include_usage:
                    yield event(responses.usage_chunk(req, name, n_out))
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


async def generate(request: Request, kind: str, read_body, error_response):
    st = request.app.state.nfjax
    arrival = time.perf_counter()
    try:
        if st.draining:
            raise shutdown_error()
        body = protocol.parse_json(await read_body(request))
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
        ok, finals = await _until_disconnect_or(_collect(stream, req), request.receive)
    except APIError as e:
        return error_response(e)
    except BaseException:
        st.loop.abort(req.request_id)
        raise
    if not ok:
        st.loop.abort(req.request_id)
        return Response(status_code=499)     # never sent: the client is gone
    return JSONResponse(responses.full_response(req, st.model_name, finals, st.tokenizer))
