"""Structural checks of an OpenAI-shaped conversation before it reaches the chat template.

The chat template renders whatever it is given; a tool result that answers no call, or two
tools sharing one name, still produce a prompt, and the model then answers a conversation
the client never meant. Both front ends (the HTTP server and the LangChain adapter) run these
checks so such inputs fail early with a :class:`~agentspec.errors.ConfigError` naming the
message or tool at fault, instead of being accepted with a 200.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentspec.errors import ConfigError

__all__ = ["check_tool_replies", "check_tool_schemas"]

_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_tool_replies(messages: Sequence[dict[str, Any]]) -> None:
    """Every ``tool`` message must answer a call of an earlier assistant message.

    Rules: a tool message names the call it answers (``tool_call_id``); some earlier
    assistant message made tool calls; when those calls carry ids, the tool message's id is
    one of them. (Calls without ids, which some clients send, cannot be matched by id, so
    only the first two rules apply to them.)

    Raises:
        ConfigError: naming the index of the offending message.
    """
    ids: set[str] = set()
    calls = 0
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role == "assistant":
            for call in msg.get("tool_calls") or []:
                calls += 1
                cid = call.get("id") if isinstance(call, dict) else getattr(call, "id", None)
                if cid:
                    ids.add(str(cid))
        elif role == "tool":
            cid = msg.get("tool_call_id")
            if not cid:
                raise ConfigError(f"messages[{i}]: a tool message needs tool_call_id")
            if not calls:
                raise ConfigError(
                    f"messages[{i}]: tool message {cid!r} answers no call; no earlier "
                    "assistant message made a tool call"
                )
            if ids and str(cid) not in ids:
                raise ConfigError(
                    f"messages[{i}]: tool_call_id {cid!r} matches no earlier tool call "
                    f"(known ids: {sorted(ids)})"
                )


def check_tool_schemas(tools: Sequence[dict[str, Any]]) -> None:
    """Tool names are unique and each ``parameters`` is a JSON-schema object.

    Checked: ``parameters`` (when given) is an object whose ``type`` is a JSON type name,
    ``properties`` maps names to schema objects and ``required`` lists strings.

    Raises:
        ConfigError: naming the tool (by index and name) and the field at fault.
    """
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            raise ConfigError(f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if name in seen:
            raise ConfigError(
                f"tools[{i}]: duplicate tool name {name!r} (also tools[{seen[name]}]); "
                "a call could not say which one it means"
            )
        seen[str(name)] = i
        params = fn.get("parameters")
        if params is None:
            continue
        where = f"tools[{i}] ({name!r}).function.parameters"
        if not isinstance(params, dict):
            raise ConfigError(f"{where} must be a JSON schema object")
        kind = params.get("type", "object")
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in _JSON_TYPES for k in kinds):
            raise ConfigError(f"{where}.type must be a JSON type name, got {kind!r}")
        props = params.get("properties")
        if props is not None and (
            not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values())
        ):
            raise ConfigError(f"{where}.properties must map names to schema objects")
        required = params.get("required")
        if required is not None and (
            not isinstance(required, list) or not all(isinstance(r, str) for r in required)
        ):
            raise ConfigError(f"{where}.required must be a list of property names")
