"""A stream of text deltas that ends with a result: how a request hands back its answer.

A decode is naturally a generator that yields text as tokens commit and *returns* its
result (``Generator[str, None, R]``: the engine's
:meth:`~agentspec.engine.SpeculativeDecoder.stream` returns its
:class:`~agentspec.engine.Generation`, a chat turn its
:class:`~agentspec.chat.api.ChatResult`). Code that composes such generators reads the
result with ``result = yield from ...``; a caller that only iterates cannot see a
generator's return value, so :class:`ResultStream` wraps one and keeps it: iterate it for
the deltas, then read :attr:`ResultStream.result`. No caller passes a list in for the
result to be appended to.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from types import TracebackType
from typing import Generic, TypeVar, cast

from agentspec.errors import RequestStateError

__all__ = ["ResultStream"]

R = TypeVar("R")


class ResultStream(Generic[R]):
    """Text deltas of one request, then its result.

    Iterating yields the deltas; once the iteration ended, :attr:`result` holds what the
    generator returned. :meth:`close` stops the request early (the generator's ``finally``
    blocks run: a runtime releases its lock, stores nothing); it must be called on the
    thread that iterates, since a runtime's lock belongs to that thread. The stream is
    also a context manager that closes it.

    Args:
        steps: The request's generator: yields text deltas, returns the result.
    """

    def __init__(self, steps: Generator[str, None, R]) -> None:
        self._steps = steps
        self._finished = False
        self._stopped = False  # closed or failed before its end: it never has a result
        self._result: R | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._finished or self._stopped:
            raise StopIteration
        try:
            return next(self._steps)
        except StopIteration as done:
            self._finished = True
            self._result = done.value
            raise StopIteration from None
        except BaseException:
            self._stopped = True
            raise

    @property
    def finished(self) -> bool:
        """True once the request ran to its end (:attr:`result` is set)."""
        return self._finished

    @property
    def result(self) -> R:
        """What the request returned.

        Raises:
            RequestStateError: the stream has not been iterated to its end (it is still
                running, or was closed or failed before finishing).
        """
        if not self._finished:
            raise RequestStateError("the stream has no result yet: iterate it to the end "
                                    "before reading .result (a closed or failed stream "
                                    "never has one)")
        return cast(R, self._result)  # set together with _finished

    def drain(self) -> R:
        """Run the request to its end, discarding the deltas, and return its result."""
        for _ in self:
            pass
        return self.result

    def close(self) -> None:
        """Stop the request now if it is still running (no effect once finished)."""
        if not self._finished:
            self._stopped = True
        self._steps.close()

    def __enter__(self) -> ResultStream[R]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
