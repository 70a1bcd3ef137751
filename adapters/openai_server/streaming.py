"""Answering one chat completion: as one JSON body, or as server-sent events.

:class:`Answers` turns the events of a queued :class:`~adapters.openai_server.service.Ticket`
(``delta`` ... ``done``, or ``error`` / ``cancelled``) into the HTTP response, recording the
request in the server's metrics. A client that leaves before its answer exists gets nothing
(499) and its turn is never stored.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from adapters.openai_server import responses
from adapters.openai_server.errors import from_exception
from adapters.openai_server.metrics import Metrics
from adapters.openai_server.schemas import wire
from adapters.openai_server.service import Job, Ticket
from agentspec.chat.formats import ToolFormat

__all__ = ["Answers"]

log = logging.getLogger(__name__)


class _ClientGone(Exception):
    """The generation ended because its client disconnected."""


class Answers:
    """Writes the responses of the model ``model_name``, counting them in ``metrics``."""

    def __init__(self, metrics: Metrics, model_name: str,
                 tool_format: ToolFormat | None = None) -> None:
        self.metrics = metrics
        self.model_name = model_name
        self.tool_format = tool_format  # the model's (streamed text is held from a call on)

    @staticmethod
    async def _first(gen: Ticket) -> tuple[str, Any]:
        """The next event of ``gen``; raises for an error or a departed client."""
        try:
            kind, payload = await gen.next()
        except BaseException:
            gen.cancel()  # the client went away while queued
            raise
        if kind == "cancelled":
            raise _ClientGone
        if kind == "error":
            err = from_exception(payload)
            if err.status >= 500:
                log.error("generation failed", exc_info=payload)
            raise err
        return kind, payload

    async def complete(self, gen: Ticket, job: Job, headers: dict[str, str]) -> Response:
        """The whole answer as one JSON body."""
        metrics = self.metrics
        try:
            kind, payload = await self._first(gen)
            while kind == "delta":
                kind, payload = await self._first(gen)
        except _ClientGone:  # nobody is listening: no answer, and no turn was stored
            metrics.aborted()
            return Response(status_code=499)
        sid = job.session_id
        metrics.finished(payload.stats, responses.finish_reason_of(payload, job.tools_active),
                         time.perf_counter() - gen.submitted)
        body = responses.completion(payload, self.model_name, job.tools_active, sid)
        return JSONResponse(wire(body), headers=headers)

    async def stream(
        self, gen: Ticket, job: Job, include_usage: bool, headers: dict[str, str]
    ) -> Response:
        """The answer as server-sent events (OpenAI's chunk objects, then ``[DONE]``)."""
        metrics = self.metrics
        # Wait for the first event before answering: a bad prompt (too long, bad
        # tool_choice) is then still a proper HTTP 400 rather than an error inside a 200.
        try:
            first = await self._first(gen)
        except _ClientGone:
            metrics.aborted()
            return Response(status_code=499)
        writer = responses.ChunkWriter(self.model_name, job.tools_active, include_usage,
                                       self.tool_format)
        sid = job.session_id

        async def events() -> AsyncIterator[ServerSentEvent]:
            kind, payload = first
            yield writer.start()
            metrics.first_token(time.perf_counter() - gen.submitted)
            finished = False
            try:
                while True:
                    if kind == "delta":
                        event = writer.delta(payload)
                        if event is not None:
                            yield event
                    elif kind == "done":
                        metrics.finished(payload.stats,
                                         responses.finish_reason_of(payload, job.tools_active),
                                         time.perf_counter() - gen.submitted)
                        finished = True
                        for event in writer.finish(payload, sid):
                            yield event
                        return
                    elif kind == "cancelled":
                        return
                    else:  # an error after the response started: report it in-band
                        finished = True
                        err = from_exception(payload)
                        metrics.error(err.status)
                        yield responses.sse(err.body())
                        yield responses.DONE
                        return
                    kind, payload = await gen.next()
            finally:
                gen.cancel()  # no-op after "done"; stops the worker if the client left
                if not finished:
                    metrics.aborted()

        # sse-starlette, set up so the body is byte for byte what the former hand framing sent
        # with StreamingResponse (measured; only the headers "Connection: keep-alive" and
        # "X-Accel-Buffering: no" are new): "\n" line ends, no ping comments (ping=0), and no
        # cutting of open streams at shutdown. By default it cancels them as soon as uvicorn
        # begins to exit (SIGTERM with 3 streams in flight: all 3 cut within 0.3 s, where
        # StreamingResponse drained all 3); an endless grace period leaves that to uvicorn's
        # graceful-shutdown timeout again, so streams in flight are drained, not cut.
        return EventSourceResponse(events(), sep=responses.SEP, ping=0,
                                   shutdown_grace_period=math.inf,
                                   headers={**headers, "Cache-Control": "no-cache"})
