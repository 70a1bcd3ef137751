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

__all__ = ["MAX_STOP", "MAX_STOP_CHARS", "check_stops", "check_tool_replies",
           "check_tool_schemas"]

MAX_STOP = 4  # OpenAI's limit on stop sequences
# Longest stop sequence (characters). Each decode step tries every prefix of every stop
# against the answer's tail (agentspec.engine's streaming hold-back: work quadratic in the
# stop's length, on the thread serving all requests), and a streamed answer holds back up
# to a stop's length minus one character; 256 covers every end-of-answer marker and
# tool-call tag in use (tens of characters) with room.
MAX_STOP_CHARS = 256

_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_stops(stops: Sequence[str], max_stops: int = MAX_STOP) -> None:
    """A request's stop sequences: at most ``max_stops``, each non-empty and bounded.

    Args:
        stops: The caller's stop sequences (not the tool format's own, which are trusted).
        max_stops: How many a caller may pass (OpenAI allows four).

    Raises:
        ConfigError: naming the sequence at fault and the bound.
    """
    if len(stops) > max_stops:
        raise ConfigError(f"at most {max_stops} stop sequences are allowed, got {len(stops)}")
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not s:
            raise ConfigError(f"stop sequence {i} must be a non-empty string, got {s!r}")
        if len(s) > MAX_STOP_CHARS:
            raise ConfigError(f"stop sequence {i} is {len(s)} characters long; the limit is "
                              f"{MAX_STOP_CHARS}")


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
