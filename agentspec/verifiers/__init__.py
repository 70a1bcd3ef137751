"""Acceptance rules. Each implements :class:`agentspec.interfaces.Verifier`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentspec.errors import ConfigError
from agentspec.verifiers.greedy import GreedyVerifier

if TYPE_CHECKING:
    from agentspec.interfaces import Verifier
    from agentspec.spec import VerifierPolicy

__all__ = ["GreedyVerifier", "build_verifier"]


def build_verifier(policy: VerifierPolicy) -> Verifier:
    """The verifier an agent's policy asks for.

    Raises:
        ConfigError: a policy this build cannot serve (named in the message).
    """
    if policy.mode == "lossless" and policy.temperature == 0.0:
        return GreedyVerifier()
    raise ConfigError(
        f"verifier mode={policy.mode!r} with temperature={policy.temperature} is not "
        "supported yet; use mode='lossless' with temperature=0"
    )
