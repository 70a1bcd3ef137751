"""vLLM backend: agentspec policies on vLLM, and agentspec's session cache as a vLLM proposer.

* :mod:`adapters.vllm.speculative` — an ``AgentSpec``'s drafting as ``speculative_config``;
* :mod:`adapters.vllm.backend` — :class:`VLLMRuntime`, the ``chat`` / ``stream_chat``
  surface of :class:`agentspec.runtime.Runtime` on a vLLM engine;
* :mod:`adapters.vllm.proposer` — ``AgentSpecProposer``, the ``custom_class`` proposer;
* :mod:`adapters.vllm.request_ids` — the session carried in vLLM request ids;
* :mod:`adapters.vllm.stats` — vLLM's spec-decode counters as ``RequestStats``.

Nothing here imports vLLM at import time; it is needed only to start an engine.
"""

from __future__ import annotations

from adapters.vllm.backend import EngineSettings, VLLMRuntime
from adapters.vllm.request_ids import decode_request_id, encode_request_id
from adapters.vllm.speculative import PROPOSER_CLASS, speculative_config

__all__ = [
    "PROPOSER_CLASS",
    "EngineSettings",
    "VLLMRuntime",
    "decode_request_id",
    "encode_request_id",
    "speculative_config",
]
