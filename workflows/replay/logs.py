"""Agent logs -> token-level replay sessions for ``agentspec replay``.

Two input formats:

* **SWE-agent ``.traj``**: one JSON document with a ``history`` list of messages (``role``
  system / user / assistant / tool, ``content``; assistant messages may carry
  ``tool_calls``, sometimes as the string ``repr`` of a Python list). One file = one agent
  run = one session.
* **JSONL of OpenAI-format message lists**: one agent run per line, either a bare list of
  messages or an object ``{"messages": [...], "tools": [...], "session": ..., "agent": ...,
  "tenant": ...}`` (all but ``messages`` optional). ``tool_calls`` and ``tool`` messages are
  rendered the way the runtime renders them for the target: in its tool format
  (:func:`agentspec.chat.formats.format_for`; the fallback for templates without tools).

Every assistant message becomes one replayed request: its prompt is the target's chat
template applied to the messages before it (with the assistant opening), its output the
tokens the template renders for the message itself, up to and including the end-of-turn
token. A malformed file raises :class:`TraceFormatError` naming the file and line.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentspec.chat.formats import format_for
from agentspec.errors import AgentSpecError, ConfigError
from agentspec.types import SessionRef, check_id

PACKAGED_TRACES = Path(__file__).parents[1] / "data" / "swe_agent_traces"
SUFFIXES = (".traj", ".jsonl")


class TraceFormatError(AgentSpecError, ValueError):
    """An agent log cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class ReplayTurn:
    """One assistant message as a request: the rendered prompt and the real answer, and
    the messages the prompt renders (what an agent framework sends a chat API)."""

    prompt: list[int]
    output: list[int]
    messages: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ReplaySession:
    """One agent run: who it belongs to and its turns, in order."""

    name: str
    ref: SessionRef
    turns: list[ReplayTurn]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class RawRun:
    """One agent run as read from disk, before tokenisation."""

    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    session: str | None
    agent: str | None
    tenant: str | None
    where: str  # "file" or "file:line", for error messages


def discover(paths: Sequence[str | Path]) -> list[Path]:
    """The log files named by ``paths`` (folders: their ``.traj`` / ``.jsonl``, sorted).

    Raises:
        TraceFormatError: a path does not exist or a folder holds no log file.
    """
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix in SUFFIXES and f.is_file())
            if not found:
                raise TraceFormatError(f"{p}: no .traj or .jsonl files in this folder")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise TraceFormatError(f"{p}: no such file or folder")
    return files


def _parse_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """``tool_calls`` as a list; SWE-agent stores the Python ``repr`` of the list."""
    if value in (None, "", []):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError) as exc:
                raise TraceFormatError(f"{where}: unreadable tool_calls: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise TraceFormatError(f"{where}: tool_calls must be a list of objects")
    return value


def _clean(messages: Any, where: str) -> list[dict[str, Any]]:
    """Keep role / content / tool_calls of each message, checking their types."""
    if not isinstance(messages, list) or not messages:
        raise TraceFormatError(f"{where}: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}: message {i}"
        if not isinstance(m, dict):
            raise TraceFormatError(f"{at} is not an object")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if content is not None and not isinstance(content, str):
            raise TraceFormatError(f"{at}: content must be text, got {type(content).__name__}")
        out.append({"role": m.get("role"), "content": content or "",
                    "tool_calls": _parse_tool_calls(m.get("tool_calls"), at)})
    return out


def read_runs(path: Path) -> list[RawRun]:
    """The agent runs in one ``.traj`` or ``.jsonl`` file.

    Raises:
        TraceFormatError: unreadable JSON, a missing message list, bad message fields.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc}") from None
    if path.suffix == ".traj":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
        if not isinstance(doc, dict) or "history" not in doc:
            raise TraceFormatError(f"{path}:1: a .traj file is an object with a 'history' list")
        return [RawRun(path.stem, _clean(doc["history"], str(path)), None, None, None, None,
                       str(path))]
    runs = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{where}: invalid JSON: {exc.msg}") from None
        if isinstance(row, list):
            row = {"messages": row}
        if not isinstance(row, dict) or "messages" not in row:
            raise TraceFormatError(f"{where}: expected a list of messages or an object with "
                                   "'messages'")
        tools = row.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise TraceFormatError(f"{where}: 'tools' must be a list of function schemas")
        ids = {k: row.get(k) for k in ("session", "agent", "tenant")}
        for k, v in ids.items():
            if v is not None and not isinstance(v, str):
                raise TraceFormatError(f"{where}: '{k}' must be a string")
        runs.append(RawRun(f"{path.stem}-{n}", _clean(row["messages"], where), tools,
                           ids["session"], ids["agent"], ids["tenant"], where))
    return runs


def tokenize_run(run: RawRun, tokenizer: Any, eos_ids: Iterable[int]) -> list[ReplayTurn]:
    """Every assistant message of ``run`` as a (prompt, output) pair of token ids.

    Raises:
        TraceFormatError: a message the chat rendering rejects, or a template whose
            rendering of a message does not extend the rendered prompt.
    """
    fmt = format_for(tokenizer)
    turns = run.messages
    try:
        fmt.template_messages(turns)  # every message checked, not only those replayed
    except ConfigError as exc:
        raise TraceFormatError(f"{run.where}: {exc}") from None
    eos = set(eos_ids)
    out: list[ReplayTurn] = []
    for i, msg in enumerate(turns):
        if msg.get("role") != "assistant" or i == 0:
            continue
        try:
            prompt = fmt.render_text(tokenizer, turns[:i], run.tools, True)
            full = fmt.render_text(tokenizer, turns[: i + 1], run.tools, False)
        except ConfigError as exc:
            raise TraceFormatError(f"{run.where}: {exc}") from None
        if not full.startswith(prompt):
            raise TraceFormatError(f"{run.where}: message {i}: the chat template does not "
                                   "render the answer as a continuation of its prompt")
        ids = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
        end = next((j + 1 for j, t in enumerate(ids) if t in eos), len(ids))
        if end:
            p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            out.append(ReplayTurn(list(p_ids), list(ids[:end]), tuple(turns[:i])))
    return out


def load_sessions(
    paths: Sequence[str | Path],
    tokenizer: Any,
    tenant: str = "default",
    agent: str = "default",
) -> list[ReplaySession]:
    """Read, render and tokenise every agent run under ``paths`` (in file order).

    Args:
        paths: ``.traj`` / ``.jsonl`` files or folders of them.
        tokenizer: The target's tokenizer (its chat template renders the messages).
        tenant: Tenant of runs that do not name one (JSONL rows may).
        agent: Agent of runs that do not name one.

    Raises:
        TraceFormatError: see :func:`discover`, :func:`read_runs`, :func:`tokenize_run`.
    """
    eos = [t for t in (tokenizer.eos_token_id,) if t is not None]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if hasattr(
        tokenizer, "convert_tokens_to_ids") else None
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        eos.append(im_end)
    sessions: list[ReplaySession] = []
    for f in discover(paths):
        for run in read_runs(f):
            try:
                ref = SessionRef(check_id("session", run.session or _safe_id(run.name)),
                                 run.tenant or tenant, run.agent or agent)
            except ConfigError as exc:
                raise TraceFormatError(f"{run.where}: {exc}") from None
            turns = tokenize_run(run, tokenizer, eos)
            if turns:
                sessions.append(ReplaySession(run.name, ref, turns, run.tools))
    if not sessions:
        raise TraceFormatError(f"{', '.join(map(str, paths))}: no assistant turns to replay")
    return sessions


def _safe_id(name: str) -> str:
    """A session id from a file name (ids allow ``[A-Za-z0-9_.:@-]``, 128 characters)."""
    keep = "".join(c if c.isalnum() or c in "_.:@-" else "_" for c in name)
    return keep[-128:].lstrip("_.:@-") or "run"
