"""The tool agent's tools: OpenAI-style schemas and deterministic fake implementations.

Every result is a JSON-ready dict computed only from the call's arguments (and the session's
files), so a replayed session sees byte-identical tool messages. Weather and search results
are drawn from a generator seeded by a hash of the arguments, not by Python's ``hash``,
which changes between processes.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
import re
from collections.abc import Callable, Mapping
from typing import Any

from agentspec.chat.formats import ToolFormat
from agentspec.chat.formats.fallback import FallbackFormat
from agentspec.chat.tool_calls import parse_tool_calls

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file from the workspace and return its contents.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path relative to the workspace."},
                    "encoding": {"type": "string", "enum": ["utf-8", "latin-1"],
                                 "default": "utf-8"},
                },
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Create or overwrite a text file in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path relative to the workspace."},
                    "content": {"type": "string", "description": "Full new file contents."},
                    "mode": {"type": "string", "enum": ["overwrite", "append"],
                             "default": "overwrite"},
                },
                "required": ["path", "content"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web and return the top results with snippets.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Search terms."},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10,
                                    "default": 3},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather and a daily forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. 'Oslo'."},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"],
                             "default": "celsius"},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7, "default": 1},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / ** % and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "e.g. '(3 + 4) * 2'"},
                },
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    },
]

TOOL_NAMES = frozenset(t["function"]["name"] for t in TOOLS)

_CONDITIONS = ("sunny", "partly cloudy", "overcast", "light rain", "showers", "windy", "fog")
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_TITLE_TAILS = ("a survey", "lessons learned", "a benchmark", "in practice")
_SITES = ("arxiv.org", "github.com", "blog.example.org", "docs.example.com", "news.example.net")
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*(?:</tool_call>|$)", re.DOTALL)


def _rng(*parts: object) -> random.Random:
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def calculate(expression: str) -> float | int:
    """Evaluate an arithmetic expression safely (numbers and + - * / // % ** only).

    Raises:
        ValueError: The expression uses anything else, or an exponent above 100.
        ZeroDivisionError: Division by zero.
    """

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")  # keeps 9**9**9 from hanging a run
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {expression!r}") from exc
    result = ev(tree)
    return round(result, 6) if isinstance(result, float) else result


def parse_tool_call(
    output: str, fmt: ToolFormat | None = None
) -> tuple[str, dict[str, Any]] | None:
    """The first valid call to one of :data:`TOOLS` in a model output, if any.

    With the model's tool format ``fmt``, its parser decides. Without it, or with the
    fallback format (:func:`native_format`), the runtime's default parser
    (:func:`agentspec.chat.tool_calls.parse_tool_calls`) reads the ``<tool_call>`` blocks of
    the fallback and Hermes formats (the two shipped models' dialects) and, as a fallback
    for a small model, an output that is one bare JSON object with ``name`` and
    ``arguments``.

    Returns:
        ``(name, arguments)`` for a known tool with object arguments, else ``None``.
    """
    native = native_format(fmt)
    if native is not None:
        calls = native.parse(output, TOOL_NAMES).tool_calls
        return (calls[0].name, calls[0].arguments) if calls else None
    stripped = output.strip()
    for text in (output, f"<tool_call>{stripped}</tool_call>" if stripped[:1] == "{" else ""):
        calls = parse_tool_calls(text, TOOL_NAMES).tool_calls if text else []
        if calls:
            return calls[0].name, calls[0].arguments
    return None


def native_format(fmt: ToolFormat | None) -> ToolFormat | None:
    """``fmt``, or ``None`` for the fallback format: the fallback's ``<tool_call>`` markup
    is read by this module's own rules (which also take a bare JSON call), as it always
    was, so SmolLM2's bench transcripts and metrics stay the same."""
    return None if fmt is None or isinstance(fmt, FallbackFormat) else fmt


def strip_tool_calls(output: str, fmt: ToolFormat | None = None) -> str:
    """The text of a model output without its tool-call markup.

    An OpenAI-style transcript keeps the assistant's text in ``content`` and the call in
    ``tool_calls``; the renderer appends the call back, so leaving it in the text too
    would show it twice.

    Args:
        output: The model's answer.
        fmt: The model's tool format: its parser finds the calls (Hermes blocks or a bare
            call, Llama 3.x JSON, Mistral ``[TOOL_CALLS]``). ``None`` or the fallback:
            ``<tool_call>{...}`` blocks, and a whole answer that is a bare JSON call.
    """
    native = native_format(fmt)
    if native is not None:
        return native.parse(output, TOOL_NAMES).content.strip()
    text = _TOOL_CALL_RE.sub("", output).strip()
    return "" if text.startswith("{") and parse_tool_call(text) else text


class FakeTools:
    """Deterministic tool implementations over an in-memory workspace.

    Args:
        files: Initial workspace (path -> text); copied, so writes stay in this session.
    """

    def __init__(self, files: Mapping[str, str]) -> None:
        self.files = dict(files)

    def call(self, name: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """Run a tool; bad names or arguments give an ``{"error": ...}`` result, never raise."""
        handler = getattr(self, f"_{name}", None)
        if name not in TOOL_NAMES or handler is None:
            return {"error": f"unknown tool {name!r}"}
        try:
            result: dict[str, Any] = handler(**args)
        except TypeError as exc:
            return {"error": f"bad arguments for {name}: {exc}"}
        except (ValueError, ZeroDivisionError, OverflowError) as exc:
            return {"error": str(exc)}
        return result

    def _read_file(self, path: str, encoding: str = "utf-8") -> dict[str, Any]:
        if path not in self.files:
            return {"error": "FileNotFoundError", "path": path,
                    "available": sorted(self.files)[:8]}
        text = self.files[path]
        return {"path": path, "encoding": encoding, "lines": text.count("\n") + 1,
                "bytes": len(text.encode()), "content": text}

    def _write_file(self, path: str, content: str, mode: str = "overwrite") -> dict[str, Any]:
        old = self.files.get(path, "") if mode == "append" else ""
        self.files[path] = old + content
        return {"ok": True, "path": path, "mode": mode, "bytes_written": len(content.encode())}

    def _search(self, query: str, max_results: int = 3) -> dict[str, Any]:
        rng = _rng("search", query)
        words = [w for w in re.findall(r"[A-Za-z0-9]+", query.lower()) if len(w) > 2] or ["x"]
        slug = "-".join(words[:4])
        results = []
        for i in range(max(1, min(int(max_results), 10))):
            site = rng.choice(_SITES)
            topic = " ".join(w.capitalize() for w in rng.sample(words, min(3, len(words))))
            results.append({
                "rank": i + 1,
                "title": f"{topic}: {rng.choice(_TITLE_TAILS)}",
                "url": f"https://{site}/{slug}/{rng.randrange(1000, 9999)}",
                "snippet": f"We study {query} and report {rng.randrange(2, 40)} findings "
                f"across {rng.randrange(3, 12)} settings.",
            })
        return {"query": query, "results": results}

    def _get_weather(self, city: str, unit: str = "celsius", days: int = 1) -> dict[str, Any]:
        if unit not in ("celsius", "fahrenheit"):
            raise ValueError(f"unit must be celsius or fahrenheit, got {unit!r}")
        rng = _rng("weather", city.strip().lower())
        base = rng.uniform(-5, 30)

        def conv(c: float) -> float:
            return round(c * 9 / 5 + 32 if unit == "fahrenheit" else c, 1)

        forecast = []
        for d in range(max(1, min(int(days), 7))):
            high = base + rng.uniform(0, 8)
            forecast.append({"day": _DAYS[d], "high": conv(high),
                             "low": conv(high - rng.uniform(4, 11)),
                             "condition": rng.choice(_CONDITIONS),
                             "precipitation_chance": rng.randrange(0, 101, 5)})
        return {"city": city, "unit": unit, "current": conv(base), "forecast": forecast}

    def _calculator(self, expression: str) -> dict[str, Any]:
        return {"expression": expression, "result": calculate(expression)}
