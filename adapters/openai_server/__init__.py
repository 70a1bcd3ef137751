"""An OpenAI-compatible HTTP server in front of the agentspec runtime.

``create_app(runtime, config)`` builds the FastAPI app; ``agentspec serve`` runs it with
uvicorn. Sessions come from the ``X-Session-Id`` header (or ``prompt_cache_key``, or
``user``); bearer API keys map to tenants whose caches never mix. Imports FastAPI lazily so
``import adapters.openai_server`` stays cheap for the CLI's bind check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapters.openai_server.auth import KeyRing, load_keys
from adapters.openai_server.config import ServerConfig, check_bind, is_loopback

if TYPE_CHECKING:
    from fastapi import FastAPI

    from agentspec.chat.api import ChatRuntime

__all__ = ["KeyRing", "ServerConfig", "check_bind", "create_app", "is_loopback", "load_keys"]


def create_app(runtime: ChatRuntime, config: ServerConfig | None = None) -> FastAPI:
    """Build the server app (see :func:`adapters.openai_server.app.create_app`)."""
    from adapters.openai_server.app import create_app as _create_app

    return _create_app(runtime, config)
