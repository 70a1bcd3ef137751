"""``ChatAgentSpec``: agentspec's accelerated embedded model as a LangChain chat model.

Every call goes through a shared :class:`~agentspec.runtime.Runtime` (see
:mod:`adapters.langchain.runtimes`): messages and bound tools are rendered with the model's
chat template, decoded by the speculative engine under the agent's
:class:`~agentspec.spec.AgentSpec`, and tool calls are parsed into ``AIMessage.tool_calls``.
Streaming yields the engine's own token deltas. The session id, which scopes the suffix
cache, comes from the call (``session_id=``), the run config
(``config={"configurable": {"session_id": ...}}``, or LangGraph's ``thread_id``) or the
``session_id`` field, so every turn of an agent run drafts from what the run has seen.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.utils import from_env
from pydantic import ConfigDict, Field, SkipValidation, model_validator

from adapters.langchain.messages import convert_tools, normalise_tool_choice, to_agentspec_messages
from adapters.langchain.request import (
    ChatRequest,
    agen_chunks,
    result_message,
    session_from_config,
    session_from_metadata,
    stream_chunks,
    stream_deltas,
)
from adapters.langchain.runtimes import shared_runtime, shared_tokenizer
from adapters.langchain.structured import (
    MAX_TOKENS_ALIASES,
    PENALTIES,
    PENALTY_ALIASES,
    StructuredMethod,
    check_call_args,
    structured_runnable,
    token_limit,
)
from agentspec.chat.api import ChatRuntime
from agentspec.chat.formats import check_format_name
from agentspec.chat.stream import ResultStream
from agentspec.chat.turn import ChatTurn
from agentspec.errors import ConfigError
from agentspec.models import EMBEDDED_MODEL
from agentspec.spec import AgentSpec
from agentspec.types import SessionRef, check_id

__all__ = ["ChatAgentSpec"]


def _complete(req: ChatRequest) -> ChatResult:
    """Run a request to the end and wrap its message as a LangChain ``ChatResult``."""
    result = ResultStream(stream_deltas(req)).drain()
    message = result_message(req, result)
    return ChatResult(
        generations=[ChatGeneration(
            message=message, generation_info={"finish_reason": result.finish_reason})],
        llm_output={"model_name": req.model_name, "token_usage": message.usage_metadata},
    )


def _with_verifier(spec: AgentSpec, overrides: dict[str, Any]) -> AgentSpec:
    """``spec`` with verifier fields replaced, re-validated (e.g. budgeted mode is greedy)."""
    try:
        verifier = type(spec.verifier).model_validate(
            {**spec.verifier.model_dump(), **overrides}
        )
    except ValueError as exc:
        raise ConfigError(f"{overrides} does not fit agent spec {spec.name!r}: {exc}") from exc
    return spec.model_copy(update={"verifier": verifier})


class ChatAgentSpec(BaseChatModel):
    """A LangChain chat model served by agentspec's lossless speculative decoder.

    ``ChatAgentSpec()`` with no arguments runs the embedded SmolLM2-135M-Instruct on CPU,
    greedy and exact (fp32), with the session suffix cache as drafter.

    Example:
        ```python
        llm = ChatAgentSpec(max_tokens=128)
        llm.invoke("Hello", config={"configurable": {"session_id": "run-1"}})
        ```

    Attributes:
        model_name: Embedded model name or a local Hugging Face folder (alias ``model``;
            default from ``AGENTSPEC_MODEL``, else the embedded model).
        dtype: ``auto`` (the default: w8a16 on a CPU whose torch has the int8 product,
            AVX-512 or AVX2, else fp32), ``float32`` (the reference, by name),
            ``bfloat16``, ``int8`` (int8 weight-only layers, CPU only), ``w8a8`` (int8
            weights and activations, CPU only) or ``w8a16`` (int8 weights, activations as
            two int8 digits, CPU only); output identical to plain greedy decoding in that
            precision. The precision chosen is in ``response_metadata["speculative"]
            ["dtype"]``.
        tool_format: The model's tool-call format: ``hermes``, ``llama3_json``,
            ``mistral``, ``mistral_v11`` or ``fallback`` (default: chosen from the model's
            chat template; see ``docs/tool-formats.md``). With ``runtime`` given it must
            name that runtime's format.
        temperature: Sampling temperature; 0 is greedy. Overrides the agent spec's when set.
        max_tokens: Most tokens generated per call (aliases: ``max_completion_tokens``,
            ``num_predict``).
        stop: Stop strings (the output ends before them).
        timeout: Seconds a call may take; a longer one raises ``GenerationTimeoutError``.
        max_retries: Retries of a call that failed on a busy session store before any output.
        streaming: Make ``invoke`` stream internally (token callbacks fire).
        agent_spec: The agent's drafting and verification policy.
        session_id: Default session (cache scope) when the call's config names none.
        tenant: Tenant id; tenants never draft from each other's tokens.
        store: ``True``: persist sessions under ``AGENTSPEC_HOME``; a path: that SQLite
            file; ``False``: keep session caches in memory only.
        seed: Seed of the sampling generator (overrides the agent spec's; sampling only).
        frequency_penalty: OpenAI's frequency penalty in ``[-2, 2]`` (overrides the agent
            spec's when set).
        presence_penalty: OpenAI's presence penalty in ``[-2, 2]`` (same).
        repetition_penalty: vLLM's repetition penalty, > 0, 1 is off (alias
            ``repeat_penalty``, Ollama's name). Penalties are applied inside the
            speculative loop: the output is that of penalised decoding without drafts.
        return_token_ids: Put the generated token ids in ``response_metadata``.
        runtime: A runtime to use instead of the shared one (advanced; not serialised).
        model_kwargs: Further call arguments (langchain-openai's convention: unknown
            constructor arguments land here with a warning); one that cannot be honoured
            raises a ``ConfigError`` naming it. ``response_format`` is honoured.
    """

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    model_name: str = Field(
        default_factory=from_env("AGENTSPEC_MODEL", default=EMBEDDED_MODEL), alias="model"
    )
    dtype: Literal["auto", "float32", "bfloat16", "int8", "w8a8", "w8a16"] = "auto"
    tool_format: str | None = None
    temperature: float = Field(default=0.0, ge=0.0)
    max_tokens: int | None = Field(default=256, ge=1)
    stop: list[str] | None = None
    timeout: float | None = Field(default=None, gt=0)
    max_retries: int = Field(default=2, ge=0)
    streaming: bool = False
    agent_spec: AgentSpec | None = None
    session_id: str | None = None
    tenant: str = "default"
    store: bool | str = True
    seed: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    return_token_ids: bool = False
    # Any ChatRuntime (agentspec's Runtime, the vLLM backend); not validated by pydantic.
    runtime: SkipValidation[ChatRuntime | None] = Field(default=None, exclude=True)
    model_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _extra_kwargs(cls, values: Any) -> Any:
        """Aliases of ``max_tokens``; unknown arguments -> ``model_kwargs`` (warned), then
        rejected if they cannot be honoured: nothing passed is silently dropped."""
        from langchain_core.utils.utils import _build_model_kwargs, get_pydantic_field_names

        if not isinstance(values, dict):
            return values
        values = dict(values)
        for alias in MAX_TOKENS_ALIASES:
            if alias in values:
                value = values.pop(alias)
                if values.get("max_tokens") not in (None, value):
                    raise ConfigError(f"{alias}={value!r} conflicts with "
                                      f"max_tokens={values['max_tokens']!r}")
                values["max_tokens"] = value
        for alias, name in PENALTY_ALIASES.items():
            if alias in values:
                value = values.pop(alias)
                if values.get(name) not in (None, value):
                    raise ConfigError(f"{alias}={value!r} conflicts with {name}={values[name]!r}")
                values[name] = value
        values = _build_model_kwargs(values, get_pydantic_field_names(cls))
        check_call_args(values["model_kwargs"])
        return values

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Checked here, outside pydantic, so a bad id or format raises agentspec's
        # ConfigError (a ValueError) rather than being re-wrapped into a ValidationError,
        # and before any model loads.
        if self.session_id is not None:
            check_id("session", self.session_id)
        check_id("tenant", self.tenant)
        if self.tool_format is not None:
            check_format_name(self.tool_format)
            given = self.runtime.tool_format.name if self.runtime is not None else None
            if given not in (None, self.tool_format):
                raise ConfigError(f"tool_format={self.tool_format!r} differs from the given "
                                  f"runtime's format {given!r}; set it on the runtime")

    # -- LangChain metadata ---------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "agentspec"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name, "dtype": self.dtype, "tool_format": self.tool_format,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "agent_spec": self.agent_spec.model_dump() if self.agent_spec else None,
        }

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        """The import path of the class: ``adapters.langchain``.

        ``is_lc_serializable`` stays ``False``: langchain-core's ``load`` only revives
        classes on its own allowlist, so a ``dumpd`` of this model could not be loaded back.
        """
        return ["adapters", "langchain"]

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "agentspec"
        params["ls_model_name"] = kwargs.get("model") or self.model_name
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    # -- session ids from the run config ----------------------------------------------------

    def invoke(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
        stop: list[str] | None = None, **kwargs: Any,
    ) -> AIMessage:
        """Call the model (see ``BaseChatModel.invoke``); reads the session from ``config``."""
        return super().invoke(input, config, stop=stop, **session_from_config(config, kwargs))

    async def ainvoke(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
        stop: list[str] | None = None, **kwargs: Any,
    ) -> AIMessage:
        """Async :meth:`invoke`: the engine runs in a worker thread."""
        kwargs = session_from_config(config, kwargs)
        return await super().ainvoke(input, config, stop=stop, **kwargs)

    def stream(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
        stop: list[str] | None = None, **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        """Stream the engine's token deltas; the last chunk carries calls, usage, stats."""
        yield from super().stream(input, config, stop=stop, **session_from_config(config, kwargs))

    async def astream(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
        stop: list[str] | None = None, **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        """Async :meth:`stream`: a worker thread decodes, chunks arrive through a queue."""
        kwargs = session_from_config(config, kwargs)
        async for chunk in super().astream(input, config, stop=stop, **kwargs):
            yield chunk

    # -- tools -----------------------------------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Any],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools: their schemas are rendered into the prompt on every call.

        Args:
            tools: LangChain tools, pydantic models, functions, or OpenAI / Anthropic dicts.
            tool_choice: ``"auto"``/``None``, ``"any"``/``"required"``/``True`` (some
                call), a tool name or OpenAI dict (that tool), or ``"none"`` (no call).
            strict: Passed to the schema conversion.
            **kwargs: Further call arguments to bind (``session_id``, ``max_tokens``, ...).

        Raises:
            ToolSchemaError: a tool that cannot be turned into a JSON function schema.
            ConfigError: a ``tool_choice`` that names no bound tool.
        """
        schemas = convert_tools(tools, strict=strict)
        choice = normalise_tool_choice(tool_choice, schemas)
        kwargs.pop("parallel_tool_calls", None)  # calls come one block at a time anyway
        return super().bind(tools=schemas, tool_choice=choice, **kwargs)

    def with_structured_output(
        self,
        schema: Any = None,
        *,
        method: StructuredMethod = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """A runnable whose replies are parsed into ``schema``; decoding is constrained
        so the reply always parses (see :mod:`adapters.langchain.structured`).

        Args:
            schema: Pydantic model, TypedDict, JSON schema or OpenAI tool dict (``None``
                with ``json_mode``: any JSON object).
            method: ``json_schema`` (default), ``json_mode`` or ``function_calling``.
            include_raw: Also return the raw message and any parsing error.
            strict: Accepted for compatibility; the schema is always enforced.

        Raises:
            ConfigError: an unknown method or argument.
        """
        if kwargs:
            raise ConfigError(f"with_structured_output got unsupported arguments {kwargs}")
        return structured_runnable(self, schema, method=method, include_raw=include_raw,
                                   strict=strict)

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` with the model's own tokenizer (offline, no model load)."""
        if self.runtime is not None:
            return list(self.runtime.tokenizer.encode(text, add_special_tokens=False))
        return list(shared_tokenizer(self.model_name).encode(text, add_special_tokens=False))

    # -- requests --------------------------------------------------------------------------

    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any],
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None = None,
    ) -> ChatRequest:
        """Resolve one call's runtime, prompt, tools, session and limits."""
        # Everything that can be wrong with the input is checked before the model loads.
        check_call_args(kwargs)
        kwargs = {**self.model_kwargs, **kwargs}
        converted = to_agentspec_messages(messages)
        tools = kwargs.get("tools") or None
        if tools is not None:
            tools = convert_tools(tools)  # idempotent for bound schemas; checks raw dicts
        choice = normalise_tool_choice(kwargs.get("tool_choice"), tools or [])
        # "none" keeps the tools: the runtime hides them from the prompt, parses no call,
        # and (in formats whose calls open without a tag token) allows only prose.
        spec = self.agent_spec or AgentSpec()
        temperature = kwargs.get("temperature")
        if temperature is None and "temperature" in self.model_fields_set:
            temperature = self.temperature
        overrides: dict[str, Any] = {}
        if temperature is not None and temperature != spec.verifier.temperature:
            overrides["temperature"] = float(temperature)
        if self.seed is not None and self.seed != spec.verifier.seed:
            overrides["seed"] = self.seed
        for name in PENALTIES:  # call argument, else the model's field, else the spec's
            alias = next((a for a, n in PENALTY_ALIASES.items() if n == name), None)
            value = kwargs.get(name, kwargs.get(alias) if alias else None)
            if value is None:
                value = getattr(self, name)
            if value is not None and value != getattr(spec.verifier, name):
                overrides[name] = float(value)
        if overrides:
            spec = _with_verifier(spec, overrides)
        max_tokens = token_limit(kwargs)
        if max_tokens is None:
            max_tokens = self.max_tokens or 256
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        timeout = kwargs.get("timeout", self.timeout)
        session_id = (kwargs.get("session_id") or session_from_metadata(run_manager)
                      or self.session_id)
        session = (SessionRef(str(session_id), self.tenant, spec.name)
                   if session_id is not None else None)
        model = kwargs.get("model") or self.model_name
        runtime = self.runtime or shared_runtime(model, self.dtype, self.store, self.tool_format)
        turn = ChatTurn(
            messages=converted, tools=tools, tool_choice=choice, session=session, spec=spec,
            max_tokens=max_tokens, stop=list(stop if stop is not None else self.stop or []),
            response_format=kwargs.get("response_format"),
        )
        return ChatRequest(
            runtime=runtime, turn=turn, model_name=str(model), max_retries=self.max_retries,
            deadline=time.monotonic() + float(timeout) if timeout else None,
            return_token_ids=self.return_token_ids,
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return _complete(self._request(messages, stop, kwargs, run_manager))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        req = self._request(messages, stop, kwargs, run_manager)
        for chunk in stream_chunks(req):
            if run_manager is not None and not getattr(chunk.message, "chunk_position", None):
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # The first call loads the model (seconds): keep that off the event loop too.
        req = await asyncio.to_thread(self._request, messages, stop, kwargs, run_manager)
        return await asyncio.to_thread(_complete, req)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        req = await asyncio.to_thread(self._request, messages, stop, kwargs, run_manager)
        async for chunk in agen_chunks(req):
            if run_manager is not None and not getattr(chunk.message, "chunk_position", None):
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

