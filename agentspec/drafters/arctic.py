"""arctic-inference's ``SuffixDecodingCache`` as a drafter: the reference SuffixDecoding
implementation (C++), run inside agentspec's engine so both are compared on identical
workloads with identical verification.

Install (it is a source package; a plain ``pip install`` builds it against a CUDA torch):
``pip install setuptools wheel ninja cmake nanobind==2.9.2 grpcio-tools`` then, with the
virtual environment's ``bin`` first on ``PATH``,
``pip install --no-build-isolation arctic-inference==0.3.0`` (``make peers`` does this).

Arctic has no notion of sessions: its global tree holds the outputs of every finished
request of one cache. Here one cache is kept per tenant, so tenants stay isolated; within a
tenant all sessions share it, as in a vLLM deployment.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from agentspec.errors import ConfigError
from agentspec.types import Draft, DraftContext, VerifyResult


@dataclass(frozen=True)
class ArcticConfig:
    """Settings passed to ``SuffixDecodingCache.speculate`` (same meaning as SuffixConfig).

    Attributes:
        max_tree_depth: Longest suffix matched.
        max_spec_factor: Draft length cap per matched token.
        max_spec_offset: Tokens added to the cap.
        min_token_prob: Path probability below which a draft stops.
        max_tokens: Most tokens per draft. Always passed: arctic 0.3.0's
            ``max_spec_tokens=None`` is broken.
        max_cached_requests: Finished requests kept in the global tree (-1: unlimited).
    """

    max_tree_depth: int = 64
    max_spec_factor: float = 2.0
    max_spec_offset: float = 8.0
    min_token_prob: float = 0.1
    max_tokens: int = 32
    max_cached_requests: int = -1

    def __post_init__(self) -> None:
        if self.max_tree_depth < 1 or self.max_tokens < 1:
            raise ConfigError(
                f"max_tree_depth and max_tokens must be >= 1, got {self.max_tree_depth}, "
                f"{self.max_tokens}"
            )


def _new_cache(cfg: ArcticConfig) -> Any:
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as exc:  # pragma: no cover - depends on the optional install
        raise ConfigError(
            "arctic_suffix needs arctic-inference: run `make peers` (see "
            "agentspec/drafters/arctic.py for the install steps)"
        ) from exc
    return SuffixDecodingCache(cfg.max_tree_depth, cfg.max_cached_requests)


class ArcticSuffixDrafter:
    """Drafts with arctic-inference's SuffixDecoding cache (a peer for benchmarks)."""

    name = "arctic_suffix"

    def __init__(self, config: ArcticConfig | None = None) -> None:
        self.config = config or ArcticConfig()
        self._caches: dict[str, Any] = {}
        self._ids = itertools.count()
        self._active: tuple[Any, int, int] | None = None  # (cache, request id, tokens seen)

    def _cache(self, ctx: DraftContext) -> Any:
        tenant = ctx.session.tenant if ctx.session is not None else "default"
        if tenant not in self._caches:
            self._caches[tenant] = _new_cache(self.config)
        return self._caches[tenant]

    def _start(self, ctx: DraftContext) -> tuple[Any, int, int]:
        if self._active is not None:
            cache, rid, _ = self._active
            cache.stop_request(rid)
        cache = self._cache(ctx)
        rid = next(self._ids)
        cache.start_request(rid, list(ctx.tokens[: ctx.prompt_len]))
        self._active = (cache, rid, ctx.prompt_len)
        return self._active

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Speculate from the request's prompt tree and the tenant's global tree."""
        active = self._active
        if ctx.step == 0 or active is None or active[2] > len(ctx.tokens):
            active = self._start(ctx)
        cache, rid, seen = active
        if seen < len(ctx.tokens):  # committed tokens arctic has not seen yet
            cache.add_active_response(rid, list(ctx.tokens[seen:]))
            self._active = (cache, rid, len(ctx.tokens))
        cfg = self.config
        context = list(ctx.tokens[-cfg.max_tree_depth :])
        d = cache.speculate(
            rid, context, max_spec_tokens=min(cfg.max_tokens, max_tokens),
            max_spec_factor=cfg.max_spec_factor, max_spec_offset=cfg.max_spec_offset,
            min_token_prob=cfg.min_token_prob, use_tree_spec=False,
        )
        return Draft(tokens=[int(t) for t in d.token_ids], score=float(d.score),
                     match_len=int(d.match_len), source=self.name)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Committed tokens are handed to arctic lazily, at the next propose."""

    def finish(self, ctx: DraftContext) -> None:
        """Add the rest of the output and move the request into the global tree."""
        if self._active is None:
            return
        cache, rid, seen = self._active
        if seen < len(ctx.tokens):
            cache.add_active_response(rid, list(ctx.tokens[seen:]))
        cache.stop_request(rid)
        self._active = None
