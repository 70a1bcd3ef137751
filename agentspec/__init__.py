"""agentspec: session-scoped speculative decoding for LLM agents.

The public faces, importable from the top level (``from agentspec import Runtime``) and loaded
lazily: ``import agentspec`` imports no module until a name is first read, so it costs
nothing (torch and the model stack load only with the part that needs them) and the
modules behind these names may move without breaking users' imports. Everything else is
reached through its module (``agentspec.drafters.suffix``, ``agentspec.verifiers``, ...);
``docs/architecture.md`` maps the packages.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

#: Whether this import set torch's OpenMP wait policy (read once, when torch loads).
#: Idle OpenMP workers spin by default; a CPU target's forward alternates torch's
#: operators with the native kernels' own thread pool, and on a machine with as many cores
#: as threads the spinning workers take the cores the other pool's work needs (measured in
#: ``docs/cpu_step.md``). ``PASSIVE`` lets them sleep. Only where torch is not loaded yet
#: (else it has read the variable) and the user has not set it (their setting wins).
_OMP_POLICY_SET = "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ
if _OMP_POLICY_SET:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

if TYPE_CHECKING:  # the same names for type checkers and IDEs; never run
    from agentspec.chat.api import ChatResult, ChatRuntime, ToolChoice
    from agentspec.chat.stream import ResultStream
    from agentspec.chat.templates import render_prompt
    from agentspec.chat.turn import ChatTurn
    from agentspec.drafters.lookup import PromptLookupDrafter
    from agentspec.drafters.suffix.config import SuffixConfig
    from agentspec.drafters.suffix.drafter import SuffixDrafter
    from agentspec.engine import EngineConfig, Generation, SpeculativeDecoder
    from agentspec.errors import (
        AgentSpecError,
        BenchmarkError,
        ConfigError,
        DraftError,
        GrammarError,
        ModelLoadError,
        PromptTooLongError,
        RequestStateError,
        SessionTooLargeError,
        StoreBusyError,
        StoreCorruptError,
        StoreError,
        TrainingDataError,
        UnknownSessionError,
    )
    from agentspec.factory import build_drafter, build_engine
    from agentspec.interfaces import Drafter, Target, TurnStore, Verifier
    from agentspec.models import EMBEDDED_MODEL, resolve_model
    from agentspec.runtime import Runtime
    from agentspec.spec import AgentSpec, DraftingPolicy, VerifierPolicy
    from agentspec.storage.sessions import SessionStore, StoreConfig, open_store
    from agentspec.targets.cache.prefix_cache import PrefixCache
    from agentspec.targets.hf import HFTarget, TargetConfig
    from agentspec.types import (
        Draft,
        DraftContext,
        RequestStats,
        SamplingParams,
        SessionRef,
        StepStats,
        VerifyResult,
    )

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Runtime": "agentspec.runtime",
    "AgentSpec": "agentspec.spec",
    "DraftingPolicy": "agentspec.spec",
    "VerifierPolicy": "agentspec.spec",
    "SamplingParams": "agentspec.types",
    "SessionRef": "agentspec.types",
    "Draft": "agentspec.types",
    "DraftContext": "agentspec.types",
    "VerifyResult": "agentspec.types",
    "RequestStats": "agentspec.types",
    "StepStats": "agentspec.types",
    "AgentSpecError": "agentspec.errors",
    "ConfigError": "agentspec.errors",
    "ModelLoadError": "agentspec.errors",
    "PromptTooLongError": "agentspec.errors",
    "DraftError": "agentspec.errors",
    "BenchmarkError": "agentspec.errors",
    "StoreError": "agentspec.errors",
    "StoreCorruptError": "agentspec.errors",
    "StoreBusyError": "agentspec.errors",
    "UnknownSessionError": "agentspec.errors",
    "SessionTooLargeError": "agentspec.errors",
    "TrainingDataError": "agentspec.errors",
    "RequestStateError": "agentspec.errors",
    "GrammarError": "agentspec.errors",
    "Target": "agentspec.interfaces",
    "Drafter": "agentspec.interfaces",
    "Verifier": "agentspec.interfaces",
    "TurnStore": "agentspec.interfaces",
    "ChatResult": "agentspec.chat.api",
    "ChatRuntime": "agentspec.chat.api",
    "ToolChoice": "agentspec.chat.api",
    "ChatTurn": "agentspec.chat.turn",
    "ResultStream": "agentspec.chat.stream",
    "HFTarget": "agentspec.targets.hf",
    "TargetConfig": "agentspec.targets.hf",
    "PrefixCache": "agentspec.targets.cache.prefix_cache",
    "build_drafter": "agentspec.factory",
    "build_engine": "agentspec.factory",
    "SpeculativeDecoder": "agentspec.engine",
    "EngineConfig": "agentspec.engine",
    "Generation": "agentspec.engine",
    "render_prompt": "agentspec.chat.templates",
    "SessionStore": "agentspec.storage.sessions",
    "StoreConfig": "agentspec.storage.sessions",
    "open_store": "agentspec.storage.sessions",
    "SuffixDrafter": "agentspec.drafters.suffix.drafter",
    "SuffixConfig": "agentspec.drafters.suffix.config",
    "PromptLookupDrafter": "agentspec.drafters.lookup",
    "EMBEDDED_MODEL": "agentspec.models",
    "resolve_model": "agentspec.models",
}

__all__ = [
    "EMBEDDED_MODEL",
    "AgentSpec",
    "AgentSpecError",
    "BenchmarkError",
    "ChatResult",
    "ChatRuntime",
    "ChatTurn",
    "ConfigError",
    "Draft",
    "DraftContext",
    "DraftError",
    "Drafter",
    "DraftingPolicy",
    "EngineConfig",
    "Generation",
    "GrammarError",
    "HFTarget",
    "ModelLoadError",
    "PrefixCache",
    "PromptLookupDrafter",
    "PromptTooLongError",
    "RequestStateError",
    "RequestStats",
    "ResultStream",
    "Runtime",
    "SamplingParams",
    "SessionRef",
    "SessionStore",
    "SessionTooLargeError",
    "SpeculativeDecoder",
    "StepStats",
    "StoreBusyError",
    "StoreConfig",
    "StoreCorruptError",
    "StoreError",
    "SuffixConfig",
    "SuffixDrafter",
    "Target",
    "TargetConfig",
    "ToolChoice",
    "TrainingDataError",
    "TurnStore",
    "UnknownSessionError",
    "Verifier",
    "VerifierPolicy",
    "VerifyResult",
    "build_drafter",
    "build_engine",
    "open_store",
    "render_prompt",
    "resolve_model",
]


def __getattr__(name: str) -> Any:
    """Load a public name from its module on first use (PEP 562) and cache it here."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
