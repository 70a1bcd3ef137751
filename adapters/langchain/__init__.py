"""agentspec as a LangChain chat model and tool-calling executor.

``from adapters.langchain import ChatAgentSpec``: a drop-in ``BaseChatModel`` served by the
embedded model with lossless speculative decoding from the session cache.
``ToolCallingExecutor`` runs a tool-using agent loop on any tool-calling chat model with one
stable session id.
"""

from __future__ import annotations

from adapters.langchain.chat_model import ChatAgentSpec
from adapters.langchain.executor import ExecutorResult, ToolCallingExecutor
from adapters.langchain.messages import (
    MessageConversionError,
    ToolSchemaError,
    convert_tools,
    to_agentspec_messages,
)
from adapters.langchain.request import GenerationTimeoutError
from adapters.langchain.runtimes import shared_runtime

__all__ = [
    "ChatAgentSpec",
    "ExecutorResult",
    "GenerationTimeoutError",
    "MessageConversionError",
    "ToolCallingExecutor",
    "ToolSchemaError",
    "convert_tools",
    "shared_runtime",
    "to_agentspec_messages",
]
