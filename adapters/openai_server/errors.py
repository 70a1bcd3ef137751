"""OpenAI-style errors: one exception type, its JSON body, and the mapping from agentspec's.

Every failure the server reports has OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, so the official clients raise their
usual exception classes (``BadRequestError``, ``AuthenticationError``, ...) with a readable
message instead of a generic one.
"""

from __future__ import annotations

from typing import Any

from agentspec.errors import (
    AgentSpecError,
    ConfigError,
    PromptTooLongError,
    SessionTooLargeError,
    StoreBusyError,
    StoreError,
)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
OVERLOADED = "overloaded_error"
RATE_LIMIT = "requests"  # OpenAI's type of a request-rate 429 (with rate_limit_exceeded)
RETRY_AFTER_S = 1  # what a refused client is told to wait: one generation is often done


class APIError(Exception):
    """An error answered to the client with an HTTP status and an OpenAI error body.

    Args:
        status: HTTP status code.
        message: Human-readable message (never contains secrets such as API keys).
        type: OpenAI error type, e.g. ``invalid_request_error``.
        param: The request field at fault, if any.
        code: A machine-readable code, e.g. ``invalid_api_key``.
        headers: Response headers the answer carries (``Retry-After`` on a full queue).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, INVALID_REQUEST, param, code)


def unauthorized(message: str = "Incorrect or missing API key.") -> APIError:
    """A 401 with OpenAI's ``invalid_api_key`` code."""
    return APIError(401, message, INVALID_REQUEST, None, "invalid_api_key")


def model_not_found(model: str, served: list[str]) -> APIError:
    """A 404 for a model this server does not serve (OpenAI's ``model_not_found``)."""
    return APIError(
        404,
        f"The model {model!r} does not exist on this server; it serves {served}.",
        INVALID_REQUEST,
        "model",
        "model_not_found",
    )


def too_large(limit: int) -> APIError:
    """A 413 for a request body over the configured size limit."""
    return APIError(
        413,
        f"Request body exceeds the limit of {limit} bytes (see --max-request-bytes).",
        INVALID_REQUEST,
        None,
        "request_too_large",
    )


def _retry_later() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def overloaded(waiting: int) -> APIError:
    """A 503 when the generation queue is full (clients retry 5xx with backoff)."""
    return APIError(
        503,
        f"The server is overloaded: {waiting} requests are already waiting; retry later.",
        OVERLOADED,
        None,
        "queue_full",
        _retry_later(),
    )


def over_tenant_share(share: int) -> APIError:
    """A 429 for a tenant that already holds its share of the queue (other tenants still
    get in): OpenAI's ``rate_limit_exceeded``, which its clients retry with backoff."""
    return APIError(
        429,
        f"Too many requests waiting: this API key's tenant already has {share} requests "
        "queued (see --max-waiting-per-tenant); retry after one finishes.",
        RATE_LIMIT,
        None,
        "rate_limit_exceeded",
        _retry_later(),
    )


def queue_timeout(waited_s: float, limit_s: float) -> APIError:
    """A 503 for a request that waited longer than ``max_queue_wait_s`` for the model."""
    return APIError(
        503,
        f"The request waited {waited_s:.1f} s for the model, longer than this server's "
        f"limit of {limit_s:g} s (see --max-queue-wait-s); it was not run. Retry later.",
        OVERLOADED,
        None,
        "queue_timeout",
        _retry_later(),
    )


def shutting_down() -> APIError:
    """A 503 for a request that arrives or still waits while the server shuts down."""
    return APIError(503, "The server is shutting down; retry on another instance or later.",
                    OVERLOADED, None, "shutting_down")


def body_timeout(seconds: float) -> APIError:
    """A 408 for a request body that did not arrive in time."""
    return APIError(408, f"The request body did not arrive within {seconds:g} s.",
                    INVALID_REQUEST, None, "request_timeout")


def from_exception(exc: BaseException) -> APIError:
    """Map an exception raised while serving a request to the error the client sees.

    Bad input (agentspec's ``ConfigError``, ``PromptTooLongError``, a session past its size
    limit) is the client's fault: 400 with the runtime's message, which names the field and
    value. A store failure is a 503 naming no file. Anything else is a 500 whose message
    does not leak internals.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), "messages", "context_length_exceeded")
    if isinstance(exc, ConfigError):
        return bad_request(str(exc), _guess_param(str(exc)))
    if isinstance(exc, SessionTooLargeError):
        return bad_request(str(exc), None, "session_too_large")
    if isinstance(exc, StoreBusyError):
        return APIError(503, "The session store is busy; retry later.", OVERLOADED, None, "busy")
    if isinstance(exc, StoreError):  # its message names the store's file: logged, not sent
        return APIError(503, "The session store could not be read or written; retry later.",
                        OVERLOADED, None, "store_unavailable")
    if isinstance(exc, AgentSpecError):
        return APIError(500, f"{type(exc).__name__}: {exc}", SERVER_ERROR)
    return APIError(500, "Internal server error.", SERVER_ERROR)


def _guess_param(message: str) -> str | None:
    # The runtime's ConfigError messages name the field in words; pointing `param` at it
    # lets clients highlight the right input without parsing the message.
    text = message.lower()
    for param in ("tool_choice", "temperature", "top_p", "max_tokens", "seed", "stop"):
        if param in text:
            return param
    if "tool" in text:
        return "tools"
    if "message" in text or "role" in text or "content" in text:
        return "messages"
    if "verifier" in text or "sampling" in text:
        return "temperature"
    return None
