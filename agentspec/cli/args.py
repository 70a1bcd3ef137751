"""Argument types shared by every command line (``agentspec`` and its sub-commands, the
server's ``serve``, the workflows' scripts): argparse reports their errors as usage errors."""

from __future__ import annotations

import argparse

__all__ = ["csv_list", "non_negative_int", "positive_int"]


def csv_list(value: str) -> list[str]:
    """A non-empty comma-separated list (blank items dropped)."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def positive_int(value: str) -> int:
    """An integer >= 1."""
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def non_negative_int(value: str) -> int:
    """An integer >= 0 (0 usually switches something off)."""
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n
