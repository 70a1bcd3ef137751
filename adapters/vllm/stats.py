"""A vLLM request's speculative-decoding numbers as agentspec's :class:`RequestStats`.

vLLM does not report spec-decode numbers per request; it keeps process-wide Prometheus
counters (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``). :class:`VLLMRuntime`
serves one request at a time, so the counters' difference over a request is that
request's. The per-position acceptance counts give the accepted-length histogram exactly:
``per_pos[j]`` drafts accepted more than ``j`` tokens. Draft lengths per step are not
reported, so each synthesised step carries the mean draft length.

Prefix caching: vLLM's automatic prefix caching counts prompt tokens looked up
(``vllm:prefix_cache_queries``) and found cached (``vllm:prefix_cache_hits``); their
difference over a request is the request's cached prompt tokens, reported as
``RequestStats.cached_prompt_tokens`` like agentspec's own prefix reuse.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agentspec.types import RequestStats, StepStats

_PREFIX = "vllm:spec_decode_"


@dataclass(frozen=True)
class SpecCounters:
    """A snapshot of vLLM's spec-decode counters.

    Attributes:
        drafts: Steps that verified a draft.
        draft_tokens: Tokens drafted.
        accepted: Draft tokens accepted.
        per_pos: Drafts whose accepted length exceeds each position.
        prefix_queries: Prompt tokens looked up in vLLM's prefix cache.
        prefix_hits: Prompt tokens found there (their KV reused).
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: tuple[int, ...] = field(default_factory=tuple)
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up prompt tokens served by vLLM's prefix cache."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.per_pos), len(other.per_pos))
        mine = list(self.per_pos) + [0] * (n - len(self.per_pos))
        theirs = list(other.per_pos) + [0] * (n - len(other.per_pos))
        return SpecCounters(
            self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
            self.accepted - other.accepted, tuple(a - b for a, b in zip(mine, theirs, strict=True)),
            self.prefix_queries - other.prefix_queries, self.prefix_hits - other.prefix_hits,
        )


def read_counters(metrics: Iterable[Any]) -> SpecCounters:
    """Sum vLLM's spec-decode counters over engines (``LLM.get_metrics()`` output)."""
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    prefix = {"vllm:prefix_cache_queries": 0, "vllm:prefix_cache_hits": 0}
    per_pos: list[int] = []
    for metric in metrics:
        name = str(getattr(metric, "name", ""))
        if name.removesuffix("_total") in prefix:
            prefix[name.removesuffix("_total")] += int(getattr(metric, "value", 0))
            continue
        if not name.startswith(_PREFIX):
            continue
        key = name[len(_PREFIX) :]
        if key == "num_accepted_tokens_per_pos":
            values = [int(v) for v in getattr(metric, "values", [])]
            per_pos.extend([0] * (len(values) - len(per_pos)))
            for i, v in enumerate(values):
                per_pos[i] += v
        elif key in totals:
            totals[key] += int(getattr(metric, "value", 0))
    return SpecCounters(totals["num_drafts"], totals["num_draft_tokens"],
                        totals["num_accepted_tokens"], tuple(per_pos),
                        prefix["vllm:prefix_cache_queries"], prefix["vllm:prefix_cache_hits"])


def request_stats(
    delta: SpecCounters, prompt_tokens: int, generated: int, total_s: float, source: str
) -> RequestStats:
    """The :class:`RequestStats` of one request from its counter difference.

    Every engine step commits its accepted draft tokens plus one, so the request took
    ``generated - accepted`` steps; ``delta.drafts`` of them verified a draft.

    Args:
        delta: Counters after the request minus counters before it.
        prompt_tokens: Prompt length.
        generated: Output tokens.
        total_s: Wall-clock seconds of the request.
        source: Drafter name recorded on steps that verified a draft.
    """
    steps: list[StepStats] = []
    if delta.drafts > 0:
        mean_len = round(delta.draft_tokens / delta.drafts)
        at_least = [delta.drafts, *delta.per_pos]  # at_least[j]: drafts accepting >= j
        for accepted in range(len(at_least)):
            more = at_least[accepted + 1] if accepted + 1 < len(at_least) else 0
            count = max(0, at_least[accepted] - more)
            steps.extend(
                StepStats(source, mean_len, accepted, accepted + 1, 0.0, 0.0)
                for _ in range(count)
            )
    forwards = max(generated - delta.accepted, len(steps))
    steps.extend(StepStats("none", 0, 0, 1, 0.0, 0.0) for _ in range(forwards - len(steps)))
    return RequestStats(
        prompt_tokens=prompt_tokens, cached_prompt_tokens=max(0, delta.prefix_hits),
        generated_tokens=generated, forwards=forwards,
        total_s=total_s, verify_s=total_s, steps=steps,
    )
