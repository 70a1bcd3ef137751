"""What every tool-call format shares: the interface, message preparation, JSON call bodies.

A :class:`ToolFormat` is the model's own tool dialect as data: how its chat template wants
tool calls and tool results in the conversation (rendered by the template itself, with
``tools=``), which text opens a call in the answer, how a call is parsed back, which grammar
forces or guards a call, which stop strings end an answer. Every face (runtime, server, vLLM
backend, replay, workloads) asks the format instead of spelling a tag itself.

A format is *bound* to a tokenizer (:meth:`ToolFormat.bind`): tags that are single added
tokens of the vocabulary (Qwen2.5's ``<tool_call>`` is token 151657) are then written into
grammars as token references (``<[151657]>``), because llguidance never lets grammar text
match a special token, and are kept when the answer is decoded.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agentspec.errors import ConfigError, GrammarError

__all__ = [
    "InvalidToolCall", "ParsedOutput", "ToolCall", "ToolFormat", "forced_call_prefix",
    "forces_call", "function_of", "json_rule", "parse_call_object", "tool_names",
]

_ROLES = {"system", "user", "assistant", "tool"}

#: llguidance JSON options of tool-call bodies: the separators templates write (``tojson``
#: is ``json.dumps`` with its default ``", "`` / ``": "``); lenient: any schema compiles.
CALL_JSON_STYLE: dict[str, Any] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True,
}


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: a known tool name and an arguments object."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class InvalidToolCall:
    """A call the model attempted but got wrong; ``error`` says how."""

    raw: str
    error: str
    name: str | None = None
    arguments: str | None = None
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedOutput:
    """Model text split into visible content and tool calls."""

    content: str
    tool_calls: list[ToolCall]
    invalid_tool_calls: list[InvalidToolCall]


def function_of(tool: Any) -> dict[str, Any]:
    """The ``function`` object of an OpenAI tool schema (or the schema itself)."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    return fn if isinstance(fn, dict) else {}


def tool_names(tools: Sequence[dict[str, Any]] | None) -> list[str]:
    """Names of OpenAI-style tool schemas."""
    return [fn["name"] for fn in map(function_of, tools or []) if isinstance(fn.get("name"), str)]


def parse_call_object(
    raw: str, known: Collection[str] | None, args_keys: Sequence[str] = ("arguments", "parameters")
) -> ToolCall | InvalidToolCall:
    """One call body ``{"name": ..., "arguments": {...}}`` -> a call, or why it is invalid."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return InvalidToolCall(raw, f"not valid JSON: {exc.msg} at char {exc.pos}")
    if not isinstance(obj, dict):
        return InvalidToolCall(raw, "a tool call must be a JSON object")
    return call_from_parts(raw, obj.get("name"), next(
        (obj[k] for k in args_keys if k in obj), {}), known)


def call_from_parts(raw: str, name: Any, args: Any, known: Collection[str] | None
                    ) -> ToolCall | InvalidToolCall:
    """A call from its name and arguments (an object or its JSON text), checked."""
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    if not isinstance(name, str) or not name:
        return InvalidToolCall(raw, "missing tool name", None, args_text)
    if isinstance(args, str):  # OpenAI style: arguments serialised as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return InvalidToolCall(raw, "arguments are not valid JSON", name, args_text)
    if not isinstance(args, dict):
        return InvalidToolCall(raw, "arguments must be a JSON object", name, args_text)
    if known is not None and name not in known:
        return InvalidToolCall(raw, f"unknown tool {name!r}", name, args_text)
    return ToolCall(name, args)


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark ``%json`` rule body for ``schema`` in the templates' JSON layout."""
    try:
        return "%json " + json.dumps({**schema, "x-guidance": CALL_JSON_STYLE}, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"JSON schema is not serialisable: {exc}") from exc


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema, closed to undeclared keys (OpenAI strict mode's rule; a
    small model otherwise pads calls with invented keys)."""
    fn = function_of(tool)
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise GrammarError(f"tool {fn.get('name')!r} parameters must be a JSON schema object")
    if "properties" in params and "additionalProperties" not in params:
        params = {**params, "additionalProperties": False}
    return params


def chosen_tool(tool_choice: Any) -> str | None:
    """The tool name a ``tool_choice`` forces (``None`` when it names none)."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") or {}
        name = fn.get("name") if isinstance(fn, dict) else None
        return name or tool_choice.get("name")
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "any", "required"):
        return tool_choice
    return None


def forces_call(tool_choice: Any) -> bool:
    """True when ``tool_choice`` forces a tool call (``"required"``/``"any"`` or a name)."""
    return tool_choice not in (None, "auto", "none")


def check_choice(tools: Sequence[dict[str, Any]] | None, tool_choice: Any) -> str | None:
    """Validate ``tool_choice`` against the bound tools; return the forced name if any.

    Raises:
        GrammarError: a forced choice without tools, or a name that is not bound.
    """
    names = tool_names(tools)
    if not forces_call(tool_choice):
        return None
    if not names:
        raise GrammarError(f"tool_choice={tool_choice!r} needs at least one bound tool")
    name = chosen_tool(tool_choice)
    if name is None and tool_choice not in ("any", "required"):
        raise GrammarError(f"tool_choice {tool_choice!r} names no bound tool; bound: {names}")
    if name is not None and name not in names:
        raise GrammarError(f"tool_choice {tool_choice!r} names no bound tool; bound: {names}")
    return name


def forced_call_prefix(tools: Sequence[dict[str, Any]] | None, tool_choice: Any, opening: str,
                       args_key: str = "arguments") -> str:
    """Answer text that forces a call in a format whose call body is the JSON object
    ``{"name": ..., "<args_key>": ...}`` after ``opening`` (the call's tag and separator).

    ``""`` for choices that force nothing (``None``, ``"auto"``, ``"none"``); up to the open
    name for ``"required"`` / ``"any"``; up to the arguments' value for a named tool.

    Raises:
        GrammarError: a forced choice without tools, or a name that is not bound.
    """
    name = check_choice(tools, tool_choice)
    if not forces_call(tool_choice):
        return ""
    head = opening + '{"name": "'
    return head if name is None else f'{head}{name}", "{args_key}": '


def _arguments_dict(args: Any) -> Any:
    """Templates ``tojson`` the arguments: give them the object, not its JSON text (text
    that is not JSON, which some logs hold, is passed on as it is)."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args if args is not None else {}


class ToolFormat:
    """A model's tool-call dialect (see the module docstring). Subclasses set the class
    attributes and override what their family does differently.

    Attributes:
        name: The format's name (``tool_format=`` accepts it).
        tags: Literal markers that may be single tokens of a vocabulary.
        stop: Stop strings added while tools are bound.
    """

    name: ClassVar[str] = ""
    tags: ClassVar[tuple[str, ...]] = ()
    stop: ClassVar[tuple[str, ...]] = ()
    #: Whether the prompt the chat template renders with ``tools=`` already teaches the
    #: call syntax (Qwen2.5's "For each function call, return ... within <tool_call>",
    #: Llama 3.x's "Respond in the format ..."; Mistral models are trained on their
    #: ``[AVAILABLE_TOOLS]`` block, and their tags are control tokens that do not belong in
    #: prompt text). An agent's own system prompt then leaves the syntax to the template;
    #: otherwise it can spell it with :meth:`call_example`.
    template_instructs: ClassVar[bool] = True

    def __init__(self, tag_ids: Mapping[str, int] | None = None) -> None:
        self.tag_ids: dict[str, int] = dict(tag_ids or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tag_ids={self.tag_ids})"

    def bind(self, tokenizer: Any) -> ToolFormat:
        """This format with its tags resolved against ``tokenizer`` (a tag that encodes to
        one added token is written as that token in grammars and kept when decoding)."""
        ids: dict[str, int] = {}
        added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
        for tag in self.tags:
            if tag in added:
                ids[tag] = int(added[tag])
        return type(self)(ids)

    # -- rendering -------------------------------------------------------------------------

    def template_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as chat templates take them: roles checked, ``content`` a string,
        assistant ``tool_calls`` as ``{"id", "type", "function": {"name", "arguments"}}``
        with the arguments an object, tool results as role ``tool`` with ``tool_call_id``.

        Raises:
            ConfigError: an unknown role or non-text content.
        """
        out: list[dict[str, Any]] = []
        for i, msg in enumerate(messages):
            role = msg.get("role") if isinstance(msg, dict) else None
            if role not in _ROLES:
                raise ConfigError(f"message {i} has unsupported role {role!r}; use one of {_ROLES}")
            content = msg.get("content") or ""
            if not isinstance(content, str):
                raise ConfigError(
                    f"message {i} content must be a string, got {type(content).__name__}")
            turn: dict[str, Any] = {"role": role, "content": content}
            calls = msg.get("tool_calls") or []
            if role == "assistant" and calls:
                turn["tool_calls"] = [self._call(c) for c in calls]
            if role == "tool":
                turn["tool_call_id"] = self.call_id(str(msg.get("tool_call_id") or ""))
                if msg.get("name"):
                    turn["name"] = msg["name"]
            out.append(turn)
        return out

    def _call(self, call: dict[str, Any]) -> dict[str, Any]:
        fn = call.get("function", call)
        return {"id": self.call_id(str(call.get("id") or "")), "type": "function",
                "function": {"name": fn.get("name"),
                             "arguments": _arguments_dict(fn.get("arguments"))}}

    def call_id(self, cid: str) -> str:
        """A call id as the template needs it (Mistral's must be 9 alphanumerics)."""
        return cid

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables of the chat template (Llama 3.x: a pinned date)."""
        return {}

    def render(self, tokenizer: Any, messages: Sequence[dict[str, Any]],
               tools: Sequence[dict[str, Any]] | None) -> list[int]:
        """Prompt token ids, ending with the assistant turn's opening, rendered by the
        model's own template with ``tools=``."""
        kwargs = self.template_kwargs()
        if tools:
            kwargs["tools"] = list(tools)
        return apply_template(tokenizer, self.template_messages(messages), **kwargs)

    def render_text(self, tokenizer: Any, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None, generation: bool) -> str:
        """The rendered conversation as text (``generation``: with the assistant opening);
        the trace replay cuts each assistant message out of it."""
        kwargs = self.template_kwargs()
        if tools:
            kwargs["tools"] = list(tools)
        return str(tokenizer.apply_chat_template(
            self.template_messages(messages), tokenize=False, add_generation_prompt=generation,
            **kwargs))

    # -- answers -----------------------------------------------------------------------------

    def forced_prefix(self, tool_choice: Any, tools: Sequence[dict[str, Any]] | None) -> str:
        """Answer text that forces a call when no grammar does (``""``: nothing forced)."""
        raise NotImplementedError

    def parse(self, text: str, known_tools: Collection[str] | None = None) -> ParsedOutput:
        """Split an answer into content and calls (``known_tools``: names of bound tools;
        calls to others are invalid; ``None`` accepts any)."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[dict[str, Any]] | None, tool_choice: Any) -> str | None:
        """llguidance Lark grammar of an answer under ``tool_choice`` (``None``: free).

        Forced choices (``"required"``/``"any"``, a named tool) allow only calls; ``"auto"``
        allows prose and guards a call once the answer opens one (the lazy trigger);
        ``"none"`` allows only prose in formats whose calls have no tag token (Hermes' bare
        JSON opening, Llama 3.x), else it constrains nothing.

        Raises:
            GrammarError: a forced choice without tools, or a name that is not bound.
        """
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        """Where a call starts in streamed ``text``, or where a tail that could still open
        one starts (``len(text)``: everything is plain content so far)."""
        raise NotImplementedError

    def raw_call_text(self, raw: str) -> str:
        """An invalid call's raw text as it stood in the answer (shown as content)."""
        return raw

    def call_example(self, name: str = "<tool>", arguments: str = "{...}") -> str:
        """One call written as the model writes it, for a prompt that teaches the syntax
        (``name`` and ``arguments`` go in verbatim, so they may be placeholders)."""
        return self.raw_call_text(f'{{"name": {json.dumps(name, ensure_ascii=False)}, '
                                  f'"arguments": {arguments}}}')

    # -- helpers -------------------------------------------------------------------------------

    def tag(self, text: str) -> str:
        """Grammar atom for the tag ``text``: its token reference, or the quoted text."""
        tid = self.tag_ids.get(text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)

    def keep_ids(self) -> set[int]:
        """Special token ids the decoder must keep (the tags that are tokens)."""
        return set(self.tag_ids.values())


def hold_for_tag(text: str, tag: str, start: int = 0) -> int:
    """Index of ``tag`` in ``text`` (from ``start``), else of a tail that is a prefix of it."""
    at = text.find(tag, start)
    if at >= 0:
        return at
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return len(text) - n
    return len(text)


def apply_template(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """``apply_chat_template(..., add_generation_prompt=True)`` as a list of ids."""
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **kwargs)
    except Exception as exc:  # jinja raises TemplateError / raise_exception as many types
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"the chat template rejected the conversation: {exc}") from exc
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.S)


def unfence(text: str) -> str:
    """``text`` without a surrounding Markdown code fence (```` ```json ... ``` ````)."""
    m = _FENCE.match(text.strip())
    return m.group(1).strip() if m else text.strip()
