"""Acceptance rules. Each implements :class:`agentspec.interfaces.Verifier`.

=================  ==========================================================  ========
verifier           rule                                                        lossless
=================  ==========================================================  ========
GreedyVerifier     longest argmax-matching prefix (temperature 0 only)         yes
RejectionVerifier  token-level speculative rejection sampling                  yes
BlockVerifier      greedy block verification, GBV (default sampling rule)      yes
MultiDraftVerifier GBV chained over K i.i.d. drafts (SpecTr-GBV style)         yes
BudgetedVerifier   ASD: greedy with regret-budgeted exceptions                 no
=================  ==========================================================  ========

The sampling verifiers serve greedy requests with the strict greedy rule, so an agent's
lossless verifier also serves requests that override the temperature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentspec.verifiers.block import BlockVerifier
from agentspec.verifiers.budgeted import BudgetConfig, BudgetedVerifier
from agentspec.verifiers.greedy import GreedyVerifier
from agentspec.verifiers.multi_draft import MultiDraftVerifier, MultiVerifyResult
from agentspec.verifiers.rejection import RejectionVerifier

if TYPE_CHECKING:
    from agentspec.interfaces import Verifier
    from agentspec.ledger import RegretLedger
    from agentspec.spec import VerifierPolicy

__all__ = [
    "BlockVerifier",
    "BudgetConfig",
    "BudgetedVerifier",
    "GreedyVerifier",
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

    * ``lossless``: the policy's sampler (GBV by default); greedy requests go through the
      strict greedy rule inside it, so the output is token-identical to greedy decoding.
    * ``budgeted``: ASD with the policy's B, g, M and budget scope, charging the regret
      ledger (``ledger``, or the process-wide default file under ``AGENTSPEC_HOME``).
      With ``num_drafts > 1`` the factory (:func:`agentspec.factory.build_engine`) runs
      ``MultiDraftDecoder`` with its own :class:`MultiDraftVerifier`; with one draft the
      ``multi_draft`` sampler verifies it with GBV.
    """
    if policy.mode == "budgeted":
        from agentspec.ledger import RegretLedger

        config = BudgetConfig(
            budget=policy.budget, gate=policy.gate, max_exceptions=policy.max_exceptions,
            scope=policy.budget_scope,
        )
        return BudgetedVerifier(config, ledger or RegretLedger.default())
    return _SAMPLERS[policy.sampler]()
