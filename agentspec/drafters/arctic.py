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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentspec.errors import ConfigError
from agentspec.requests import REQUESTS, Slot
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


class _ArcticRequest:
    """One request in arctic's cache, driven as vLLM drives it: the committed tokens live
    in a growing int32 buffer and arctic reads a view of its tail (no per-step copies)."""

    __slots__ = ("added", "buf", "cache", "n", "rid")

    def __init__(self, cache: Any, rid: int, tokens: Sequence[int], prompt_len: int) -> None:
        import numpy as np

        self.cache, self.rid = cache, rid
        self.buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int32)
        self.buf[: len(tokens)] = tokens
        self.n = len(tokens)
        self.added = 0  # response tokens handed to arctic (its global tree holds them)
        cache.start_request(rid, self.buf[:prompt_len])
        if self.n > prompt_len:  # a request resumed mid-output
            cache.add_active_response(rid, self.buf[prompt_len : self.n])

    def add(self, tokens: Sequence[int]) -> None:
        """Committed tokens: appended to the buffer, handed to arctic incrementally."""
        import numpy as np

        k = len(tokens)
        if not k:
            return
        if self.n + k > len(self.buf):
            grown = np.empty(2 * (self.n + k), dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : self.n + k] = tokens
        self.cache.add_active_response(self.rid, self.buf[self.n : self.n + k])
        self.n += k
        self.added += k


class ArcticSuffixDrafter:
    """Drafts with arctic-inference's SuffixDecoding cache (a peer for benchmarks).

    Requests are keyed by ``DraftContext.request_id`` (by session when it is ``None``);
    each step hands arctic only the newly committed tokens and a view of the context's
    tail, as vLLM's ``suffix_decoding.py`` proposer does, so its per-step cost is arctic's.
    """

    name = "arctic_suffix"

    def __init__(self, config: ArcticConfig | None = None) -> None:
        self.config = config or ArcticConfig()
        self._caches: dict[str, Any] = {}
        self._ids = itertools.count()
        # Live requests, in the one home of per-request state; one the engine ends
        # unfinished (or the home evicts) is stopped in arctic's cache too.
        self._live: Slot[_ArcticRequest] = REQUESTS.slot("arctic", on_drop=_stop)
        self.cached_tokens = 0  # response tokens of finished requests in the global trees

    def _cache(self, ctx: DraftContext) -> Any:
        tenant = ctx.session.tenant if ctx.session is not None else "default"
        if tenant not in self._caches:
            self._caches[tenant] = _new_cache(self.config)
        return self._caches[tenant]

    def _sync(self, ctx: DraftContext) -> _ArcticRequest:
        key = ctx.state_key
        live = self._live.get(key)
        if live is None or len(ctx.tokens) < live.n or (ctx.request_id is None
                                                         and ctx.step == 0):
            if live is not None:
                live.cache.stop_request(live.rid)
            live = _ArcticRequest(self._cache(ctx), next(self._ids), ctx.tokens, ctx.prompt_len)
            self._live.put(key, live)
        if live.n < len(ctx.tokens):  # tokens committed without an observe call
            live.add(ctx.tokens[live.n :])
        return live

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Speculate from the request's prompt tree and the tenant's global tree."""
        live = self._sync(ctx)
        cfg = self.config
        d = live.cache.speculate(
            live.rid, live.buf[max(0, live.n - cfg.max_tree_depth) : live.n],
            max_spec_tokens=min(cfg.max_tokens, max_tokens),
            max_spec_factor=cfg.max_spec_factor, max_spec_offset=cfg.max_spec_offset,
            min_token_prob=cfg.min_token_prob, use_tree_spec=False,
        )
        return Draft(tokens=list(d.token_ids), score=float(d.score),
                     match_len=int(d.match_len), source=self.name)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Hand the committed tokens to arctic (the request's tree and the global tree)."""
        live = self._live.get(ctx.state_key)
        if live is not None and live.n == len(ctx.tokens):
            live.add(result.tokens)

    def finish(self, ctx: DraftContext) -> None:
        """Add the rest of the output and move the request into the global tree."""
        live = self._live.pop(ctx.state_key)
        if live is None:
            return
        if live.n < len(ctx.tokens):
            live.add(ctx.tokens[live.n :])
        live.cache.stop_request(live.rid)
        self.cached_tokens += live.added

    def memory_bytes(self) -> int:
        """arctic's estimate of its global trees (per-request trees are not exposed)."""
        return sum(int(c._global_tree.estimate_memory()) for c in self._caches.values())


def _stop(live: _ArcticRequest) -> None:
    """Stop an unfinished request in arctic's cache (its request tree is released)."""
    live.cache.stop_request(live.rid)
