"""Carry an agentspec session through vLLM inside the request id.

vLLM hands a ``custom_class`` proposer only token arrays, and its worker may run in another
process (the engine core, a tensor-parallel worker, a Ray actor on another node). The one
per-request value that reaches every worker unchanged is the request id, so the session is
encoded there::

    agentspec|<tenant>|<agent>|<session>|<nonce>

vLLM may wrap it (its OpenAI server prefixes ``chatcmpl-``, the engine appends
``-<8 hex>``); :func:`decode_request_id` finds the marker anywhere in the id. ``|`` cannot
occur in a tenant, agent or session id (see :func:`agentspec.types.check_id`), so the fields
split unambiguously.

Clients of a plain ``vllm serve`` deployment set it as the request's ``request_id`` (body
field) or the ``X-Request-Id`` header (with ``--enable-request-id-headers``).
"""

from __future__ import annotations

import uuid

from agentspec.errors import ConfigError
from agentspec.types import SessionRef

MARKER = "agentspec|"
_SEP = "|"


def encode_request_id(session: SessionRef | None, nonce: str | None = None) -> str:
    """A fresh vLLM request id that carries ``session`` (or marks a one-off request).

    Args:
        session: The request's session; ``None`` for a request without a session.
        nonce: Unique part of the id (default: a random UUID hex).

    Returns:
        ``agentspec|tenant|agent|session|nonce`` or ``agentspec-<nonce>`` without a session.

    Raises:
        ConfigError: ``nonce`` contains ``|``.
    """
    nonce = nonce or uuid.uuid4().hex
    if _SEP in nonce:
        raise ConfigError(f"request id nonce must not contain '|', got {nonce!r}")
    if session is None:
        return f"agentspec-{nonce}"
    return _SEP.join(("agentspec", session.tenant, session.agent, session.session_id, nonce))


def decode_request_id(request_id: str) -> SessionRef | None:
    """The session a (possibly vLLM-wrapped) request id carries, or ``None``.

    Args:
        request_id: The id as the worker sees it.

    Returns:
        The :class:`SessionRef`, or ``None`` when the id carries no (valid) session.
    """
    start = request_id.find(MARKER)
    if start < 0:
        return None
    fields = request_id[start + len(MARKER) :].split(_SEP)
    if len(fields) != 4:
        return None
    tenant, agent, session_id, _ = fields
    try:
        return SessionRef(session_id, tenant=tenant, agent=agent)
    except ValueError:  # ConfigError: a malformed id is treated as session-less
        return None
