"""Logged agent runs as driven sessions for the vLLM bench (``--workloads traces``).

The same selection as ``agentspec drive`` (:func:`workflows.bench.driven.select_turns`):
every logged run (the packaged SWE-agent trajectories by default) is a session, in file
order, cut at its first turn whose prompt plus answer exceeds ``max_prompt``, at most
``turns`` turns in all. Each session is a chain of requests whose prompts are the logged
turn prompts (token ids, the logged history re-sent whole as an agent platform does); the
model writes its own answer to each (greedy), which the next logged prompt does not hold.
:func:`workflows.bench.vllm_concurrency.run_concurrent` runs the chains: one request per
session in flight, ``concurrency`` sessions at once, sessions started in file order.

:func:`draftable_content` says, from one run's outputs, where the answers' tokens could be
drafted from: the request itself, earlier answers (vLLM's suffix method keeps every answer
in one global tree) or only earlier *prompts* of other sessions (which only agentspec's
tenant-scoped session cache indexes) -- the content that can make the two proposers differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from agentspec.types import SessionRef
from workflows.bench.driven import driven_turns
from workflows.bench.driven_sources import LoggedSession, logged_sessions
from workflows.replay.logs import PACKAGED_TRACES

WORKLOAD = "traces"


def driven_sessions(
    tokenizer: Any,
    traces: Sequence[str | Path] = (PACKAGED_TRACES,),
    max_prompt: int = 2560,
    max_tokens: int = 64,
    turns: int = 30,
) -> list[LoggedSession]:
    """The selected turns of every logged run, grouped per run (file order kept).

    Raises:
        BenchmarkError: no logged turn fits ``max_prompt``.
        TraceFormatError: see :func:`workflows.replay.logs.load_sessions`.
    """
    return logged_sessions(driven_turns(traces, tokenizer, max_prompt, max_tokens, turns),
                           max_tokens)


def driven_jobs(chains: Sequence[LoggedSession],
                tenant: str) -> list[tuple[str, SessionRef, LoggedSession]]:
    """``run_concurrent`` jobs: every chain under ``tenant`` (one tenant: the sessions may
    draft from each other, as one team's agent runs do), its logged session id kept."""
    return [(WORKLOAD, SessionRef(c.session.ref.session_id, tenant, c.session.ref.agent), c)
            for c in chains]


def _grams(tokens: Sequence[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(tokens[j : j + n]) for j in range(len(tokens) - n + 1)}


def draftable_content(
    chains: Sequence[LoggedSession], turns: Sequence[dict[str, Any]], n: int = 4
) -> dict[str, Any]:
    """Where the answers' tokens could be drafted from, in one run of the chains.

    Answer token ``j`` counts as draftable from a source when the ``n`` tokens before it
    (prompt and answer so far) followed by it occur in that source. Sources, in this order
    (a token counts for the first that has it): ``own`` (the request's prompt and answer
    so far), ``earlier_answers`` (answers of every turn finished before this one started,
    any session: vLLM's suffix method and agentspec's cache both hold them),
    ``other_prompts`` (prompts of other sessions' turns finished before: only agentspec's
    tenant-scoped cache indexes them). ``launched_after`` of a turn record (finished turns
    when it was sent) gives "before".

    Args:
        chains: The sessions that were run (their prompts).
        turns: ``run_concurrent``'s turn records (finish order), with ``launched_after``.
        n: Context length of a match.

    Returns:
        Token counts and shares per source, and ``answer_tokens``.
    """
    prompts = {(c.session.ref.session_id, k + 1): c.session.turns[i].prompt
               for c in chains for k, i in enumerate(c.turn_indices)}
    counts = {"own": 0, "earlier_answers": 0, "other_prompts": 0, "none": 0}
    total = 0
    for rec in turns:
        key = (rec["session_id"], rec["turn"])
        prompt, answer = prompts[key], list(rec["tokens"])
        before = turns[: rec["launched_after"]]
        answers = set().union(*(_grams(t["tokens"], n + 1) for t in before))
        others = set().union(*(_grams(prompts[(t["session_id"], t["turn"])], n + 1)
                               for t in before if t["session_id"] != rec["session_id"]))
        seq = list(prompt) + answer
        own: set[tuple[int, ...]] = _grams(prompt, n + 1)
        for j in range(len(prompt), len(seq)):
            gram = tuple(seq[j - n : j + 1])
            total += 1
            source = ("own" if gram in own else "earlier_answers" if gram in answers
                      else "other_prompts" if gram in others else "none")
            counts[source] += 1
            own.add(gram)  # the answer so far is the request's own content from here on
    return {"n": n, "answer_tokens": total, **{f"{k}_tokens": v for k, v in counts.items()},
            **{f"{k}_share": round(v / total, 4) if total else 0.0 for k, v in counts.items()}}


def session_names(chains: Iterable[LoggedSession]) -> list[dict[str, Any]]:
    """Each driven session's name, id and selected turns (for the report)."""
    return [{"name": c.session.name, "session_id": c.session.ref.session_id,
             "turns": list(c.turn_indices),
             "prompt_tokens": [len(c.session.turns[i].prompt) for i in c.turn_indices]}
            for c in chains]
