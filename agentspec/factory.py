"""The one factory: an :class:`~agentspec.spec.AgentSpec` -> drafter + verifier + engine.

Everything that decodes for an agent builds its parts here, so what the benchmarks and the
trace replay measure is what the product ships: :class:`~agentspec.runtime.Runtime`, the
vLLM backend, the benchmark methods, the CLI and the trace generator all call
:func:`build_drafter` / :func:`build_engine`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from agentspec.drafters import PromptLookupDrafter, SuffixConfig, SuffixDrafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import AgentSpecError, ConfigError
from agentspec.interfaces import Drafter, Verifier
from agentspec.spec import AgentSpec
from agentspec.verifiers import build_verifier


def suffix_drafter(spec: AgentSpec, store: Any | None = None) -> SuffixDrafter:
    """The session-cache drafter of ``spec``'s drafting policy (scope, draft length, store)."""
    d = spec.drafting
    return SuffixDrafter(SuffixConfig(scope=d.scope, max_tokens=d.max_draft), store=store)


def build_drafter(
    spec: AgentSpec, target: Any | None = None, store: Any | None = None
) -> Drafter | None:
    """The drafter ``spec`` asks for (``None`` for ``method="none"``).

    Args:
        spec: The agent's policy.
        target: The loaded target; needed by the model drafter and HVD (``model`` /
            ``hybrid``), not by the cache drafters.
        store: Session store the session cache persists to (``None``: in memory only).

    Raises:
        ConfigError: unknown method, or a model-based method without a target or whose
            drafter / predictor cannot be loaded.
    """
    d = spec.drafting
    if d.method == "none":
        return None
    if d.method == "prompt_lookup":
        return PromptLookupDrafter()
    if d.method == "suffix":
        return suffix_drafter(spec, store)
    if d.method == "arctic_suffix":
        from agentspec.drafters import ArcticSuffixDrafter

        return ArcticSuffixDrafter()
    if d.method in ("model", "hybrid"):
        if target is None:
            raise ConfigError(f"drafting method {d.method!r} needs a loaded target")
        from agentspec.payoff.defaults import build_hybrid, load_model_drafter

        try:
            model = load_model_drafter(target, d.draft_model)
            if d.method == "model":
                return model
            return build_hybrid(target, "cost_aware", cache=suffix_drafter(spec, store),
                                model=model)
        except AgentSpecError as exc:
            raise ConfigError(f"drafting method {d.method!r}: {exc}") from None
    raise ConfigError(f"drafting method {d.method!r} is not available in this build")


def build_engine(
    spec: AgentSpec,
    target: Any,
    drafter: Drafter | None,
    *,
    decode: Callable[[Sequence[int]], str] | None = None,
    eos_token_ids: Sequence[int] = (),
    verifier: Verifier | None = None,
) -> SpeculativeDecoder:
    """A decoder for ``spec`` over ``target`` drafting with ``drafter``.

    Args:
        spec: The agent's policy (verifier and draft length).
        target: The loaded target.
        drafter: The (shared, stateful) drafter, from :func:`build_drafter`.
        decode: Token ids -> text (stop strings, streaming).
        eos_token_ids: Tokens that end a request.
        verifier: Overrides the verifier ``spec.verifier`` asks for.
    """
    return SpeculativeDecoder(
        target, drafter, verifier or build_verifier(spec.verifier), decode=decode,
        eos_token_ids=eos_token_ids, config=EngineConfig(max_draft=spec.drafting.max_draft),
    )
