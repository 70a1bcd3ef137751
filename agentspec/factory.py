"""The one factory: an :class:`~agentspec.spec.AgentSpec` -> drafter + verifier + engine.

Everything that decodes for an agent builds its parts here, so what the benchmarks and the
trace replay measure is what the product ships: :class:`~agentspec.runtime.Runtime`, the
vLLM backend (its agentspec proposer's drafter, the suffix settings of vLLM's own suffix
method), the benchmark methods (``workflows.bench.methods``), the CLI and the trace generator
all call :func:`build_drafter` / :func:`build_engine`.

Every field of the spec that is accepted is read here:

* ``drafting.method / max_draft / scope / draft_model / tree / model_max / hvd_policy``
  pick and configure the drafter (:func:`build_drafter`);
* ``drafting.max_draft / min_draft`` configure the loop (:func:`engine_config`), and
  ``drafting.draft_gate`` (:attr:`AgentSpec.gated_drafts`) gives it a draft gate priced by
  the target's c(k, L) (:mod:`agentspec.drafters.gate`); under ``hybrid`` the HVD drafter
  holds the gate (it gates the cache's draft before its policy picks a source);
* ``verifier.*`` picks the verifier (:func:`agentspec.verifiers.build_verifier`), and
  ``verifier.sampler="multi_draft"`` with ``num_drafts=K > 1`` the multi-draft loop
  (:class:`~agentspec.multi_engine.MultiDraftDecoder`), drafting K i.i.d. drafts from the
  chosen drafter (:class:`~agentspec.drafters.multi.IIDDrafts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from agentspec.drafters import PromptLookupDrafter, SuffixConfig, SuffixDrafter
from agentspec.drafters.gate import DraftGate
from agentspec.drafters.multi import IIDDrafts
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import AgentSpecError, ConfigError
from agentspec.interfaces import (
    BatchTarget,
    ContextCostTarget,
    Drafter,
    Target,
    TurnStore,
    Verifier,
)
from agentspec.multi_engine import MultiDraftDecoder
from agentspec.spec import AgentSpec
from agentspec.verifiers import MultiDraftVerifier, build_verifier
from agentspec.verifiers.keyed import KeyedVerifier

if TYPE_CHECKING:
    from agentspec.storage.ledger import RegretLedger

__all__ = ["build_drafter", "build_engine", "build_gate", "draft_model_name",
           "draft_target_drafter", "engine_config", "suffix_config", "suffix_drafter"]


def suffix_config(spec: AgentSpec) -> SuffixConfig:
    """The session cache's settings for ``spec``'s drafting policy (scope, draft length,
    tree drafts); the other fields keep :class:`SuffixConfig`'s defaults."""
    d = spec.drafting
    return SuffixConfig(scope=d.scope, max_tokens=d.max_draft, tree=spec.tree_drafts)


def suffix_drafter(spec: AgentSpec, store: TurnStore | None = None) -> SuffixDrafter:
    """The session-cache drafter of ``spec``'s drafting policy, persisting to ``store``."""
    return SuffixDrafter(suffix_config(spec), store=store)


def build_drafter(
    spec: AgentSpec, target: Target | None = None, store: TurnStore | None = None
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
        from agentspec.drafters.hybrid_build import build_hybrid, load_model_drafter

        try:
            model = draft_target_drafter(spec, target) or load_model_drafter(
                target, d.draft_model, max_tokens=d.model_max)
            if d.method == "model":
                return model
            return build_hybrid(target, d.hvd_policy, cache=suffix_drafter(spec, store),
                                model=model, model_max=d.model_max,
                                gate=_new_gate(spec, target))
        except AgentSpecError as exc:
            raise ConfigError(f"drafting method {d.method!r}: {exc}") from None
    raise ConfigError(f"drafting method {d.method!r} is not available in this build")


#: Prefix-store budget of a draft model run as a target: its KV is a fraction of the
#: target's (a 0.5B model holds ~12 KB per token in w8a16's fp32 KV), and a few sessions'
#: conversations are what a later turn reuses.
DRAFT_PREFIX_BYTES = 512 << 20


def draft_model_name(spec: AgentSpec, target: Target) -> str | None:
    """The draft model ``spec`` drafts with: the policy's ``draft_model``, else the one the
    shipped target names (the 0.5B for the 1.5B), else ``None`` (an EAGLE head or the
    distilled drafter).

    Raises:
        ConfigError: the shipped draft model is not installed (the message says how).
    """
    from agentspec.models import SHIPPED_MODELS, shipped_model

    if spec.drafting.draft_model is not None:
        return spec.drafting.draft_model
    shipped = shipped_model(target.name)
    if shipped is None or shipped.draft_model is None:
        return None
    draft = SHIPPED_MODELS[shipped.draft_model]
    if not draft.installed:
        raise ConfigError(f"{target.name} drafts with {draft.name}, which is not installed: "
                          f"`make {draft.make_target}` or `{draft.install_command}` "
                          "(or name another drafting.draft_model)")
    return draft.name


def draft_target_drafter(spec: AgentSpec, target: Target) -> Drafter | None:
    """The draft model as a target of its own (:class:`TargetDrafter`): the verified
    target's forward, precision and device, its own KV with prefix reuse. ``None`` where
    there is no draft model to load this way (no name, or a target that is not an
    in-process transformers model).

    Raises:
        ConfigError: the draft model's tokenizer is not the target's.
    """
    from agentspec.targets.hf import HFTarget, TargetConfig
    from agentspec.targets.kernels import int8_mm

    name = draft_model_name(spec, target)
    if name is None or not isinstance(target, HFTarget):
        return None
    from agentspec.drafters.model.causal import ModelDrafterConfig
    from agentspec.drafters.model.target_drafter import TargetDrafter
    from agentspec.payoff.predictor import tokenizer_fingerprint

    draft = HFTarget.load(TargetConfig(model=name, dtype=target.dtype, device=target.device,
                                       measure_costs=False,
                                       prefix_cache_bytes=DRAFT_PREFIX_BYTES))
    if tokenizer_fingerprint(draft.tokenizer) != tokenizer_fingerprint(target.tokenizer):
        raise ConfigError(f"draft model {name!r} does not share {target.name!r}'s tokenizer "
                          f"({len(draft.tokenizer)} vs {len(target.tokenizer)} tokens)")
    drafter = TargetDrafter(draft, ModelDrafterConfig(max_tokens=spec.drafting.model_max),
                            vocab_size=target.vocab_size)
    drafter.warm()
    # Its one-row steps and two-row syncs past their int8 kernel trials, which would
    # otherwise price its first drafts (HVD prices the model by measured drafting time).
    int8_mm.settle(draft, (1, 2))
    drafter.reset()  # the next draft starts with a prefill
    return drafter


def build_gate(spec: AgentSpec, target: Target, drafter: Drafter | None) -> DraftGate | None:
    """The draft gate ``spec`` asks for (``None``: drafts verified as drafted), priced by
    the target's c(k, L) as the machine is loaded now. Its calibration spans requests, so
    whoever serves many requests keeps one per drafting policy
    (:meth:`agentspec.runtime.Runtime.gate_for`)."""
    if drafter is None or spec.drafting.method == "hybrid":
        return None  # the HVD drafter gates its cache drafts itself (build_drafter)
    return _new_gate(spec, target)


def _new_gate(spec: AgentSpec, target: Target) -> DraftGate | None:
    if spec.gated_drafts and isinstance(target, ContextCostTarget):
        return DraftGate(target.context_cost)
    return None


def engine_config(spec: AgentSpec) -> EngineConfig:
    """The decode loop's settings for ``spec`` (longest and shortest verified draft)."""
    d = spec.drafting
    return EngineConfig(max_draft=d.max_draft, min_draft=d.min_draft)


def build_engine(
    spec: AgentSpec,
    target: Target,
    drafter: Drafter | None,
    *,
    decode: Callable[[Sequence[int]], str] | None = None,
    eos_token_ids: Sequence[int] = (),
    verifier: Verifier | None = None,
    ledger: RegretLedger | None = None,
    gate: DraftGate | None = None,
) -> SpeculativeDecoder:
    """A decoder for ``spec`` over ``target`` drafting with ``drafter``.

    ``verifier.sampler="multi_draft"`` with ``num_drafts > 1`` gives a
    :class:`~agentspec.multi_engine.MultiDraftDecoder` (K drafts per step, one batched
    forward); everything else the single-draft :class:`SpeculativeDecoder`.

    Args:
        spec: The agent's policy (verifier, draft lengths, multi-draft).
        target: The loaded target.
        drafter: The (shared, stateful) drafter, from :func:`build_drafter`.
        decode: Token ids -> text (stop strings, streaming).
        eos_token_ids: Tokens that end a request.
        verifier: Overrides the verifier ``spec.verifier`` asks for (single-draft only).
        ledger: The regret ledger of ``mode="budgeted"`` (default: the process-wide one).
        gate: The draft gate to use, when the caller keeps one across requests (the
            runtime does, per drafting policy); default: a new one from :func:`build_gate`.

    Raises:
        ConfigError: multi-draft decoding on a target that cannot score batches, or
            without a drafter.
    """
    v = spec.verifier
    if v.sampler == "multi_draft" and v.num_drafts > 1:
        if drafter is None:
            raise ConfigError(
                f"verifier.num_drafts={v.num_drafts} needs a drafter, got drafting.method='none'"
            )
        if not isinstance(target, BatchTarget):
            raise ConfigError(
                f"verifier.num_drafts={v.num_drafts}: the target {type(target).__name__} "
                "cannot score K drafts in one forward (no score_batch / select_row)"
            )
        # Seeded sampled requests keep the keyed guarantee (same seed, same tokens) over K
        # drafts too; unseeded ones get SpecTr-GBV.
        return MultiDraftDecoder(
            target, IIDDrafts(drafter), KeyedVerifier(MultiDraftVerifier()),
            num_drafts=v.num_drafts,
            decode=decode, eos_token_ids=eos_token_ids, config=engine_config(spec),
        )
    if gate is None:
        gate = build_gate(spec, target, drafter)
    return SpeculativeDecoder(
        target, drafter, verifier or build_verifier(v, ledger), decode=decode,
        eos_token_ids=eos_token_ids, config=engine_config(spec), gate=gate,
    )
