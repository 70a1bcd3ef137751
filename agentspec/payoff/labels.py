"""Full-length labels of cache drafts, from the tokens committed after them.

Why. A payoff policy calibrates its estimate ŷ of a cache draft's accepted length against
what the draft would have scored *at full length*, whichever part of it was verified: a
draft the policy cut to one token, withheld, or lost to the model drafter still says how
good the cache draft was, once the tokens committed after it decide it. Labelling only the
verified prefix would teach a cutting policy that its cuts were right. So every cache
draft the policy rated is kept as a *shadow* — where it started, the whole draft, the
predictor's raw ŷ (:attr:`~agentspec.payoff.policy.Choice.raw`) and its index's score —
until the committed tokens decide its label (:meth:`~agentspec.types.Draft.followed_length`:
a tree's label is its longest followed root path), and the label goes to the policy's
``outcome``.

One request keeps one :class:`ShadowLabels`: HVD in-process (``HybridDrafter``, labelled
from each step's context and verified tokens) and the vLLM proposer's payoff gate (labelled
from the row's committed tokens at the next step) both use it, so the two calibrate alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from agentspec.errors import ConfigError
from agentspec.types import Draft

__all__ = ["SHADOW_KEEP", "Outcome", "ShadowLabels"]

#: Cache drafts one request keeps waiting for their label (the oldest are dropped).
SHADOW_KEEP = 64

#: ``outcome(raw, label, score, length)``: :meth:`SourcePolicy.outcome
#: <agentspec.payoff.policy.SourcePolicy.outcome>`.
Outcome = Callable[[float, int, float, int], None]


class ShadowLabels:
    """One request's cache drafts waiting for their full-length label, oldest first.

    Args:
        keep: Most drafts kept (the oldest are dropped, unlabelled).

    Raises:
        ConfigError: ``keep`` < 1.
    """

    def __init__(self, keep: int = SHADOW_KEEP) -> None:
        if keep < 1:
            raise ConfigError(f"keep must be >= 1, got {keep!r}")
        self._shadow: deque[tuple[int, Draft, float, float]] = deque(maxlen=keep)

    def __len__(self) -> int:
        return len(self._shadow)

    def __bool__(self) -> bool:
        return bool(self._shadow)

    @property
    def latest(self) -> tuple[int, Draft, float, float] | None:
        """``(start, draft, raw, score)`` of the newest draft kept (``None``: none)."""
        return self._shadow[-1] if self._shadow else None

    def add(self, start: int, draft: Draft, raw: float, score: float) -> None:
        """Keep ``draft`` (uncut), drafted when the request held ``start`` tokens, which the
        predictor rated ``raw`` and its index scored ``score``."""
        self._shadow.append((start, draft, raw, score))

    def label(self, outcome: Outcome, tokens: Sequence[int], more: Sequence[int] = ()) -> int:
        """Give ``outcome`` the label of every kept draft the committed tokens now decide,
        oldest first; those stay kept whose continuation is not known yet.

        Args:
            outcome: Receives ``(raw, label, score, len(draft.tokens))`` per decided draft.
            tokens: The request's tokens (the context, from position 0).
            more: Tokens committed after ``tokens`` (a step's verified tokens when
                ``tokens`` is the context before the step).

        Returns:
            The drafts labelled.
        """
        shadow = self._shadow
        if not shadow:
            return 0
        base = shadow[0][0]
        committed = list(tokens[base:]) + list(more)  # from the oldest start
        done = 0
        while shadow:
            start, draft, raw, score = shadow[0]
            label = draft.followed_length(committed[start - base:])
            if label is None:  # drafts start in order: later ones are not due either
                break
            shadow.popleft()
            outcome(raw, label, score, len(draft.tokens))
            done += 1
        return done
