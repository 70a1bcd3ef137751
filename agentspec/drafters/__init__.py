"""Draft sources. Each implements :class:`agentspec.interfaces.Drafter`."""

from agentspec.drafters.arctic import ArcticConfig, ArcticSuffixDrafter
from agentspec.drafters.lookup import PromptLookupConfig, PromptLookupDrafter
from agentspec.drafters.model.distilled import DistilledDrafter, load_default_drafter
from agentspec.drafters.oracle import OracleDrafter
from agentspec.drafters.suffix.drafter import SuffixConfig, SuffixDrafter

__all__ = [
    "ArcticConfig",
    "ArcticSuffixDrafter",
    "DistilledDrafter",
    "OracleDrafter",
    "PromptLookupConfig",
    "PromptLookupDrafter",
    "SuffixConfig",
    "SuffixDrafter",
    "load_default_drafter",
]
