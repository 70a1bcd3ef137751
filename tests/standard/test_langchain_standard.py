"""The langchain-tests standard suites for ``ChatAgentSpec``."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from adapters.langchain import ChatAgentSpec
from agentspec.models import AGENT_MODEL, LOOP_MODEL, SHIPPED_MODELS

# Why each remaining expected failure fails: what SmolLM2-135M-Instruct writes (greedy,
# fp32; the suite runs the default precision, auto, and each still fails there in w8a16).
# Tool calling and tool_choice pass since calls are decoded under the tool's schema
# (docs/structured-outputs.md); test_remaining_xfails checks this table.
_UNICODE = (
    "the forced unicode_customer call follows the tool's schema, but this suite's 40-token "
    "answers cannot hold it (the CJK names and a description take ~50 tokens), so the cut "
    "call does not parse; test_unicode_tool_call_with_room runs the same test with 128"
)
_AGENT = (
    "SmolLM2-135M answers 'What is the weather in San Francisco, CA?' in prose instead of "
    "calling get_weather when the tool choice is left to it (tool_choice='auto': the grammar "
    "constrains a call once the model opens one, but cannot make it open one)"
)
_JOKE = (
    "with_structured_output's default method (json_schema) keeps the reply valid JSON of the "
    "Joke schema, but SmolLM2-135M repeats a phrase inside the first string ('A cat is a "
    "cat, right? A cat is a cat, a cat is a cat, ...') until max_tokens, so the object is "
    "never closed and the pydantic Joke (both fields required) does not validate; the "
    "TypedDict and JSON-schema variants, which accept the partial object, pass"
)
_QWEN_V1_DICT = (
    "Qwen2.5-Coder-0.5B adds an 'answer' key to the Joke object when the schema is the "
    "pydantic.v1 Joke.schema() dict, which allows other keys; the test wants exactly "
    "setup and punchline"
)
REMAINING_XFAILS = {
    "test_agent_loop": _AGENT,
    "test_unicode_tool_call_integration": _UNICODE,
    "test_structured_output": _JOKE,
    "test_structured_output_async": _JOKE,
    "test_structured_output_pydantic_2_v1": _JOKE,
}
# Strict (an XPASS fails the run) except the two structured-output overrides, whose
# typeddict / json_schema parameters pass: test_structured_output_dict_schemas* enforce those.
_NOT_STRICT = {"test_structured_output", "test_structured_output_async"}


class TestChatAgentSpecUnit(ChatModelUnitTests):
    """Construction, binding and serialisation; the model is never loaded."""

    @property
    def chat_model_class(self) -> type[ChatAgentSpec]:
        return ChatAgentSpec

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"store": False}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return {"AGENTSPEC_MODEL": "embedded"}, {"store": False}, {"model_name": "embedded"}


@pytest.mark.integration
class TestChatAgentSpecIntegration(ChatModelIntegrationTests):
    """Every call runs the embedded SmolLM2-135M-Instruct (the default precision, auto:
    w8a16 on a CPU; suffix-cache drafting)."""

    @property
    def chat_model_class(self) -> type[ChatAgentSpec]:
        return ChatAgentSpec

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # No session store (nothing written to disk); short answers keep the suite quick.
        return {"store": False, "max_tokens": 40}

    # -- expected failures: the 135M model's choices, not the integration -----------------
    # Each test below runs (xfail, not skip). A larger model passes them unchanged.

    @pytest.mark.xfail(reason=_AGENT, strict=True)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=_UNICODE, strict=True)
    def test_unicode_tool_call_integration(
        self, model: BaseChatModel, *, tool_choice: str | None = None,
        force_tool_call: bool = True,
    ) -> None:
        super().test_unicode_tool_call_integration(
            model, tool_choice=tool_choice, force_tool_call=force_tool_call
        )

    def test_unicode_tool_call_with_room(self) -> None:
        """The standard unicode test itself, with answers long enough for its call."""
        roomy = self.chat_model_class(**{**self.chat_model_params, "max_tokens": 128})
        ChatModelIntegrationTests.test_unicode_tool_call_integration(self, roomy)

    @pytest.mark.xfail(reason=_JOKE, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model: BaseChatModel, schema_type: Any) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.xfail(reason=_JOKE, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model: BaseChatModel, schema_type: Any) -> None:
        await super().test_structured_output_async(model, schema_type)

    # The two overrides above are xfail as a whole (langchain-tests requires an overridden
    # standard test to be marked so), but only their pydantic parameter fails: these run
    # the standard bodies for the other two schema types and must pass.
    @pytest.mark.parametrize("schema_type", ["typeddict", "json_schema"])
    def test_structured_output_dict_schemas(self, model: BaseChatModel,
                                            schema_type: Any) -> None:
        ChatModelIntegrationTests.test_structured_output(self, model, schema_type)

    @pytest.mark.parametrize("schema_type", ["typeddict", "json_schema"])
    async def test_structured_output_dict_schemas_async(self, model: BaseChatModel,
                                                        schema_type: Any) -> None:
        await ChatModelIntegrationTests.test_structured_output_async(self, model, schema_type)

    @pytest.mark.xfail(reason=_JOKE, strict=True)
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)


@pytest.mark.integration
@pytest.mark.slow
class TestChatAgentSpecQwenIntegration(ChatModelIntegrationTests):
    """The same suite on the agent-grade shipped model, Qwen2.5-Coder-0.5B-Instruct (fp32,
    suffix-cache drafting), in its own Hermes tool format: one expected failure, below."""

    @property
    def chat_model_class(self) -> type[ChatAgentSpec]:
        return ChatAgentSpec

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # fp32 by name (what the expected failure was measured in): the qwen_runtime
        # fixture's runtime, so the integration run loads the 0.5B once.
        return {"model": AGENT_MODEL, "dtype": "float32", "store": False, "max_tokens": 64}

    # Measured 2026-12-02 (greedy, fp32): the pydantic.v1 Joke parses, but the test's last
    # step passes Joke.schema() as a plain JSON-schema dict, which does not forbid other
    # keys (no additionalProperties: false), and Qwen answers {"setup": ..., "punchline": ...,
    # "answer": ...}; the test wants exactly the two keys.
    @pytest.mark.xfail(reason=_QWEN_V1_DICT, strict=True)
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)


def _xfails() -> dict[str, list[str]]:
    """Expected failures marked on the integration class, with their reasons."""
    found: dict[str, list[str]] = {}
    for name, fn in vars(TestChatAgentSpecIntegration).items():
        if not name.startswith("test_"):
            continue
        for mark in getattr(fn, "pytestmark", []):
            if mark.name == "xfail":
                assert mark.kwargs.get("strict") is (name not in _NOT_STRICT), name
                found.setdefault(name, []).append(mark.kwargs["reason"])
    return found


def test_remaining_xfails() -> None:
    """The integration suite's expected failures are exactly REMAINING_XFAILS, each with its
    reason, strict where the whole test fails (a new xfail fails here; a fixed strict one
    fails its own run as XPASS)."""
    assert _xfails() == {n: [reason] for n, reason in REMAINING_XFAILS.items()}


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(not SHIPPED_MODELS[LOOP_MODEL].installed,
                    reason=f"the chunks of {LOOP_MODEL} are not installed (`make qwen15`)")
class TestChatAgentSpecQwen15Integration(ChatModelIntegrationTests):
    """The same suite on the model for stock agent loops, Qwen2.5-Coder-1.5B-Instruct, in the
    default precision (``auto``) and drafting (the session cache): no expected failure."""

    @property
    def chat_model_class(self) -> type[ChatAgentSpec]:
        return ChatAgentSpec

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": LOOP_MODEL, "store": False, "max_tokens": 64}
