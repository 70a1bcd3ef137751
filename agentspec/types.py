"""The dataclasses where drafters, verifiers, targets and the engine meet.

Drafters produce a :class:`Draft`, verifiers turn a draft plus target logits into a
:class:`VerifyResult`, and the engine records a :class:`StepStats` per decode step and a
:class:`RequestStats` per request. Nothing else crosses component boundaries.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentspec.errors import ConfigError, DraftError

if TYPE_CHECKING:
    import torch

#: c(k, L): seconds of one target forward over k new tokens on a cache of L positions.
ContextCost = Callable[[int, int], float]


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` means greedy (argmax).

    Attributes:
        temperature: Softmax temperature; 0 selects greedy decoding.
        top_p: Nucleus mass kept when sampling (1.0 keeps everything).
        top_k: Number of most likely tokens kept when sampling (0 keeps everything).
        seed: Seed of the request's random generator (sampling only).
        frequency_penalty: OpenAI's: each logit minus this times the token's count among
            the generated tokens, in ``[-2, 2]`` (0: off).
        presence_penalty: OpenAI's: each logit of a token already generated minus this,
            in ``[-2, 2]`` (0: off).
        repetition_penalty: vLLM's / transformers' (Ollama's ``repeat_penalty``): the logit
            of a token in the prompt or the output is divided by this when positive and
            multiplied by it otherwise; > 0, 1 is off. Applied before the other two, as in
            vLLM. See :mod:`agentspec.penalties`.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also rejects NaN
                raise ConfigError(f"{name} must be in [-2, 2], got {value!r}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ConfigError(
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty!r}"
            )

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax."""
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """True when a frequency, presence or repetition penalty changes the logits."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)


# fullmatch, never ``match`` with ``$``: ``$`` also matches before a final newline, and an id
# with a trailing "\n" once passed, generated an answer and then broke the response header.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}")


def check_id(kind: str, value: str) -> str:
    """Validate a tenant, agent or session id (1-128 chars of ``[A-Za-z0-9_.:@-]``).

    The whole string must match: no whitespace, newline or other control character anywhere,
    because ids travel in HTTP headers, log lines and operators' CLI output.
    """
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        raise ConfigError(
            f"invalid {kind} id {value!r}: use 1-128 characters from [A-Za-z0-9_.:@-], "
            "starting with a letter or digit"
        )
    return value


@dataclass(frozen=True)
class SessionRef:
    """Who a request belongs to: caches are scoped by these ids.

    Attributes:
        session_id: The conversation / agent run.
        tenant: The customer (API key); tenants never see each other's tokens.
        agent: The agent (one AgentSpec) within the tenant.
        ephemeral: A one-off request's ref (the server's anonymous requests under agent or
            tenant scope): its turn feeds the agent's and tenant's history in memory but is
            never stored, since no later request can name this session.
    """

    session_id: str
    tenant: str = "default"
    agent: str = "default"
    ephemeral: bool = False

    def __post_init__(self) -> None:
        check_id("session", self.session_id)
        check_id("tenant", self.tenant)
        check_id("agent", self.agent)


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may look at: the token ids of the request so far.

    Attributes:
        tokens: Prompt followed by every committed generated token.
        prompt_len: Number of prompt tokens at the start of ``tokens``.
        session: Session the request belongs to (``None`` for one-off requests).
        step: Index of the decode step (0 for the first draft).
        request_id: The request's id, when the caller has one (the engine, vLLM). Stateful
            drafters key per-request state by it, so concurrent requests of one session
            keep separate state; ``None``: they fall back to guessing from ``step`` and
            the tokens.
        sampling: The request's sampling parameters (``None``: unknown, e.g. outside the
            engine). A seeded sampled request lets a model drafter draw with the same
            position-keyed noise as the keyed verifier (a Gumbel coupling).
    """

    tokens: Sequence[int]
    prompt_len: int
    session: SessionRef | None = None
    step: int = 0
    request_id: str | None = None
    sampling: SamplingParams | None = None

    @property
    def generated(self) -> Sequence[int]:
        """The tokens generated so far in this request."""
        return self.tokens[self.prompt_len :]

    @property
    def state_key(self) -> tuple[str, object]:
        """The key every drafter keeps this request's state under: its id when the caller
        set one, else its session (one request at a time per session)."""
        return state_key(self.request_id, self.session)


def state_key(request_id: str | None, session: object = None) -> tuple[str, object]:
    """The key a request's state is kept under (:mod:`agentspec.requests`): its id when the
    caller has one (the engine and vLLM always do), else its session (one request at a
    time per session)."""
    if request_id is not None:
        return ("id", request_id)
    return ("session", session)


def first_branch_nodes(parents: Sequence[int]) -> list[int]:
    """The main branch of a tree given by ``parents`` (parents before children): from the
    first root, each node's first-listed child, as node indices root side first."""
    nodes: list[int] = []
    cur = -1
    for i, p in enumerate(parents):
        if p == cur:
            nodes.append(i)
            cur = i
    return nodes


@dataclass(frozen=True)
class Draft:
    """A proposed continuation of the context.

    A chain draft has ``parents is None``: token i follows token i-1. A tree draft gives
    for each token the index of its parent in ``tokens`` (-1 for children of the root),
    parents always before children.

    Attributes:
        tokens: Proposed token ids (may be empty: "no draft, decode one token").
        parents: Parent index per token for tree drafts, ``None`` for chains.
        probs: Draft distribution per token, ``[len(tokens), vocab]``, or ``None`` for
            deterministic drafts (a point mass on each token).
        score: Drafter's own confidence (e.g. suffix-tree frequency mass).
        match_len: Length of the context suffix that matched (cache drafters).
        source: Name of the drafter that produced it.
        position: Output position of the token that verify-logits row 0 predicts (the
            first draft token's), i.e. the tokens generated before this draft. The engine
            sets it; position-keyed sampling draws that row's noise by it.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] | None = None
    probs: torch.Tensor | None = None
    score: float = 0.0
    match_len: int = 0
    source: str = "none"
    position: int = 0

    def __post_init__(self) -> None:
        if self.parents is not None:
            if len(self.parents) != len(self.tokens):
                raise DraftError(
                    f"draft has {len(self.tokens)} tokens but {len(self.parents)} parents"
                )
            # Checked in C (map/any): this runs for every tree draft of every step.
            if self.parents and (min(self.parents) < -1
                                 or any(map(operator.ge, self.parents, range(len(self.parents))))):
                i, p = next((i, p) for i, p in enumerate(self.parents) if not -1 <= p < i)
                raise DraftError(f"draft parent {p} of token {i} must be in [-1, {i})")

    @classmethod
    def trusted(cls, tokens: list[int], parents: list[int] | None, score: float,
                match_len: int, source: str) -> Draft:
        """A draft built without ``__post_init__``'s checks, for a drafter whose trees are
        valid by construction (the session cache: arctic's speculation and the tree merge,
        whose parents a unit test checks). A suffix-cache step costs ~30 us in all; the
        frozen dataclass's ``__init__`` and the parents check took ~2 us of it."""
        draft = object.__new__(cls)
        # Frozen: ``__setattr__`` raises, the instance dict is the one way in.
        draft.__dict__.update(tokens=tokens, parents=parents, probs=None, score=score,
                              match_len=match_len, source=source, position=0)
        return draft

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_tree(self) -> bool:
        """True when the draft has branches (some parent is not the previous token)."""
        return self.parents is not None and any(
            p != i - 1 for i, p in enumerate(self.parents)
        )

    def branches(self) -> list[list[int]]:
        """Root-to-leaf paths of the draft as indices into ``tokens``, longest first (ties:
        the earlier leaf first); a chain draft is one path."""
        n = len(self.tokens)
        if self.parents is None:
            return [list(range(n))] if n else []
        has_child = [False] * n
        for p in self.parents:
            if p >= 0:
                has_child[p] = True
        paths = []
        for leaf in (i for i in range(n) if not has_child[i]):
            path, i = [], leaf
            while i >= 0:
                path.append(i)
                i = self.parents[i]
            paths.append(path[::-1])
        return sorted(paths, key=lambda path: (-len(path), path[-1]))

    def followed_length(self, continuation: Sequence[int]) -> int | None:
        """How many of the draft's tokens (a chain or a tree) ``continuation`` follows from
        the root: its *full-length accepted length* once the true continuation is known,
        whatever part of it was verified. ``None`` while ``continuation`` ends before a
        mismatch or a leaf (not known yet). The one label of every payoff estimate (the
        draft gate's, the HVD policy's calibration)."""
        depth, decided = self.followed(continuation)
        return depth if decided else None

    def followed(self, continuation: Sequence[int]) -> tuple[int, bool]:
        """``(depth, decided)``: how far from the root ``continuation`` follows the draft so
        far, and whether that is final (a mismatch or a leaf reached, not the end of
        ``continuation``). While undecided the draft has survived ``depth`` positions and
        is still at risk at the next one (a right-censored label)."""
        parents, tokens = self.parents, self.tokens
        depth, node, n = 0, -1, len(tokens)
        while True:
            if parents is None:
                children = [node + 1] if node + 1 < n else []
            else:
                children = [i for i in range(node + 1, n) if parents[i] == node]
            if not children:
                return depth, True  # a leaf: the whole path was followed
            if depth >= len(continuation):
                return depth, False
            want = continuation[depth]
            node = next((i for i in children if tokens[i] == want), -2)
            if node == -2:
                return depth, True
            depth += 1

    def first_branch(self) -> Draft:
        """A tree's main branch as a chain: from the first root, each node's first-listed
        child (drafters list the likeliest continuation first); a chain is returned as is."""
        if self.parents is None:
            return self
        nodes = first_branch_nodes(self.parents)
        probs = self.probs[nodes] if self.probs is not None else None
        return Draft([self.tokens[i] for i in nodes], None, probs, self.score,
                     self.match_len, self.source, self.position)

    def truncated(self, n: int) -> Draft:
        """The chain draft cut to its first ``n`` tokens (trees keep nodes whose index < n)."""
        if n >= len(self.tokens):
            return self
        probs = self.probs[:n] if self.probs is not None else None
        parents = self.parents[:n] if self.parents is not None else None
        return Draft(self.tokens[:n], parents, probs, self.score, self.match_len, self.source,
                     self.position)


@dataclass(frozen=True)
class VerifyResult:
    """What the verifier commits for one draft.

    Attributes:
        tokens: Tokens to commit: the accepted draft tokens followed by exactly one token
            chosen by the target (the correction, or the bonus token after a full accept).
        num_accepted: How many draft tokens were accepted (``len(tokens) - 1``).
        accepted_path: Indices into ``draft.tokens`` of the accepted tokens (for trees the
            accepted root-to-node path; for chains ``0..num_accepted-1``).
        exceptions: Mismatching tokens accepted by an approximate verifier.
        regret: Logit regret spent by an approximate verifier.
    """

    tokens: list[int]
    num_accepted: int
    accepted_path: list[int] = field(default_factory=list)
    exceptions: int = 0
    regret: float = 0.0


@dataclass(frozen=True)
class StepStats:
    """One decode step: what was drafted, by whom, and what was committed."""

    source: str
    draft_len: int
    accepted: int
    committed: int
    draft_s: float
    verify_s: float
    offered: int = 0  # draft tokens offered before the draft gate cut them


@dataclass
class RequestStats:
    """Numbers every decode loop reports for one request.

    Attributes:
        prompt_tokens: Tokens in the prompt.
        cached_prompt_tokens: Prompt tokens whose KV was reused from earlier requests
            (not fed to the target; see :mod:`agentspec.targets.cache.prefix_cache`).
        generated_tokens: Tokens committed to the output.
        forwards: Target forward passes (prefill excluded; one per decode step).
        prefill_s: Seconds spent on the prompt forward (reuse included): the time to
            the first decode step.
        draft_s: Seconds spent in drafters.
        verify_s: Seconds spent in target scoring plus verification.
        total_s: Wall-clock seconds of the whole request, prefill included.
        steps: Per-step records.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    forwards: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    exceptions: int = 0
    regret: float = 0.0
    steps: list[StepStats] = field(default_factory=list)

    @property
    def overhead_s(self) -> float:
        """Seconds not spent in prefill, drafting or verification (bookkeeping, decode)."""
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per wall-clock second (prefill included)."""
        return self.generated_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def forwards_per_1k(self) -> float:
        """Target forward passes per 1,000 generated tokens (1,000 for plain decoding)."""
        return 1000.0 * self.forwards / self.generated_tokens if self.generated_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Mean tokens committed per target forward (1.0 for plain decoding)."""
        return self.generated_tokens / self.forwards if self.forwards else 0.0

    def accepted_histogram(self) -> dict[int, int]:
        """Number of steps per accepted-draft-length (0 = the draft's first token was wrong)."""
        return dict(sorted(Counter(s.accepted for s in self.steps).items()))

    def drafter_wins(self) -> dict[str, int]:
        """Number of steps whose draft came from each source."""
        return dict(sorted(Counter(s.source for s in self.steps).items()))

    def merge(self, other: RequestStats) -> None:
        """Add another request's numbers into this one (for per-method aggregates)."""
        for name in ("prompt_tokens", "cached_prompt_tokens", "generated_tokens", "forwards",
                     "exceptions"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("prefill_s", "draft_s", "verify_s", "total_s", "regret"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.steps.extend(other.steps)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (no per-step records)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "forwards": self.forwards,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "forwards_per_1k": round(self.forwards_per_1k, 1),
            "mean_accepted_len": round(self.mean_accepted_len, 3),
            "accepted_histogram": self.accepted_histogram(),
            "drafter_wins": self.drafter_wins(),
            "seconds": {
                "total": round(self.total_s, 4),
                "prefill": round(self.prefill_s, 4),
                "draft": round(self.draft_s, 4),
                "verify": round(self.verify_s, 4),
                "overhead": round(self.overhead_s, 4),
            },
            "exceptions": self.exceptions,
            "regret": round(self.regret, 4),
        }
