"""The ``agentspec`` console script and its sub-commands.

* :mod:`~agentspec.cli.console` — the parser and ``main`` (the one composition root: the only
  module of ``agentspec`` that wires in ``workflows`` and ``adapters``);
* :mod:`~agentspec.cli.sessions` — ``agentspec sessions`` (list, show, delete, export, backup);
* :mod:`~agentspec.cli.train_drafter` — ``agentspec train-drafter``;
* :mod:`~agentspec.cli.train_predictor` — ``agentspec train-predictor``.

``agentspec.cli:main`` (the console script) and ``python -m agentspec.cli`` keep working: the
names below are loaded from :mod:`agentspec.cli.console` when first read.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["build_parser", "main"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("agentspec.cli.console"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
