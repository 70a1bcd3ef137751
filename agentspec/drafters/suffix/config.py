"""Settings of the session cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

from agentspec.drafters.suffix.index import BACKENDS
from agentspec.drafters.suffix.levels import SCOPES
from agentspec.errors import ConfigError


@dataclass(frozen=True)
class SuffixConfig:
    """Settings of :class:`SuffixDrafter`.

    Attributes:
        max_depth: Longest context suffix matched against an index.
        request_window: Longest context suffix matched against the request index. That
            index holds the context itself, so the context's own suffix always matches and
            arctic's speculation (which drafts once per match length, each match walked
            from the root) runs to the end of the window: its cost grows with the
            window's square. On agent logs 32 almost always gives the same draft as 64, at
            a fraction of the cost (history indexes stop at their longest match on their own).
        max_spec_factor: Draft length cap per matched token. Agent outputs copy long spans
            (documents, tool results), so a long match earns a longer draft than in chat.
        max_spec_offset: Tokens added to the cap, so short but confident matches still draft.
        min_token_prob: A draft stops when its path probability falls below this.
        max_tokens: Most tokens per draft (the engine may ask for fewer).
        scope: The widest history a request reads: ``"session"``, ``"agent"`` or
            ``"tenant"`` (always within its tenant; see the module docstring).
        max_scope_tokens: Tokens kept per history index; the oldest turns are dropped.
        max_scopes: History indexes kept in memory (when full, the least recently used
            index of the tenant holding the most is dropped; it is reloaded from the
            store, if any, when needed again).
        use_request_index: Consult the per-request index.
        use_history: Consult (and fill) the history indexes.
        tree: Draft a small token tree (the most probable continuations, best first, at
            most ``max_tokens`` nodes) instead of one chain; the engine verifies its
            branches in one batched forward (greedy requests only).
        backend: ``"auto"`` (arctic-inference's C++ tree when installed), ``"arctic"`` or
            ``"python"``.
        use_outputs: Also draft from an index of the scope's answers alone (arctic's
            global tree), which the current answer joins as it is generated.
        calibrate: Scale each level's scores by how well they predicted acceptance so far
            (every candidate is checked against the committed tokens each step).
    """

    max_depth: int = 64
    request_window: int = 32
    max_spec_factor: float = 2.0
    max_spec_offset: float = 8.0
    min_token_prob: float = 0.1
    max_tokens: int = 32
    scope: str = "tenant"
    max_scope_tokens: int = 1_048_576
    max_scopes: int = 256
    use_request_index: bool = True
    use_history: bool = True
    tree: bool = False
    backend: str = "auto"
    calibrate: bool = True
    use_outputs: bool = False

    def __post_init__(self) -> None:
        for name in ("max_depth", "request_window", "max_tokens", "max_scope_tokens", "max_scopes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not (math.isfinite(self.max_spec_factor) and self.max_spec_factor >= 0):
            raise ConfigError(f"max_spec_factor must be >= 0, got {self.max_spec_factor!r}")
        if not math.isfinite(self.max_spec_offset):
            raise ConfigError(f"max_spec_offset must be finite, got {self.max_spec_offset!r}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ConfigError(f"min_token_prob must be in [0, 1], got {self.min_token_prob!r}")
        if self.scope not in SCOPES:
            raise ConfigError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
