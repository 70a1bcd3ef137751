"""``agentspec replay``: what a drafter would accept on real agent logs, with no model.

Every assistant message of every agent run is replayed as one request (see
:mod:`workflows.replay.logs`). The target is taken to be the model that wrote the log, so
its greedy continuation at every position *is* the logged answer: a step drafts from the
context, accepts the draft's common prefix with the real answer, then one more token (the
target's own), and commits them (``observe``); the next step drafts again. A finished turn
is handed to ``finish`` and the next turn of the session starts, as in a live agent.

Methods (each a fresh drafter, all fed the same turns, interleaved turn by turn so machine
load hits them alike):

* ``agentspec``: exactly what ``build_drafter(AgentSpec())`` returns - the product's
  default drafter through the factory that ``Runtime`` uses (greedy requests: one token
  tree merging every index's continuations, branches verified together, the longest
  accepted branch kept);
* ``suffix``: the session cache limited to its session's history (``scope="session"``);
* ``suffix_python``: the default drafter on the pure-Python index (no arctic-inference);
* ``suffix_chain``: the default drafter drafting chains (the best index's draft), as it
  does for sampled requests and inside vLLM;
* ``arctic_suffix``: arctic-inference's ``SuffixDecodingCache``, one per tenant, driven as
  vLLM's suffix proposer drives it (:class:`~agentspec.drafters.arctic.ArcticSuffixDrafter`);
* ``prompt_lookup``: n-gram lookup in the request;
* ``oracle``: drafts the real answer (the upper bound: ``max_draft + 1`` tokens per step);
* ``ceiling_session`` / ``ceiling_tenant``: the copy ceiling (:mod:`workflows.replay.ceiling`):
  at every step the longest continuation of the real answer found verbatim in what the
  session's (or the tenant's) cache could hold. Every row's ``ceiling_share`` is its
  accepted length over ``ceiling_tenant``'s when that method ran: how much of the copyable
  text the drafter's choice finds;
* ``ceiling_match<k>`` (e.g. ``ceiling_match2``): the tenant ceiling restricted to copies
  that follow an occurrence of the context's last ``k`` tokens, the occurrence picked by an
  oracle: the bound of any drafter that continues a ``k``-token matched context;
* ``none``: no drafter (1 token per step, speed-up 1.0).

``draft_us_p50`` / ``draft_us_p95`` time ``propose`` + ``observe`` of one step (the first
step of a request includes building or extending its index); ``finish_us_mean`` times the
end of a request (moving it into the history), once per turn.
``est_speedup`` = ``tokens * c(1) / sum(c(draft_len + 1) + draft time)`` with the target's
measured verification cost ``c(k)`` (``HFTarget.cost_curve``, cached under
``$AGENTSPEC_HOME/costs``); ``est_speedup_gpu`` assumes a flat cost per step
(``--gpu-step-ms``, as on a GPU where verifying 33 tokens costs about one decode step).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentspec.drafters import PromptLookupDrafter, SuffixConfig, SuffixDrafter
from agentspec.drafters.arctic import ArcticSuffixDrafter
from agentspec.drafters.oracle import OracleDrafter
from agentspec.errors import ConfigError
from agentspec.factory import build_drafter
from agentspec.interfaces import Drafter
from agentspec.spec import AgentSpec
from agentspec.types import Draft, DraftContext, VerifyResult
from workflows.replay.ceiling import MATCH_PREFIX, CopyCeilingDrafter, MatchedCopyCeilingDrafter
from workflows.replay.logs import PACKAGED_TRACES, ReplaySession, ReplayTurn, load_sessions
from workflows.report.markdown import markdown_table

METHODS = ("agentspec", "suffix", "suffix_python", "suffix_chain", "arctic_suffix",
           "prompt_lookup", "oracle", "ceiling_session", "ceiling_tenant", "ceiling_match1",
           "ceiling_match2", "none")
DEFAULT_METHODS = ("agentspec,suffix,suffix_chain,arctic_suffix,prompt_lookup,oracle,"
                   "ceiling_session,ceiling_tenant,ceiling_match2,none")


def _match_k(method: str) -> int | None:
    """``k`` of a ``ceiling_match<k>`` method name (any ``k >= 1``), else None."""
    digits = method.removeprefix(MATCH_PREFIX)
    if method.startswith(MATCH_PREFIX) and digits.isdigit() and int(digits) >= 1:
        return int(digits)
    return None


def check_method(method: str) -> None:
    """Raise :class:`ConfigError` naming ``method`` unless it is a replay method."""
    if method not in METHODS and _match_k(method) is None:
        raise ConfigError(f"unknown replay method {method!r}; choose from "
                          f"{', '.join(METHODS)} (or ceiling_match<k>, k >= 1)")


def make_drafter(method: str, max_draft: int) -> Drafter | None:
    """A fresh drafter for ``method`` (``None`` for ``"none"``).

    Raises:
        ConfigError: an unknown method.
    """
    if method == "agentspec":
        return build_drafter(AgentSpec())
    if method == "suffix":
        return SuffixDrafter(SuffixConfig(scope="session", max_tokens=max_draft))
    if method == "suffix_python":
        return SuffixDrafter(SuffixConfig(max_tokens=max_draft, backend="python", tree=True))
    if method == "suffix_chain":
        return SuffixDrafter(SuffixConfig(max_tokens=max_draft, tree=False))
    if method == "arctic_suffix":
        return ArcticSuffixDrafter()
    if method == "prompt_lookup":
        return PromptLookupDrafter()
    if method == "oracle":
        return OracleDrafter()
    k = _match_k(method)
    if k is not None:
        return MatchedCopyCeilingDrafter(k)
    if method in ("ceiling_session", "ceiling_tenant"):
        return CopyCeilingDrafter(method.removeprefix("ceiling_"))
    check_method(method)
    return None


def accepted(draft: Draft, truth: Sequence[int]) -> tuple[int, list[int]]:
    """Greedy acceptance of ``draft`` against the true continuation: ``(accepted, path)``.

    For a tree draft every branch is checked and the longest accepted one kept (what a
    tree verifier commits); a chain is its one branch.
    """
    best: list[int] = []
    for path in draft.branches():
        n = 0
        while n < len(path) and n < len(truth) and draft.tokens[path[n]] == truth[n]:
            n += 1
        if n > len(best):
            best = path[:n]
    return len(best), best


@dataclass
class MethodRun:
    """One method's drafter and its counters over the replay."""

    method: str
    drafter: Drafter | None
    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_units: list[int] = field(default_factory=list)  # draft_len + 1 per step
    step_ns: list[int] = field(default_factory=list)
    finish_ns: list[int] = field(default_factory=list)  # finish() per turn (history upkeep)

    def replay_turn(self, prompt: list[int], output: list[int], ctx_args: dict[str, Any],
                    max_draft: int) -> None:
        """Decode one turn along the real answer, timing ``propose`` + ``observe``."""
        d = self.drafter
        if isinstance(d, OracleDrafter):  # the oracle and the copy ceilings
            d.add(prompt, output)
        tokens, plen, pos, step = list(prompt), len(prompt), 0, 0
        clock = time.perf_counter_ns
        while pos < len(output):
            truth = output[pos:]
            if d is None:
                commit, n_draft, n_acc, dt = truth[:1], 0, 0, 0
            else:
                ctx = DraftContext(tokens, plen, step=step, **ctx_args)
                t0 = clock()
                draft = d.propose(ctx, max_draft)
                t1 = clock()
                n_acc, path = accepted(draft, truth)
                commit = truth[: n_acc + 1]
                result = VerifyResult(commit, n_acc, path)
                t2 = clock()
                d.observe(ctx, result)
                dt = (t1 - t0) + (clock() - t2)
                n_draft = len(draft.tokens)
            self.step_ns.append(dt)
            self.verify_units.append(n_draft + 1)
            self.drafted += n_draft
            self.accepted += n_acc
            self.steps += 1
            self.tokens += len(commit)
            tokens.extend(commit)
            pos += len(commit)
            step += 1
        if d is not None:
            t0 = clock()
            d.finish(DraftContext(tokens, plen, step=step, **ctx_args))
            self.finish_ns.append(clock() - t0)
            if isinstance(d, OracleDrafter):
                d.references.clear()


def _pct(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] / 1e3


def _memory(drafter: Drafter | None) -> tuple[int | None, float | None]:
    """Bytes the drafter's indexes hold and bytes per indexed token, where it reports them."""
    if isinstance(drafter, SuffixDrafter):
        st = drafter.stats()
        return int(st["memory_bytes"]), round(float(st["bytes_per_indexed_token"]), 1)
    if isinstance(drafter, ArcticSuffixDrafter):
        mem = drafter.memory_bytes()
        return mem, round(mem / drafter.cached_tokens, 1) if drafter.cached_tokens else None
    return None, None


def method_row(run: MethodRun, sessions: int, turns: int, cost: Callable[[int], float] | None,
              gpu_step_s: float) -> dict[str, Any]:
    """The result row of one method (field meanings in the module docstring)."""
    draft_s = sum(run.step_ns) / 1e9
    est = None
    if cost is not None:
        spec = sum(cost(k) for k in run.verify_units) + draft_s
        est = round(run.tokens * cost(1) / spec, 3) if spec else None
    gpu = run.tokens * gpu_step_s / (run.steps * gpu_step_s + draft_s) if run.steps else None
    mem, per_token = _memory(run.drafter)
    return {
        "method": run.method,
        "sessions": sessions,
        "turns": turns,
        "tokens": run.tokens,
        "steps": run.steps,
        "mean_accepted_len": round(run.tokens / run.steps, 3) if run.steps else 0.0,
        "draft_acceptance": round(run.accepted / run.drafted, 4) if run.drafted else 0.0,
        "drafted_per_token": round(run.drafted / run.tokens, 3) if run.tokens else 0.0,
        "draft_us_p50": round(_pct(run.step_ns, 0.50), 1),
        "draft_us_p95": round(_pct(run.step_ns, 0.95), 1),
        "draft_us_mean": round(statistics.fmean(run.step_ns) / 1e3, 1) if run.step_ns else 0.0,
        "finish_us_mean": (round(statistics.fmean(run.finish_ns) / 1e3, 1)
                           if run.finish_ns else 0.0),
        "est_speedup": est,
        "est_speedup_gpu": round(gpu, 3) if gpu is not None else None,
        "memory_bytes": mem,
        "bytes_per_indexed_token": per_token,
    }


def with_preamble(sessions: Sequence[ReplaySession], tokens: int) -> list[ReplaySession]:
    """Prefix every prompt of a session with the same ``tokens``-token preamble, so each
    request drafts against a history of at least that length, as an agent resending a
    large repository context does. The preamble is the other sessions' *first* prompts
    (system prompt, tool documentation, task), never their answers, so it does not leak
    outputs; turns of a session still extend each other."""
    if tokens <= 0:
        return list(sessions)
    out = []
    for i, s in enumerate(sessions):
        pool: list[int] = []
        for other in [*sessions[i + 1 :], *sessions[:i]] or [s]:
            pool.extend(other.turns[0].prompt)
            if len(pool) >= tokens:
                break
        while pool and len(pool) < tokens:  # fewer tokens than asked: repeat them
            pool.extend(pool[: tokens - len(pool)])
        pre = pool[:tokens]
        out.append(ReplaySession(s.name, s.ref, [ReplayTurn(pre + t.prompt, t.output)
                                                 for t in s.turns]))
    return out


def replay_sessions(
    sessions: Sequence[ReplaySession],
    methods: Sequence[str],
    max_draft: int = 32,
    cost: Callable[[int], float] | None = None,
    gpu_step_s: float = 0.015,
    progress: bool = False,
    context_tokens: int = 0,
) -> list[dict[str, Any]]:
    """Replay ``sessions`` (in order) through every method; one result row per method.

    ``context_tokens`` > 0 prefixes each session's prompts with a preamble of that many
    tokens (see :func:`with_preamble`).

    Raises:
        ConfigError: an unknown method or ``max_draft < 1``.
    """
    if max_draft < 1:
        raise ConfigError(f"max_draft must be >= 1, got {max_draft}")
    sessions = with_preamble(sessions, context_tokens)
    runs = [MethodRun(m, make_drafter(m, max_draft)) for m in methods]
    total = sum(len(t.output) for s in sessions for t in s.turns)
    from tqdm import tqdm

    turns = 0
    with tqdm(total=total * len(runs), desc="replay", unit="tok", disable=not progress) as bar:
        for s in sessions:
            for i, turn in enumerate(s.turns):
                args = {"session": s.ref, "request_id": f"{s.ref.session_id}#{i}"}
                for run in runs:  # interleaved: load on the machine hits every method alike
                    run.replay_turn(turn.prompt, turn.output, args, max_draft)
                    bar.update(len(turn.output))
                turns += 1
    rows = [method_row(r, len(sessions), turns, cost, gpu_step_s) for r in runs]
    ceiling = next((r["mean_accepted_len"] for r in rows if r["method"] == "ceiling_tenant"), 0)
    for r in rows:
        r["ceiling_share"] = round(r["mean_accepted_len"] / ceiling, 3) if ceiling else None
    return rows


def measured_cost(model: str | None) -> tuple[Callable[[int], float], dict[int, float], str]:
    """The target's ``verify_cost`` (measured once, cached under ``$AGENTSPEC_HOME``)."""
    from agentspec.targets.hf import HFTarget, TargetConfig

    target = HFTarget.load(TargetConfig(model=model, device="cpu"))
    curve = target.cost_curve()
    return target.verify_cost, curve, target.name


def curve_cost(curve: dict[int, float]) -> Callable[[int], float]:
    """``c(k)`` interpolated linearly between measured points (extrapolated past the last).

    Raises:
        ConfigError: fewer than two points, or a non-positive cost.
    """
    pts = sorted((int(k), float(v)) for k, v in curve.items())
    if len(pts) < 2 or any(k < 1 or v <= 0 for k, v in pts):
        raise ConfigError(f"a cost curve needs >= 2 points k >= 1 with costs > 0, got {curve}")

    def cost(k: int) -> float:
        if k <= pts[0][0]:
            return pts[0][1]
        for (k0, c0), (k1, c1) in itertools.pairwise(pts):
            if k <= k1:
                return c0 + (c1 - c0) * (k - k0) / (k1 - k0)
        (k0, c0), (k1, c1) = pts[-2], pts[-1]
        return c1 + (c1 - c0) / (k1 - k0) * (k - k1)

    return cost


def read_curve(path: Path) -> dict[int, float]:
    """A cost curve JSON (``{"costs": {"k": seconds}}``, the format of the cost cache).

    Raises:
        ConfigError: unreadable file or bad contents.
    """
    import json

    try:
        data = json.loads(Path(path).read_text())
        curve = {int(k): float(v) for k, v in data["costs"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: not a cost curve ({{\"costs\": {{k: s}}}}): {exc}") from None
    try:
        curve_cost(curve)  # validates
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return curve


def load_tokenizer(model: str | None) -> Any:
    """The target's tokenizer (its chat template renders the logs)."""
    from transformers import AutoTokenizer

    from agentspec.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model).path)


def run_replay(
    paths: Sequence[str | Path] | None = None,
    methods: Sequence[str] = tuple(DEFAULT_METHODS.split(",")),
    *,
    max_draft: int = 32,
    model: str | None = None,
    costs: bool = True,
    gpu_step_ms: float = 15.0,
    tenant: str = "default",
    agent: str = "default",
    progress: bool = True,
    context_tokens: int = 0,
    cost_curve: Path | None = None,
) -> dict[str, Any]:
    """Load logs, replay them through ``methods``; the JSON report.

    Args:
        paths: Log files / folders (default: the packaged SWE-agent trajectories).
        methods: Method names (see :data:`METHODS`).
        max_draft: Longest draft per step.
        model: The target (embedded model by default): its chat template and c(k).
        costs: Measure / load the target's c(k) for ``est_speedup`` (else it is null).
        gpu_step_ms: The flat per-step cost of ``est_speedup_gpu``.
        tenant: Tenant of runs that do not name one.
        agent: Agent of runs that do not name one.
        progress: Show a progress bar.
        context_tokens: Prefix each session's prompts with this many tokens of the other
            sessions' text (drafting cost on long histories).
        cost_curve: A cost curve JSON to use instead of measuring the target (a curve
            measured on a quiet machine: measuring under load gives nonsense).
    """
    for m in methods:
        check_method(m)
    if gpu_step_ms <= 0:
        raise ConfigError(f"gpu_step_ms must be > 0, got {gpu_step_ms}")
    paths = list(paths) if paths else [PACKAGED_TRACES]
    sessions = load_sessions(paths, load_tokenizer(model), tenant=tenant, agent=agent)
    cost, curve, name = (None, None, None)
    if cost_curve is not None:
        curve = read_curve(cost_curve)
        cost = curve_cost(curve)
    elif costs:
        cost, curve, name = measured_cost(model)
    results = replay_sessions(sessions, methods, max_draft, cost, gpu_step_ms / 1e3, progress,
                              context_tokens)
    return {
        "config": {"paths": [str(p) for p in paths], "max_draft": max_draft,
                   "target": name or (model or "embedded"), "gpu_step_ms": gpu_step_ms,
                   "context_tokens": context_tokens,
                   "cost_curve_s": curve},
        "results": results,
    }


COLUMNS = (("method", "method"), ("mean_accepted_len", "acc len"),
           ("ceiling_share", "of ceiling"),
           ("draft_acceptance", "draft acc"), ("drafted_per_token", "drafted/tok"),
           ("draft_us_p50", "us p50"), ("draft_us_p95", "us p95"),
           ("est_speedup", "est x (c(k))"), ("est_speedup_gpu", "est x (flat)"),
           ("bytes_per_indexed_token", "B/token"))


def replay_table(results: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the result rows."""
    table = markdown_table([h for _, h in COLUMNS], [
        ["-" if r.get(k) is None else str(r[k]) for k, _ in COLUMNS] for r in results
    ])
    first = results[0] if results else {}
    foot = (f"\n{first.get('sessions', 0)} sessions, {first.get('turns', 0)} turns, "
            f"{first.get('tokens', 0)} output tokens")
    return table + foot
