"""Greedy traces: what the payoff predictor is trained on.

A trace is one session of a workload replayed with the target's greedy decoding: for every
turn the rendered prompt ids and the greedy output ids. Trace replay
(:mod:`agentspec.training.payoff_replay`) rebuilds the cache drafter's state at every output
position from these alone, so a trace file is all the training needs.

File format (JSON lines, one header then one session per line)::

    {"format": "agentspec-traces/1", "model": ..., "vocab_size": V, "tokenizer": sha}
    {"session_id": ..., "workload": ..., "turns": [{"prompt": [ids], "output": [ids]}, ...]}

The header's ``vocab_size`` and ``tokenizer`` fingerprint are checked against the target the
predictor is trained for: token ids of another tokenizer would replay into meaningless
features, so such a file is refused (:class:`TraceError`) instead of silently trained on.

Traces are generated with the engine and the suffix drafter: its output is token-identical
to greedy decoding (strict verification, fp32) and it decodes the repetitive agent turns
several times faster than one token per forward.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentspec.errors import TrainingDataError
from agentspec.interfaces import ModelTarget
from agentspec.payoff.predictor import tokenizer_fingerprint

FORMAT = "agentspec-traces/1"

__all__ = [
    "FORMAT",
    "SessionSource",
    "Trace",
    "TraceError",
    "TraceSet",
    "TraceSpec",
    "TraceTurn",
    "generate_traces",
    "read_traces",
    "tokenizer_fingerprint",
    "write_traces",
]


class TraceError(TrainingDataError):
    """A trace file is empty, malformed, or was made with another tokenizer."""


@dataclass(frozen=True)
class TraceTurn:
    """One request of a session: prompt ids and the target's greedy output ids."""

    prompt: list[int]
    output: list[int]


@dataclass(frozen=True)
class Trace:
    """One session's greedy turns, in order (later turns see the earlier ones' cache)."""

    session_id: str
    workload: str
    turns: list[TraceTurn] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens over all turns (the replay positions)."""
        return sum(len(t.output) for t in self.turns)


@dataclass(frozen=True)
class TraceSet:
    """Traces plus what they were decoded with.

    Attributes:
        model: Name of the target model.
        vocab_size: The target's vocabulary size.
        tokenizer: Fingerprint of the tokenizer (:func:`tokenizer_fingerprint`).
        traces: One entry per session.
    """

    model: str
    vocab_size: int
    tokenizer: str
    traces: list[Trace]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens over all sessions."""
        return sum(t.num_output_tokens for t in self.traces)


def write_traces(traces: TraceSet, path: Path) -> None:
    """Write ``traces`` atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        header = {"format": FORMAT, "model": traces.model, "vocab_size": traces.vocab_size,
                  "tokenizer": traces.tokenizer}
        f.write(json.dumps(header) + "\n")
        for t in traces.traces:
            turns = [{"prompt": u.prompt, "output": u.output} for u in t.turns]
            f.write(json.dumps({"session_id": t.session_id, "workload": t.workload,
                                "turns": turns}) + "\n")
    tmp.replace(path)


def read_traces(
    path: Path, vocab_size: int | None = None, tokenizer: str | None = None
) -> TraceSet:
    """Read and validate a trace file.

    Args:
        path: The JSON-lines file.
        vocab_size: When given, the file's vocabulary size must equal it and every id
            must be below it.
        tokenizer: When given (and not ``"none"``), the file's tokenizer fingerprint must
            equal it.

    Raises:
        TraceError: missing, empty or malformed file, no output tokens, another tokenizer
            or vocabulary, or token ids out of range. The message names the value.
    """
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    except OSError as exc:
        raise TraceError(f"cannot read trace file {str(path)!r}: {exc}") from None
    if not lines:
        raise TraceError(f"trace file {str(path)!r} is empty")
    try:
        header = json.loads(lines[0])
        rows = [json.loads(ln) for ln in lines[1:]]
    except json.JSONDecodeError as exc:
        raise TraceError(f"trace file {str(path)!r} is not JSON lines: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else header
        raise TraceError(f"trace file {str(path)!r} has format {got!r}, expected {FORMAT!r}")
    file_vocab = header.get("vocab_size")
    if vocab_size is not None and file_vocab != vocab_size:
        raise TraceError(
            f"trace file {str(path)!r} was made with vocab_size={file_vocab!r}; the target "
            f"has {vocab_size} (wrong tokenizer)"
        )
    file_tok = str(header.get("tokenizer", "none"))
    if tokenizer not in (None, "none") and file_tok != tokenizer:
        raise TraceError(
            f"trace file {str(path)!r} was made with tokenizer {file_tok!r}; the target's "
            f"tokenizer is {tokenizer!r}"
        )
    limit = int(file_vocab) if isinstance(file_vocab, int) else None
    traces = [_parse_row(row, i + 2, path, limit) for i, row in enumerate(rows)]
    out = TraceSet(str(header.get("model", "?")), int(file_vocab or 0), file_tok, traces)
    if out.num_output_tokens == 0:
        raise TraceError(f"trace file {str(path)!r} holds no output tokens ({len(traces)} "
                         "sessions): nothing to replay")
    return out


def _parse_row(row: Any, line: int, path: Path, vocab: int | None) -> Trace:
    where = f"{str(path)!r} line {line}"
    if not isinstance(row, dict) or not isinstance(row.get("turns"), list):
        raise TraceError(f"trace {where} is not a session object with a 'turns' list")
    turns = []
    for j, turn in enumerate(row["turns"]):
        ids: dict[str, list[int]] = {}
        for key in ("prompt", "output"):
            val = turn.get(key) if isinstance(turn, dict) else None
            if not isinstance(val, list) or not all(isinstance(x, int) for x in val):
                raise TraceError(f"trace {where} turn {j}: {key!r} must be a list of ints")
            bad = [x for x in val if x < 0 or (vocab is not None and x >= vocab)]
            if bad:
                raise TraceError(
                    f"trace {where} turn {j}: token id {bad[0]} outside [0, {vocab})"
                )
            ids[key] = list(val)
        if not ids["prompt"]:
            raise TraceError(f"trace {where} turn {j}: empty prompt")
        turns.append(TraceTurn(ids["prompt"], ids["output"]))
    return Trace(str(row.get("session_id", f"line{line}")), str(row.get("workload", "?")), turns)


@dataclass(frozen=True)
class TraceSpec:
    """Which greedy traces to generate (bounded: the CPU decodes ~15-25 tokens/s).

    Attributes:
        workloads: Workload names (the ``workflows`` harness's).
        limit: Sessions per workload.
        turns: Turns per session.
        max_tokens: Cap on each turn's generation budget.
        max_total_tokens: Stop generating once this many output tokens are traced.
        data_dir: Workload data folder (``None``: the workflows' default).
        exclude: Session ids never traced. The shipped predictor excludes every session
            ``make bench`` measures (:meth:`SessionSource.bench_ids`), so its benchmark figures are
            on sessions it never saw.
    """

    workloads: tuple[str, ...] = ("delegate52", "tool_agent", "chat", "editeval")
    limit: int = 6
    turns: int = 2
    max_tokens: int = 128
    max_total_tokens: int = 3200
    data_dir: str | None = None
    exclude: tuple[str, ...] = ()

    def cache_key(self, model: str, tokenizer: str) -> str:
        """A file name identifying these traces for one model and tokenizer."""
        blob = json.dumps([model, tokenizer, list(self.workloads), self.limit, self.turns,
                           self.max_tokens, self.max_total_tokens, self.data_dir]
                          + ([sorted(self.exclude)] if self.exclude else []))
        return f"traces-{hashlib.sha256(blob.encode()).hexdigest()[:12]}.jsonl"


class SessionSource(Protocol):
    """Where the sessions to trace come from (the workloads of ``workflows``, handed in by
    the ``agentspec`` console script: training never imports the benchmark harness).

    A session is any object with ``session_id`` and ``next_request(last_answer)``, which
    returns the next request (``messages``, ``tools``, ``max_tokens``, ``stop`` and an
    optional ``prefix``) or ``None`` when the session is over.
    """

    def select(self, spec: TraceSpec) -> list[list[tuple[str, Any]]]:
        """Per workload of ``spec``, ``(workload, session)`` pairs: at most ``spec.limit``
        sessions of ``spec.turns`` turns, none of ``spec.exclude``."""
        ...

    def bench_ids(self, workloads: Sequence[str]) -> tuple[str, ...]:
        """Ids of the sessions the benchmarks measure (left out of training)."""
        ...


def generate_traces(
    target: ModelTarget,
    spec: TraceSpec,
    sessions: Sequence[Sequence[tuple[str, Any]]],
    progress: bool = True,
) -> TraceSet:
    """Decode ``sessions`` greedily and record every turn's ids.

    Sessions of different workloads are interleaved round-robin so the token budget is
    shared fairly when it runs out. The decoder comes from the one factory
    (:mod:`agentspec.factory`) with the session-cache drafter and strict greedy
    verification, so the traces are token-identical to greedy decoding.

    Args:
        target: An :class:`~agentspec.targets.hf.HFTarget` (needs a tokenizer).
        spec: Token budgets (``max_tokens``, ``max_total_tokens``).
        sessions: Per workload, ``(workload, session)`` pairs
            (:meth:`SessionSource.select`).
        progress: Show a tqdm bar over output tokens.
    """
    from tqdm import tqdm

    from agentspec.chat.api import chat_prompt_ids
    from agentspec.factory import build_drafter, build_engine
    from agentspec.spec import AgentSpec, DraftingPolicy
    from agentspec.tokens import eos_ids
    from agentspec.types import SessionRef

    tok = target.tokenizer
    # Chain drafts: the predictor rates one cache chain per step (HVD's cache drafts).
    agent = AgentSpec(drafting=DraftingPolicy(method="suffix", max_draft=16, tree=False))
    engine = build_engine(
        agent, target, build_drafter(agent, target),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True), eos_token_ids=eos_ids(tok),
    )
    traces: list[Trace] = []
    total = 0
    bar = tqdm(total=spec.max_total_tokens, desc="greedy traces", unit="tok",
               disable=not progress, file=sys.stderr)
    for wl_name, sess in _round_robin(sessions):
        if total >= spec.max_total_tokens:
            break
        ref = SessionRef(re.sub(r"[^A-Za-z0-9_.:@-]", "_", f"trace-{sess.session_id}")[:128])
        trace = Trace(sess.session_id, wl_name)
        last: str | None = None
        while total < spec.max_total_tokens and (req := sess.next_request(last)) is not None:
            # As the harness does: a request may open the assistant turn (e.g. a fence).
            prefix = str(getattr(req, "prefix", "") or "")
            prompt, _ = chat_prompt_ids(tok, req.messages, req.tools, None, prefix)
            budget = min(req.max_tokens, spec.max_tokens)
            gen = engine.generate(prompt, budget, req.stop, session=ref)
            trace.turns.append(TraceTurn(list(prompt), list(gen.tokens)))
            total += len(gen.tokens)
            bar.update(len(gen.tokens))
            last = prefix + gen.text
        if trace.turns:
            traces.append(trace)
    bar.close()
    return TraceSet(target.name, target.vocab_size, tokenizer_fingerprint(tok), traces)


def _round_robin(queues: Sequence[Sequence[tuple[str, Any]]]) -> Iterable[tuple[str, Any]]:
    """Items of the queues interleaved: q0[0], q1[0], ..., q0[1], q1[1], ..."""
    for i in range(max((len(q) for q in queues), default=0)):
        for q in queues:
            if i < len(q):
                yield q[i]
