"""An :class:`~agentspec.spec.AgentSpec`'s drafting policy as vLLM's ``speculative_config``.

=================  ==================  ====================================================
drafting.method    proposer            vLLM ``speculative_config``
=================  ==================  ====================================================
``none``           any                 ``None`` (plain decoding)
``prompt_lookup``  ``vllm``            ``{"method": "ngram", ...}`` (prompt lookup)
``suffix``         ``vllm``            ``{"method": "suffix", ...}`` (arctic-inference's
                                       SuffixDecoding; no session scope)
``suffix``         ``agentspec``       ``{"method": "custom_class", "model":
                                       "adapters.vllm.proposer.AgentSpecProposer"}``
``model``          ``vllm``            ``{"method": "eagle3" | "draft_model", "model": ...}``
``hybrid``         —                   not available on vLLM (raises :class:`ConfigError`)
=================  ==================  ====================================================

``drafting.max_draft`` becomes ``num_speculative_tokens`` (for ``model`` it is capped at
:data:`MAX_MODEL_DRAFT`: every drafted token costs a draft-model forward). vLLM verifies
every draft itself; with greedy sampling its output does not depend on the drafts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from agentspec.drafters.lookup import PromptLookupConfig
from agentspec.errors import ConfigError
from agentspec.factory import suffix_config
from agentspec.spec import AgentSpec

Proposer = Literal["vllm", "agentspec"]
PROPOSERS: tuple[str, ...] = ("vllm", "agentspec")
PROPOSER_CLASS = "adapters.vllm.proposer.AgentSpecProposer"
MAX_MODEL_DRAFT = 8


def is_eagle3_head(path: str | Path) -> bool:
    """True when the folder holds an EAGLE-3 draft head (its ``config.json`` says so)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    names = [str(a).lower() for a in data.get("architectures") or []]
    return any("eagle3" in n for n in names) or "eagle3" in str(data.get("model_type", ""))


def _draft_model_path(spec: AgentSpec) -> str:
    """The draft model folder of a ``model`` policy (embedded names are resolved)."""
    name = spec.drafting.draft_model
    if not name:
        raise ConfigError(
            "drafting.method='model' needs drafting.draft_model (a local Hugging Face folder "
            "or EAGLE-3 head whose tokenizer matches the target), got draft_model=None"
        )
    from agentspec.models import resolve_model

    return str(resolve_model(name).path)


def speculative_config(spec: AgentSpec, proposer: str = "vllm") -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``spec`` (see the module table).

    Args:
        spec: The agent's policy; ``spec.drafting`` is mapped.
        proposer: ``"vllm"`` (vLLM's own drafters) or ``"agentspec"`` (agentspec's
            session suffix cache as a ``custom_class`` proposer; ``suffix`` only).

    Returns:
        The dict to pass as ``LLM(..., speculative_config=...)``, or ``None`` for plain
        decoding.

    Raises:
        ConfigError: an unknown ``proposer``, ``hybrid`` drafting, ``model`` drafting
            without a ``draft_model``, or ``proposer="agentspec"`` with another method.
    """
    if proposer not in PROPOSERS:
        raise ConfigError(f"proposer must be one of {PROPOSERS}, got {proposer!r}")
    d = spec.drafting
    k = d.max_draft
    if d.method == "none":
        return None
    if d.method == "hybrid":
        raise ConfigError(
            "drafting.method='hybrid' is not available on vLLM (its proposer interface has "
            "no target features for the payoff predictor); use method='suffix' with "
            "proposer='agentspec', or method='model'"
        )
    if proposer == "agentspec":
        if d.method not in ("suffix", "arctic_suffix"):
            raise ConfigError(
                f"proposer='agentspec' drafts from the session suffix cache and needs "
                f"drafting.method='suffix', got method={d.method!r}"
            )
        return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k}
    if d.method == "prompt_lookup":
        lookup = PromptLookupConfig()
        return {
            "method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_min": lookup.min_ngram, "prompt_lookup_max": lookup.max_ngram,
        }
    if d.method in ("suffix", "arctic_suffix"):
        suffix = suffix_config(spec)  # the session cache's settings, from the one factory
        return {
            "method": "suffix", "num_speculative_tokens": k,
            "suffix_decoding_max_tree_depth": suffix.max_depth,
            "suffix_decoding_max_spec_factor": suffix.max_spec_factor,
            "suffix_decoding_min_token_prob": suffix.min_token_prob,
        }
    # d.method == "model": a separate draft model, or an EAGLE-3 head.
    path = _draft_model_path(spec)
    method = "eagle3" if is_eagle3_head(path) else "draft_model"
    return {"method": method, "model": path, "num_speculative_tokens": min(k, MAX_MODEL_DRAFT)}
