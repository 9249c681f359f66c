"""Server-Sent Events: event framing and an ASGI response that notices a client leaving mid-stream.

Starlette's StreamingResponse (ASGI spec >= 2.4) does not watch for `http.disconnect`, and uvicorn silently
drops writes to a closed connection, so a stream whose client left would keep generating. `EventStream` races
the producer against a disconnect watcher; whichever way the stream ends, the event iterator is closed, so its
`finally` (which aborts the engine request) always runs.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def wait_for_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class EventStream:
    """ASGI response: `text/event-stream` of the byte chunks `events` yields."""

    media_type = "text/event-stream; charset=utf-8"

    def __init__(self, events: AsyncIterator[bytes], status_code: int = 200):
        self.events = events
        self.status_code = status_code

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": [
            (b"content-type", self.media_type.encode()), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if producer in done:
                producer.result()          # re-raise a producer failure
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            for t in (producer, watcher):
                t.cancel()
            for t in (producer, watcher):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await self.events.aclose()

    async def _produce(self, send) -> None:
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
