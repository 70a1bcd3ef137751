"""langchain-tests suites: run their ``async def`` tests under pytest-asyncio.

LangChain's own packages set ``asyncio_mode = "auto"``; this project keeps pytest-asyncio in
strict mode, so the inherited coroutine tests are marked here, at collection, instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: Any, name: str, obj: Any) -> None:
    """Mark coroutine tests with ``asyncio`` before pytest-asyncio collects them."""
    if name.startswith("test_") and inspect.iscoroutinefunction(obj):
        marks = getattr(obj, "pytestmark", [])
        if not any(m.name == "asyncio" for m in marks):
            pytest.mark.asyncio(obj)
