"""Acceptance rules. Each implements :class:`agentspec.interfaces.Verifier`.

=================  ==========================================================  ========
verifier           rule                                                        lossless
=================  ==========================================================  ========
GreedyVerifier     longest argmax-matching prefix (temperature 0 only)         yes
RejectionVerifier  token-level speculative rejection sampling                  yes
BlockVerifier      greedy block verification, GBV (default sampling rule)      yes
MultiDraftVerifier GBV chained over K i.i.d. drafts (SpecTr-GBV style)         yes
KeyedVerifier      position-keyed sampling: accept iff draft == keyed sample   yes
BudgetedVerifier   ASD: greedy with regret-budgeted exceptions                 no
=================  ==========================================================  ========

The sampling verifiers serve greedy requests with the strict greedy rule, so an agent's
lossless verifier also serves requests that override the temperature. Seeded sampled
requests are verified by :class:`KeyedVerifier` (same seed, same tokens, whatever was
drafted); unseeded ones by the policy's sampler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentspec.verifiers.block import BlockVerifier
from agentspec.verifiers.budgeted import BudgetConfig, BudgetedVerifier
from agentspec.verifiers.greedy import GreedyVerifier
from agentspec.verifiers.keyed import KeyedVerifier
from agentspec.verifiers.multi_draft import MultiDraftVerifier, MultiVerifyResult
from agentspec.verifiers.rejection import RejectionVerifier

if TYPE_CHECKING:
    from agentspec.interfaces import Verifier
    from agentspec.spec import VerifierPolicy
    from agentspec.storage.ledger import RegretLedger

__all__ = [
    "BlockVerifier",
    "BudgetConfig",
    "BudgetedVerifier",
    "GreedyVerifier",
    "KeyedVerifier",
    "MultiDraftVerifier",
    "MultiVerifyResult",
    "RejectionVerifier",
    "build_verifier",
]

_SAMPLERS: dict[str, type[RejectionVerifier | BlockVerifier | MultiDraftVerifier]] = {
    "rejection": RejectionVerifier,
    "block": BlockVerifier,
    "multi_draft": MultiDraftVerifier,
}


def build_verifier(policy: VerifierPolicy, ledger: RegretLedger | None = None) -> Verifier:
    """The verifier an agent's policy asks for.

    * ``lossless``: seeded sampled requests are verified with position-keyed sampling
      (:class:`KeyedVerifier`: the seeded non-speculative sample, whatever the drafter and
      the session's history); unseeded ones with the policy's sampler (GBV by default);
      greedy requests with the strict greedy rule, token-identical to greedy decoding.
      With ``num_drafts > 1`` the factory (:func:`agentspec.factory.build_engine`) runs
      ``MultiDraftDecoder``; with one draft the ``multi_draft`` sampler verifies it with GBV.
    * ``budgeted``: ASD with the policy's B, g, M and budget scope, charging the regret
      ledger (``ledger``, or the process-wide default file under ``AGENTSPEC_HOME``).
      Sampled requests that override the temperature are verified as under ``lossless``
      (keyed when seeded, GBV otherwise).
    """
    if policy.mode == "budgeted":
        from agentspec.storage.ledger import RegretLedger

        config = BudgetConfig(
            budget=policy.budget, gate=policy.gate, max_exceptions=policy.max_exceptions,
            scope=policy.budget_scope,
        )
        return BudgetedVerifier(config, ledger or RegretLedger.default())
    return KeyedVerifier(_SAMPLERS[policy.sampler]())
