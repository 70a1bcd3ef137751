"""Every environment variable the vLLM adapter reads, declared once (as vLLM's ``envs.py``).

vLLM starts the proposer in its worker processes, which inherit the environment and
nothing else, so the adapter's settings travel as environment variables. Each one is named
here with its default and meaning; code reads them through :func:`read` (or sets them by
these names), never by a string literal of its own.
"""

from __future__ import annotations

import os
from typing import overload

__all__ = ["COST", "COST_CURVE", "MIN_SCORE", "OUTPUTS", "PAYOFF", "PREDICTOR", "SCOPE",
           "SPEC_OFFSET", "STATS", "STORE", "VARIABLES", "read"]

#: History scope of the session cache: ``session`` / ``agent`` / ``tenant``
#: (default: the session cache's own).
SCOPE = "AGENTSPEC_VLLM_SCOPE"
#: The proposer's gate: a draft whose suffix-tree score (its expected accepted length) is
#: below this is not sent, so the step costs no verification work (default 0).
MIN_SCORE = "AGENTSPEC_VLLM_MIN_SCORE"
#: A SQLite session store to persist and reload turns (default: none).
STORE = "AGENTSPEC_VLLM_STORE"
#: A JSON file the proposer's counters are written to every 8 steps (default: none).
STATS = "AGENTSPEC_VLLM_STATS"
#: Tokens a draft may run past ``max_spec_factor`` times its match length (default: the
#: session cache's own, 8).
SPEC_OFFSET = "AGENTSPEC_VLLM_SPEC_OFFSET"
#: ``1``: also draft from the scope's answers alone (default 0).
OUTPUTS = "AGENTSPEC_VLLM_OUTPUTS"
#: The learned payoff gate: ``off`` (default) or ``cost_aware``.
PAYOFF = "AGENTSPEC_VLLM_PAYOFF"
#: A payoff predictor file (default: the shipped one).
PREDICTOR = "AGENTSPEC_VLLM_PREDICTOR"
#: The served model's verification cost per draft token, in forwards (default 0.04).
COST = "AGENTSPEC_VLLM_COST_PER_TOKEN"
#: A JSON file of the served model's measured verify cost ``{"k": cost}`` (or an agentspec
#: cost file), used by the payoff gate instead of the per-token line (default: none).
COST_CURVE = "AGENTSPEC_VLLM_COST_CURVE"

#: Every variable, for documentation and checks.
VARIABLES = (SCOPE, MIN_SCORE, STORE, STATS, SPEC_OFFSET, OUTPUTS, PAYOFF, PREDICTOR, COST,
             COST_CURVE)


@overload
def read(name: str, default: str) -> str: ...


@overload
def read(name: str, default: None = None) -> str | None: ...


def read(name: str, default: str | None = None) -> str | None:
    """The value of variable ``name`` (one of :data:`VARIABLES`), else ``default``.

    Raises:
        KeyError: ``name`` is not declared here.
    """
    if name not in VARIABLES:
        raise KeyError(f"{name} is not an agentspec vLLM variable; declare it in envs.py")
    return os.environ.get(name, default)
