"""Tool formats as data: choice from the template, rendering, parsing, grammars, streaming.

The models of the Llama 3.x and Mistral families are not shipped, so their formats are
checked on small templates of those families (tests/fixtures/templates) over a byte-level
tokenizer built here, with the families' tags as added tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentspec.chat.formats import FORMATS, choose_tool_format
from agentspec.chat.formats.fallback import FallbackFormat
from agentspec.chat.formats.llama3 import PINNED_DATE
from agentspec.chat.grammar import GrammarCompiler
from agentspec.errors import ConfigError, GrammarError

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_abc", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "18 C"},
]
# family -> (template, eos, special tokens, non-special added tokens)
FAMILIES: dict[str, tuple[str, str, list[str], list[str]]] = {
    "hermes": ("hermes.jinja", "<|im_end|>", ["<|im_start|>", "<|im_end|>"],
               ["<tool_call>", "</tool_call>"]),
    "llama3_json": ("llama3.jinja", "<|eot_id|>",
                    ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>", "<|python_tag|>"], []),
    "mistral": ("mistral_v3.jinja", "</s>", ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                                            "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                            "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], []),
    "mistral_v11": ("mistral_v11.jinja", "</s>", ["<s>", "</s>", "[INST]", "[/INST]",
                                                  "[TOOL_CALLS]", "[ARGS]", "[AVAILABLE_TOOLS]",
                                                  "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                                                  "[/TOOL_RESULTS]"], []),
}


def byte_tokenizer(template: str | None, eos: str, special: list[str], added: list[str]) -> Any:
    """A byte-level tokenizer (one token per byte) with the given added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    tok.add_special_tokens({"eos_token": eos, "additional_special_tokens": special})
    tok.add_tokens(added)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def toks() -> dict[str, Any]:
    out = {name: byte_tokenizer((TEMPLATES / tpl).read_text(), eos, sp, add)
           for name, (tpl, eos, sp, add) in FAMILIES.items()}
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    out["fallback"] = byte_tokenizer(chatml, "<|im_end|>", ["<|im_start|>", "<|im_end|>"], [])
    return out


def test_format_is_chosen_from_the_template(toks: dict[str, Any]) -> None:
    for name, tok in toks.items():
        assert choose_tool_format(tok).name == name
    # Tags that are single tokens become token references.
    hermes = choose_tool_format(toks["hermes"])
    assert set(hermes.tag_ids) == {"<tool_call>", "</tool_call>"}
    assert hermes.tag("<tool_call>") == f"<[{hermes.tag_ids['<tool_call>']}]>"
    assert choose_tool_format(toks["fallback"]).tag("<tool_call>") == '"<tool_call>"'


def test_explicit_format_response_template_and_unknown_syntax(toks: dict[str, Any]) -> None:
    assert choose_tool_format(toks["fallback"], "hermes").name == "hermes"
    with pytest.raises(ConfigError, match="tool_format 'nope' is unknown"):
        choose_tool_format(toks["fallback"], "nope")
    tok = byte_tokenizer(toks["fallback"].chat_template, "<|im_end|>", ["<|im_end|>"], [])
    tok.response_template = {"tool_calls": {"open": "[TOOL_CALLS]", "content": "json"}}
    assert choose_tool_format(tok).name == "mistral"
    tok.response_template = {"tool_calls": {"open": "<function=", "content": "xml"}}
    with pytest.raises(ConfigError, match="pass tool_format"):
        choose_tool_format(tok)
    odd = byte_tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}"
                         "{% if tools %}FUNCS {{ tools | tojson }}{% endif %}", "</s>", [], [])
    with pytest.raises(ConfigError, match="pass tool_format="):
        choose_tool_format(odd)


def test_native_rendering_is_the_template_with_tools(toks: dict[str, Any]) -> None:
    for name in ("hermes", "llama3_json", "mistral", "mistral_v11"):
        tok, fmt = toks[name], choose_tool_format(toks[name])
        ids = fmt.render(tok, CONVERSATION, TOOLS)
        text = tok.decode(ids)
        assert '"get_time"' in text and "18 C" in text, name
        assert "You are a helpful assistant with access" not in text  # no foreign preamble
    llama = choose_tool_format(toks["llama3_json"]).render(toks["llama3_json"], CONVERSATION,
                                                           TOOLS)
    assert f"Today Date: {PINNED_DATE}" in toks["llama3_json"].decode(llama)
    # Mistral templates refuse OpenAI ids: they are mapped to 9 alphanumerics, the same in
    # the call and in its result.
    text = toks["mistral"].decode(choose_tool_format(toks["mistral"]).render(
        toks["mistral"], CONVERSATION, TOOLS))
    cid = json.loads(text.split("[TOOL_CALLS] ")[1].split("</s>")[0])[0]["id"]
    assert len(cid) == 9 and cid.isalnum() and f'"call_id": "{cid}"' in text
    # The fallback is today's preamble.
    fb = toks["fallback"].decode(FallbackFormat().render(toks["fallback"], CONVERSATION, TOOLS))
    assert "You are a helpful assistant with access" in fb and "<tool_response>" in fb


ANSWERS = {
    "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
              "</tool_call>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    "mistral_v11": '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
    "fallback": 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                "</tool_call>",
}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_each_format_parses_its_own_calls(name: str) -> None:
    fmt = FORMATS[name]()
    parsed = fmt.parse(ANSWERS[name], ["get_weather", "get_time"])
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather",
                                                                   {"city": "Oslo"})]
    assert parsed.content in ("", "Sure.") and not parsed.invalid_tool_calls
    bad = fmt.parse(ANSWERS[name].replace("get_weather", "get_wether"), ["get_weather"])
    assert not bad.tool_calls and (bad.invalid_tool_calls or name in ("hermes", "llama3_json"))
    assert fmt.parse("Just prose.", ["get_weather"]).content == "Just prose."


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_call_example_is_the_formats_own_syntax(name: str) -> None:
    fmt = FORMATS[name]()
    example = fmt.call_example("get_weather", '{"city": "Oslo"}')
    parsed = fmt.parse(example, ["get_weather"])
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather",
                                                                   {"city": "Oslo"})]
    assert parsed.content == "" and not parsed.invalid_tool_calls
    # Only the fallback's template says nothing about calls (agentspec's preamble does).
    assert fmt.template_instructs is (name != "fallback")


def test_hermes_takes_bare_and_fenced_calls_of_bound_tools_only() -> None:
    fmt = FORMATS["hermes"]()
    body = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for text in (body, f"```json\n{body}\n```", f"[{body}, {body}]"):
        assert fmt.parse(text, ["get_weather"]).tool_calls, text
    assert not fmt.parse('{"name": "x", "age": 3}', ["get_weather"]).tool_calls
    assert not fmt.parse(body, None).tool_calls  # no bound tools: plain JSON content


def _grammar_ids(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_grammars_accept_the_models_own_syntax(toks: dict[str, Any], name: str) -> None:
    tok = toks[name]
    fmt = choose_tool_format(tok, name)
    compiler = GrammarCompiler.from_hf(tok, len(tok))
    answer = ANSWERS[name].removeprefix("Sure.\n").removeprefix("Sure.")
    ids = _grammar_ids(tok, answer)
    for choice in ("required", "get_weather", "auto"):
        matcher = compiler.constraint(fmt.grammar(TOOLS, choice) or "").matcher
        assert matcher.validate_tokens(ids) == len(ids), (name, choice)
    forced = compiler.constraint(fmt.grammar(TOOLS, "get_time") or "").matcher
    assert forced.validate_tokens(ids) < len(ids)  # the other tool is not allowed
    auto = compiler.constraint(fmt.grammar(TOOLS, "auto") or "").matcher
    prose = _grammar_ids(tok, "It is sunny.")
    assert auto.validate_tokens(prose) == len(prose)
    none = fmt.grammar(TOOLS, "none")
    if none is not None:  # "none" forbids the call, allows the prose
        assert compiler.constraint(none).matcher.validate_tokens(prose) == len(prose)
        assert compiler.constraint(none).matcher.validate_tokens(ids) < len(ids)
    if any(answer.startswith(t) for t in fmt.tag_ids):  # a tag spelled in bytes is not it
        spelled = [t for ch in answer[:12] for t in _grammar_ids(tok, ch)]
        opening = compiler.constraint(fmt.grammar(TOOLS, "required") or "").matcher
        assert opening.validate_tokens(spelled) == 0


def test_grammar_and_prefix_misuse_name_the_tool() -> None:
    fmt = FORMATS["hermes"]()
    with pytest.raises(GrammarError, match="needs at least one bound tool"):
        fmt.grammar([], "required")
    with pytest.raises(GrammarError, match="names no bound tool"):
        fmt.forced_prefix("nope", TOOLS)
    assert FORMATS["fallback"]().grammar(TOOLS, "none") is None
    assert fmt.grammar([], "none") is None and fmt.forced_prefix("auto", TOOLS) == ""
    assert fmt.forced_prefix("get_time", TOOLS) == ('<tool_call>\n{"name": "get_time", '
                                                    '"arguments": ')


def test_decode_keeps_special_tags(toks: dict[str, Any]) -> None:
    tok = toks["mistral"]
    fmt = choose_tool_format(tok)
    ids = _grammar_ids(tok, ANSWERS["mistral"] + "</s>")
    assert "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)
    drop = set(tok.all_special_ids) - fmt.keep_ids()
    text = tok.decode([t for t in ids if t not in drop])
    assert fmt.parse(text, ["get_weather"]).tool_calls


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_streaming_holds_calls_back(name: str) -> None:
    fmt = FORMATS[name]()
    answer = ANSWERS[name]
    shown = max(i for i in range(len(answer) + 1) if fmt.hold_from(answer[:i]) == i)
    visible = answer[:shown]
    assert "get_weather" not in visible and visible.strip() in ("", "Sure.")
    assert fmt.hold_from("It is sunny.") == len("It is sunny.")
