"""AgentSpec: the per-agent policy for drafting and verification.

Agents differ: a coding agent needs exact output, a brainstorming agent samples, a
summariser may trade a bounded deviation for speed. An ``AgentSpec`` says which, per agent.
Validation errors name the bad field and value (pydantic ``ValidationError``, a
``ValueError``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentspec.types import SamplingParams, check_id

DraftMethod = Literal["none", "prompt_lookup", "suffix", "arctic_suffix", "model", "hybrid"]
Scope = Literal["session", "agent", "tenant"]


class DraftingPolicy(BaseModel):
    """Where drafts come from.

    Attributes:
        method: Draft source. ``suffix`` (the session cache) is the default.
        max_draft: Longest draft verified in one forward.
        scope: Who shares a suffix cache: one session, all sessions of the agent, or the
            whole tenant (never across tenants).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: DraftMethod = "suffix"
    max_draft: int = Field(default=32, ge=1, le=64)
    scope: Scope = "session"


class VerifierPolicy(BaseModel):
    """How drafts are accepted.

    Attributes:
        mode: ``lossless`` (output identical to the model's own decoding / distribution) or
            ``budgeted`` (approximate greedy within a regret budget; opt-in).
        budget: Request-level cumulative regret budget B (``budgeted`` only).
        gate: Local regret gate g: accept a mismatch when regret / remaining draft <= g.
        max_exceptions: Most accepted mismatches per verified block (M).
        temperature: Sampling temperature (0 = greedy).
        top_p: Nucleus mass.
        top_k: Top-k cut (0 = off).
        seed: Seed of the request's generator.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["lossless", "budgeted"] = "lossless"
    budget: float = Field(default=0.0, ge=0.0)
    gate: float = Field(default=0.5, ge=0.0)
    max_exceptions: int = Field(default=1, ge=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None

    def sampling(self) -> SamplingParams:
        """The sampling parameters of this policy."""
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.seed)


class AgentSpec(BaseModel):
    """Per-agent drafting and verification policy.

    Attributes:
        name: The agent's id (also the cache scope key under ``scope="agent"``).
        drafting: Draft source policy.
        verifier: Verification policy.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "default"
    drafting: DraftingPolicy = Field(default_factory=DraftingPolicy)
    verifier: VerifierPolicy = Field(default_factory=VerifierPolicy)

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return check_id("agent", v)
