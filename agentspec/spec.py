"""AgentSpec: the per-agent policy for drafting and verification.

Agents differ: a coding agent needs exact output, a brainstorming agent samples, a
summariser may trade a bounded deviation for speed. An ``AgentSpec`` says which, per agent.
Validation errors name the bad field and value (pydantic ``ValidationError``, a
``ValueError``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentspec.types import SamplingParams, check_id

DraftMethod = Literal["none", "prompt_lookup", "suffix", "arctic_suffix", "model", "hybrid"]
Scope = Literal["session", "agent", "tenant"]
Sampler = Literal["rejection", "block", "multi_draft"]
BudgetScope = Literal["request", "session"]
HvdPolicy = Literal["cost_aware", "threshold", "arctic_rule"]


TREE_METHODS = ("suffix", "hybrid")  # drafting methods whose session cache may draft trees
GATED_METHODS = ("suffix", "hybrid")  # drafting methods whose session-cache drafts are gated


class DraftingPolicy(BaseModel):
    """Where drafts come from.

    Attributes:
        method: Draft source. ``suffix`` (the session cache) is the default.
        max_draft: Longest draft verified in one forward.
        scope: Who shares a suffix cache: one session, all sessions of the agent, or the
            whole tenant (never across tenants).
        draft_model: The model drafter's model (``model`` / ``hybrid``): an embedded name
            or a local Hugging Face folder whose tokenizer matches the target's.
        min_draft: Drafts shorter than this are not verified (the step decodes one token):
            on CPU a 2-3 token forward can cost more than it saves.
        tree: ``suffix`` / ``hybrid`` only: the session cache drafts one token tree
            merging every index's most probable continuations
            (``agentspec.drafters.suffix.draft_tree``) instead of the best index's chain, verified
            in one forward with tree attention; greedy requests only (a sampled request
            verifies the tree's first branch). ``None`` (default): on for ``suffix`` and
            ``hybrid`` under single-draft lossless greedy verification, off otherwise
            (see :attr:`AgentSpec.tree_drafts`).
        model_max: Most tokens the model drafter drafts per step (``model`` / ``hybrid``).
        hvd_policy: ``hybrid`` only: which source policy picks cache or model each step:
            ``cost_aware`` (default), ``threshold`` (the paper's ŷ >= τ rule) or
            ``arctic_rule`` (a hand rule on the suffix match).
        draft_gate: ``suffix`` and ``hybrid``: before each verification, cut or skip a
            session-cache draft whose expected committed tokens per second at the
            request's context length are below plain decoding's
            (``agentspec.drafters.gate``; lossless either way). Under ``hybrid`` the gate
            prices the cache's whole draft and the shorter of its cut and the HVD
            policy's is verified. ``None`` (default): on for both under lossless
            single-draft verification, on targets that measure their cost per context
            length (see :attr:`AgentSpec.gated_drafts`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: DraftMethod = "suffix"
    max_draft: int = Field(default=32, ge=1, le=64)
    scope: Scope = "tenant"
    draft_model: str | None = None
    min_draft: int = Field(default=1, ge=1, le=64)
    tree: bool | None = None
    model_max: int = Field(default=6, ge=1, le=64)
    hvd_policy: HvdPolicy = "cost_aware"
    draft_gate: bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> DraftingPolicy:
        if self.tree and self.method not in TREE_METHODS:
            raise ValueError(f"tree=True needs method 'suffix' or 'hybrid' (the session "
                             f"cache drafts the trees), got method={self.method!r}")
        if self.draft_gate and self.method not in GATED_METHODS:
            raise ValueError(f"draft_gate=True needs method 'suffix' or 'hybrid' (the gate "
                             f"prices the session cache's drafts), got method={self.method!r}")
        return self


class VerifierPolicy(BaseModel):
    """How drafts are accepted.

    Attributes:
        mode: ``lossless`` (output identical to the model's own decoding / distribution) or
            ``budgeted`` (approximate greedy within a regret budget; opt-in).
        budget: Request-level cumulative regret budget B (``budgeted`` only).
        gate: Local regret gate g: accept a mismatch when regret / remaining draft <= g.
        max_exceptions: Most accepted mismatches per verified block (M).
        budget_scope: ``request`` (B caps each request) or ``session`` (B caps the
            session's persisted total in the regret ledger).
        temperature: Sampling temperature (0 = greedy).
        top_p: Nucleus mass.
        top_k: Top-k cut (0 = off).
        seed: Seed of the request's generator.
        sampler: Lossless rule for sampled requests: token-level ``rejection``
            sampling, greedy ``block`` verification (GBV, the default) or
            ``multi_draft`` (SpecTr-GBV-style over ``num_drafts`` i.i.d. drafts).
        num_drafts: K, the drafts verified together by ``multi_draft``.
        frequency_penalty: OpenAI's frequency penalty in ``[-2, 2]`` (0: off).
        presence_penalty: OpenAI's presence penalty in ``[-2, 2]`` (0: off).
        repetition_penalty: vLLM's / Ollama's repetition penalty, > 0 (1: off). Penalties
            are applied inside the speculative loop, so lossless output is that of
            penalised decoding without drafts (:mod:`agentspec.penalties`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["lossless", "budgeted"] = "lossless"
    budget: float = Field(default=0.0, ge=0.0)
    gate: float = Field(default=0.5, ge=0.0)
    max_exceptions: int = Field(default=1, ge=0)
    budget_scope: BudgetScope = "request"
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    sampler: Sampler = "block"
    num_drafts: int = Field(default=1, ge=1, le=16)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _consistent(self) -> VerifierPolicy:
        # Errors name the offending field and value (pydantic prefixes "Value error, ").
        if self.mode == "budgeted" and self.temperature > 0:
            raise ValueError(
                f"temperature={self.temperature}: mode='budgeted' (ASD) is approximate "
                "greedy and needs temperature=0; use mode='lossless' to sample"
            )
        if self.num_drafts > 1 and self.sampler != "multi_draft":
            raise ValueError(
                f"num_drafts={self.num_drafts} needs sampler='multi_draft', "
                f"got sampler={self.sampler!r}"
            )
        return self

    def sampling(self) -> SamplingParams:
        """The sampling parameters of this policy."""
        return SamplingParams(
            self.temperature, self.top_p, self.top_k, self.seed,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
        )


class AgentSpec(BaseModel):
    """Per-agent drafting and verification policy.

    Attributes:
        name: The agent's id (also the cache scope key under ``scope="agent"``).
        drafting: Draft source policy.
        verifier: Verification policy.
        constrained_tool_calls: Decode tool calls under their JSON schemas (llguidance
            grammar, see ``docs/structured-outputs.md``): forced calls are always valid,
            and under ``tool_choice="auto"`` a call's body is constrained once the model
            opens one. ``False`` leaves tool calls free (forced calls then only get their
            opening written for the model). ``response_format`` is always enforced.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "default"
    drafting: DraftingPolicy = Field(default_factory=DraftingPolicy)
    verifier: VerifierPolicy = Field(default_factory=VerifierPolicy)
    constrained_tool_calls: bool = True

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return check_id("agent", v)

    def _greedy_single_draft(self) -> bool:
        v = self.verifier
        return v.mode == "lossless" and v.temperature == 0 and v.num_drafts == 1

    @property
    def tree_drafts(self) -> bool:
        """Whether the session cache drafts token trees: ``drafting.tree`` when set, else
        on for ``suffix`` and ``hybrid`` under single-draft lossless greedy verification
        (one forward verifies every index's best continuations together, so a merged tree
        accepts more per step than the best index's chain; ``BENCHMARKS.md``)."""
        d = self.drafting
        if d.tree is not None:
            return d.tree
        return d.method in TREE_METHODS and self._greedy_single_draft()

    @property
    def gated_drafts(self) -> bool:
        """Whether the session cache's drafts are gated by their expected payoff at the
        request's context length (by the engine for ``suffix``, inside the HVD drafter for
        ``hybrid``): ``drafting.draft_gate`` when set, else on for both under lossless
        single-draft verification (on real agent sessions much of decoding time goes to
        drafts refuted at their first token; an approximate verifier accepts more than the
        gate's labels count)."""
        d = self.drafting
        if d.draft_gate is not None:
            return d.draft_gate
        v = self.verifier
        return d.method in GATED_METHODS and v.mode == "lossless" and v.num_drafts == 1

    @model_validator(mode="after")
    def _consistent(self) -> AgentSpec:
        # Tree drafts are verified with the strict greedy rule only.
        v = self.verifier
        if self.drafting.tree and not self._greedy_single_draft():
            raise ValueError(
                "drafting.tree=True is verified with strict greedy decoding only: needs "
                f"verifier mode='lossless', temperature=0, num_drafts=1; got mode={v.mode!r}, "
                f"temperature={v.temperature}, num_drafts={v.num_drafts}"
            )
        return self
