"""The outermost ASGI layer: no exception leaves the server as a bare 500 or a dropped reply.

FastAPI's exception handlers cover the errors it knows; anything else (a ``RecursionError``
deep in a library, an illegal response header, a bug) would reach Starlette's
``ServerErrorMiddleware``, which answers plain text and is invisible to ``/metrics``. This
middleware sits outside everything: if the response has not started it answers 500 with
OpenAI's error body and counts it; if it has started (a stream), the connection is ended
and the failure is counted as well, so ``http_errors_total`` sees every server error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from adapters.openai_server.errors import SERVER_ERROR, error_body
from adapters.openai_server.metrics import Metrics

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ErrorGuard:
    """Wrap an ASGI app so every unhandled exception becomes a counted OpenAI error.

    Args:
        app: The wrapped application.
        metrics: Where the 500s are counted.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            await send(message)
            if message["type"] == "http.response.start":
                started = True  # after send: a start refused by the server sent nothing

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            log.exception("unhandled error serving %s %s", scope.get("method"),
                          scope.get("path"))
            self.metrics.error(500)
            if started:
                return  # the status line is out: ending the response is all that is left
            body = json.dumps(error_body("Internal server error.", SERVER_ERROR)).encode()
            await send({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]})
            await send({"type": "http.response.body", "body": body})
