"""The langchain-tests standard suites for ``ChatAgentSpec``."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from adapters.langchain import ChatAgentSpec

# Why each remaining expected failure fails: what SmolLM2-135M-Instruct writes (greedy,
# fp32). Tool calling and tool_choice pass since calls are decoded under the tool's schema
# (docs/structured-outputs.md); test_remaining_xfails checks this table.
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
REMAINING_XFAILS = {
    "test_agent_loop": _AGENT,
    "test_structured_output[pydantic]": _JOKE,
    "test_structured_output_async[pydantic]": _JOKE,
    "test_structured_output_pydantic_2_v1": _JOKE,
}
# Strict: a test listed here that starts passing fails the run, so the list cannot go stale.
_PYDANTIC_FAILS = pytest.param("pydantic", marks=pytest.mark.xfail(reason=_JOKE, strict=True))


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
    """Every call runs the embedded SmolLM2-135M-Instruct (fp32, suffix-cache drafting)."""

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

    def test_unicode_tool_call_integration(
        self, model: BaseChatModel, *, tool_choice: str | None = None,
        force_tool_call: bool = True,
    ) -> None:
        # The suite's 40-token answers cannot hold this call: the CJK names and the
        # description alone take ~50 tokens of SmolLM2's vocabulary, so the call was cut
        # inside a string. With room for it, the forced call parses in both languages.
        roomy = self.chat_model_class(**{**self.chat_model_params, "max_tokens": 128})
        super().test_unicode_tool_call_integration(
            roomy, tool_choice=tool_choice, force_tool_call=force_tool_call
        )

    @pytest.mark.parametrize("schema_type", [_PYDANTIC_FAILS, "typeddict", "json_schema"])
    def test_structured_output(self, model: BaseChatModel, schema_type: Any) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.parametrize("schema_type", [_PYDANTIC_FAILS, "typeddict", "json_schema"])
    async def test_structured_output_async(self, model: BaseChatModel, schema_type: Any) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason=_JOKE, strict=True)
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)



def _xfails() -> dict[str, list[str]]:
    """Expected failures marked on the integration class: whole tests and single
    parameters (``name[param]``), with their reasons and strictness."""
    found: dict[str, list[str]] = {}
    for name, fn in vars(TestChatAgentSpecIntegration).items():
        if not name.startswith("test_"):
            continue
        for mark in getattr(fn, "pytestmark", []):
            if mark.name == "xfail":
                assert mark.kwargs.get("strict") is True, name
                found.setdefault(name, []).append(mark.kwargs["reason"])
            if mark.name == "parametrize":
                for p in mark.args[1]:
                    for m in getattr(p, "marks", ()):
                        if m.name == "xfail":
                            assert m.kwargs.get("strict") is True, name
                            found.setdefault(f"{name}[{p.values[0]}]", []).append(
                                m.kwargs["reason"])
    return found


def test_remaining_xfails() -> None:
    """The integration suite's expected failures are exactly REMAINING_XFAILS, each with its
    reason and strict (a new xfail fails here; a fixed one fails its own run as XPASS)."""
    assert _xfails() == {n: [reason] for n, reason in REMAINING_XFAILS.items()}
