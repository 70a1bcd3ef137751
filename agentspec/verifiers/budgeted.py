"""Approximate Speculative Decoding (ASD): budgeted approximate greedy verification.

Strict greedy verification stops at the first draft token ``x_i`` that differs from the
target's argmax ``y*_i``. ASD may accept such a mismatch (an *exception*) when it costs
little. With ``z_i`` the target logits of row ``i`` (``[k+1, V]``, row ``i`` conditioned on
the realised draft prefix ``x_1..x_i``):

    regret         r_i = z_i(y*_i) - z_i(x_i)            (0 when x_i = y*_i)
    local gate     r_i / q_i <= g,  q_i = k - i           (remaining proposal length)
    block cap      exceptions in this block <= M
    budget         s + Σ_{accepted j <= i} r_j <= B       (s: regret spent so far)

Feasibility of position i is ``x_i = y*_i`` or "the exception passes all three"; the
accepted length is the longest all-true prefix of that mask. Cumulative sums give the
exception count and regret up to every position at once, so acceptance is vectorised and
O(k) (:func:`asd_accept`). After an exception the later draft tokens that equal the
target's argmax are committed too (*realised-prefix suffix reuse*): the verify forward
already scored the draft, so row ``i + 1`` is the target's distribution after the realised
prefix including the exception, and its match test is exact greedy under that prefix. The
verifier's own token is the target's argmax after the accepted prefix.

``B = 0`` disables exceptions, which makes the rule exactly :class:`GreedyVerifier`'s:
token-identical to strict greedy decoding (tested). Regret is charged to the request's
account (:class:`BudgetAccount`, keyed by request id) and, with a
:class:`~agentspec.storage.ledger.RegretLedger`, to the session's persisted account; with
``scope="session"`` the budget caps the session's lifetime spend.
Sampled requests (temperature > 0) are verified losslessly by the fallback sampler: ASD
is a relaxation of greedy decoding only. The default fallback is
:class:`~agentspec.verifiers.keyed.KeyedVerifier`, so a *seeded* sampled request sent to a
budgeted agent reproduces exactly (same tokens with any drafter) and spends no regret; an
unseeded one is verified by GBV. The reverse does not hold: greedy requests under ASD with
B > 0 may accept exceptions, and which ones depends on the drafts, so ASD output is
reproducible only for the same drafts (B = 0 is strict greedy, drafter-independent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from agentspec.errors import ConfigError, RequestStateError
from agentspec.interfaces import Verifier
from agentspec.requests import REQUESTS, Slot
from agentspec.storage.ledger import RegretLedger
from agentspec.types import Draft, SamplingParams, SessionRef, VerifyResult, state_key
from agentspec.verifiers.block import BlockVerifier
from agentspec.verifiers.keyed import KeyedVerifier
from agentspec.verifiers.rejection import check_rows

__all__ = ["AsdOutcome", "BudgetAccount", "BudgetConfig", "BudgetedVerifier", "asd_accept"]

BudgetScope = Literal["request", "session"]


@dataclass(frozen=True)
class BudgetConfig:
    """ASD settings.

    Attributes:
        budget: Regret budget B (logit units); 0 = strict greedy.
        gate: Local gate g: an exception needs ``regret / remaining draft length <= g``.
        max_exceptions: Most exceptions accepted in one verified block (M).
        scope: ``request``: B caps each request; ``session``: B caps the session's total,
            read from and charged to the persisted ledger.
    """

    budget: float = 0.0
    gate: float = 0.5
    max_exceptions: int = 1
    scope: BudgetScope = "request"

    def __post_init__(self) -> None:
        if not self.budget >= 0:  # also rejects NaN
            raise ConfigError(f"budget must be >= 0, got {self.budget!r}")
        if not self.gate >= 0:
            raise ConfigError(f"gate must be >= 0, got {self.gate!r}")
        if self.max_exceptions < 0:
            raise ConfigError(f"max_exceptions must be >= 0, got {self.max_exceptions!r}")
        if self.scope not in ("request", "session"):
            raise ConfigError(f"scope must be 'request' or 'session', got {self.scope!r}")


@dataclass(frozen=True)
class AsdOutcome:
    """One block's ASD decision: accepted length, exceptions taken, regret spent."""

    accepted: int
    exceptions: int
    regret: float


def asd_accept(
    draft: torch.Tensor,  # [k] drafted ids
    logits: torch.Tensor,  # [k+1, V] raw target logits
    budget_left: float,
    gate: float,
    max_exceptions: int,
) -> AsdOutcome:
    """Vectorised ASD acceptance (see the module docstring for the rule).

    ``budget_left <= 0`` or ``max_exceptions == 0`` turns every exception off: strict
    greedy, even where the target's logits tie (a zero-regret mismatch).
    """
    k = draft.shape[0]
    if k == 0:
        return AsdOutcome(0, 0, 0.0)
    z = logits[:k].float()  # [k, V]
    best = z.argmax(dim=-1)  # [k]  y*_i
    mismatch = draft != best  # [k]
    if budget_left <= 0 or max_exceptions == 0:
        n = int((~mismatch).long().cumprod(0).sum())
        return AsdOutcome(n, 0, 0.0)
    # r_i = z_i(y*) - z_i(x_i) >= 0; only mismatches spend it.
    regret = (z.gather(1, best[:, None]) - z.gather(1, draft[:, None])).squeeze(1)  # [k]
    regret = torch.where(mismatch, regret.clamp_min(0.0), torch.zeros_like(regret))
    remaining = torch.arange(k, 0, -1, dtype=z.dtype)  # [k]  q_i = k - i
    count = mismatch.long().cumsum(0)  # [k] exceptions up to and including i
    spent = regret.cumsum(0)  # [k] regret up to and including i
    # Within the accepted prefix every mismatch is an accepted exception, so the prefix
    # sums are exactly the block's exception count and spend at each position.
    exception_ok = (regret <= gate * remaining) & (count <= max_exceptions)
    exception_ok &= spent <= budget_left
    feasible = ~mismatch | exception_ok  # [k]
    n = int(feasible.long().cumprod(0).sum())
    if n == 0:
        return AsdOutcome(0, 0, 0.0)
    return AsdOutcome(n, int(count[n - 1]), float(spent[n - 1]))


@dataclass
class BudgetAccount:
    """One request's regret account (what :class:`BudgetedVerifier` keeps per request).

    Attributes:
        session: The session the request belongs to (its ledger account), if any.
        budget: The budget B this request decodes under.
        spent: Regret charged against B so far: this request's, plus the session's
            earlier spend with ``scope="session"``.
        regret: Regret of the exceptions this request accepted.
        exceptions: Exceptions this request accepted.
    """

    session: SessionRef | None
    budget: float
    spent: float = 0.0
    regret: float = 0.0
    exceptions: int = 0

    @property
    def remaining(self) -> float:
        """Budget left before exceptions stop."""
        return max(self.budget - self.spent, 0.0)


class BudgetedVerifier:
    """Approximate greedy verification within a regret budget (opt-in, not lossless).

    Args:
        config: B, g, M and the budget scope.
        ledger: Where exceptions are recorded per session (``None``: not persisted).
        sampler: Lossless verifier for sampled requests (default: position-keyed for seeded
            requests, GBV for unseeded ones).

    Each request has its own :class:`BudgetAccount`, keyed by its request id: begun by
    :meth:`begin_request` (the engine calls it before the prefill), read by every greedy
    :meth:`verify` of that id, released by :meth:`end_request`. Requests may interleave.
    A greedy step for a request that was never begun (or has ended) raises
    :class:`~agentspec.errors.RequestStateError`. ``request_id=None`` is one anonymous
    request at a time (direct use without the engine): beginning it again replaces it.
    """

    lossless = False
    name = "budgeted"

    def __init__(
        self,
        config: BudgetConfig | None = None,
        ledger: RegretLedger | None = None,
        sampler: Verifier | None = None,
    ) -> None:
        self.config = config or BudgetConfig()
        self.ledger = ledger
        self.sampler: Verifier = sampler or KeyedVerifier(BlockVerifier())
        # Each live request's account, in the one home of per-request state (the engine's
        # end of a request drops it with the rest; the ledger already holds its charges).
        self._accounts: Slot[BudgetAccount] = REQUESTS.slot("budgeted")

    def begin_request(
        self, session: SessionRef | None, rng: torch.Generator | None = None,
        request_id: str | None = None,
    ) -> None:
        """Open the account of request ``request_id`` of ``session`` (counted in the
        ledger; with ``scope="session"`` it starts from the session's spend so far).

        Raises:
            RequestStateError: ``request_id`` names a request that has not ended.
        """
        if request_id is not None and state_key(request_id) in self._accounts:
            raise RequestStateError(
                f"BudgetedVerifier: request {request_id!r} was begun twice; end it first")
        account = BudgetAccount(session, self.config.budget)
        if self.ledger is not None and session is not None:
            entry = self.ledger.count_request(session)
            if self.config.scope == "session":
                account.spent = entry.regret
        self._accounts.put(state_key(request_id), account)

    def end_request(self, request_id: str | None) -> None:
        """Release the account of ``request_id`` (the engine calls this when the request
        stops; the ledger already holds its charges).

        Raises:
            RequestStateError: no live request has that id.
        """
        if self._accounts.pop(state_key(request_id)) is None:
            raise RequestStateError(
                f"BudgetedVerifier: cannot end request {request_id!r}: it was never begun "
                "or has already ended")

    def account(self, request_id: str | None = None) -> BudgetAccount:
        """The live account of ``request_id`` (its spend, regret and exceptions so far).

        Raises:
            RequestStateError: no live request has that id.
        """
        account = self._accounts.get(state_key(request_id))
        if account is None:
            raise RequestStateError(
                f"BudgetedVerifier: no live request {request_id!r}; call "
                "begin_request(session, request_id=...) before its first step")
        return account

    def verify(
        self,
        draft: Draft,
        logits: torch.Tensor,  # [k+1, V]
        sampling: SamplingParams,
        rng: torch.Generator | None = None,
        *,
        request_id: str | None = None,
    ) -> VerifyResult:
        """Accept the longest feasible prefix, then the target's argmax; exceptions are
        charged to ``request_id``'s account (and its session's ledger entry).

        Raises:
            RequestStateError: a greedy step for a request that is not live.
        """
        if not sampling.greedy:
            return self.sampler.verify(draft, logits, sampling, rng, request_id=request_id)
        account = self.account(request_id)
        check_rows(draft, logits)
        logits = logits.cpu()  # verification runs on the CPU (a no-op for target logits)
        x = torch.tensor(draft.tokens, dtype=torch.long)  # [k]
        cfg = self.config
        budget_left = cfg.budget - account.spent if cfg.budget > 0 else 0.0
        out = asd_accept(x, logits, budget_left, cfg.gate, cfg.max_exceptions)
        n = out.accepted
        token = int(logits[n].argmax())
        if out.exceptions:
            account.spent += out.regret
            account.regret += out.regret
            account.exceptions += out.exceptions
            if self.ledger is not None and account.session is not None:
                self.ledger.charge(account.session, out.regret, out.exceptions)
        return VerifyResult(
            tokens=[*draft.tokens[:n], token], num_accepted=n, accepted_path=list(range(n)),
            exceptions=out.exceptions, regret=out.regret,
        )
