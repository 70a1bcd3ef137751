"""Draft sources. Each implements :class:`agentspec.interfaces.Drafter`."""

from agentspec.drafters.lookup import PromptLookupConfig, PromptLookupDrafter
from agentspec.drafters.oracle import OracleDrafter

__all__ = ["OracleDrafter", "PromptLookupConfig", "PromptLookupDrafter"]
