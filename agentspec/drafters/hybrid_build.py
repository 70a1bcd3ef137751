"""Building HVD for a loaded target: the model drafter, then the hybrid around it.

:func:`load_model_drafter` finds the model drafter a target should use (a causal LM when
named, else the target's trained EAGLE head, else the shipped distilled drafter);
:func:`build_hybrid` assembles a :class:`~agentspec.drafters.hybrid.HybridDrafter` from it,
the session cache and a source policy. The policy, the shipped predictor and the token
table come from :mod:`agentspec.payoff.defaults`: the drafters use HVD's payoff half, never
the other way round (``.importlinter`` checks it).
"""

from __future__ import annotations

from agentspec.drafters.gate import DraftGate
from agentspec.drafters.hybrid import HybridDrafter
from agentspec.drafters.suffix.drafter import SuffixDrafter
from agentspec.errors import AgentSpecError
from agentspec.interfaces import Drafter, Target
from agentspec.payoff.defaults import make_policy, token_table
from agentspec.payoff.predictor import PayoffPredictor

__all__ = ["DrafterUnavailableError", "build_hybrid", "load_model_drafter"]


class DrafterUnavailableError(AgentSpecError):
    """The model drafter (its code or its trained artifact) is not available."""


def load_model_drafter(target: Target, model: str | None = None, max_tokens: int = 6) -> Drafter:
    """The model drafter: ``model`` (a causal LM folder / embedded name) when given, else
    the trained EAGLE head for ``target`` (``agentspec.drafters.model.eagle``), else the
    distilled drafter (``agentspec.drafters.model.distilled``).

    Raises:
        DrafterUnavailableError: no EAGLE head and no distilled drafter for this target
            (the message says how to build one).
    """
    if model is not None:
        from agentspec.drafters.model.causal import ModelDrafter, ModelDrafterConfig

        # The draft model runs where the target does (the target owns the device).
        return ModelDrafter.load(model, ModelDrafterConfig(max_tokens=max_tokens),
                                 vocab_size=target.vocab_size,
                                 device=str(getattr(target, "device", "cpu")))
    from agentspec.drafters.model.eagle import EagleConfig, eagle_path, load_eagle

    path = eagle_path(target.name)
    if path is not None:
        try:
            return load_eagle(target, path, EagleConfig(max_tokens=max_tokens))
        except AgentSpecError as exc:
            raise DrafterUnavailableError(
                f"the EAGLE head {path} could not be loaded: {exc} "
                "(retrain it with `agentspec train-drafter`)"
            ) from None
    from agentspec.drafters.model import distilled
    from agentspec.drafters.model.causal import ModelDrafterConfig

    try:
        drafter: Drafter = distilled.load_default_drafter(
            target, ModelDrafterConfig(max_tokens=max_tokens)
        )
    except (OSError, AgentSpecError) as exc:
        raise DrafterUnavailableError(
            f"no model drafter for this target: no EAGLE head, and the distilled drafter "
            f"could not be loaded: {exc} (run `agentspec train-drafter`)"
        ) from None
    return drafter


def build_hybrid(
    target: Target,
    policy: str = "cost_aware",
    cache: Drafter | None = None,
    model: Drafter | None = None,
    predictor: PayoffPredictor | None = None,
    model_max: int = 6,
    gate: DraftGate | None = None,
) -> HybridDrafter:
    """A :class:`HybridDrafter` for ``target`` with the named policy.

    Args:
        target: The loaded target (vocabulary, tokenizer and c(k)).
        policy: ``cost_aware`` (default), ``threshold`` (paper HVD) or ``arctic_rule``.
        cache: The cache drafter (a fresh :class:`SuffixDrafter` when ``None``).
        model: The model drafter (:func:`load_model_drafter` when ``None``).
        predictor: The payoff predictor (the shipped default when ``None``).
        model_max: Most tokens the model drafter drafts per step.
        gate: Draft gate for the cache's drafts (``None``: the policy alone cuts them).

    Raises:
        DrafterUnavailableError: no model drafter given and none can be loaded.
        PredictorError: the predictor does not fit ``target``.
    """
    # The model drafter first: a missing drafter artifact is the likelier, bigger problem.
    model = model or load_model_drafter(target, max_tokens=model_max)
    pol = make_policy(policy, target, predictor)
    table = token_table(target) if pol.needs_features else None
    # Each tenant learns its own policy estimates; the (read-only) predictor is shared.
    pred = getattr(pol, "predictor", None)
    return HybridDrafter(
        cache or SuffixDrafter(), model, pol, table, model_max=model_max,
        name=policy if policy == "arctic_rule" else "hybrid",
        policy_factory=lambda: make_policy(policy, target, pred), gate=gate,
    )
