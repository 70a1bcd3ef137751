"""Phase 1 of the EAGLE self-distillation recipe: the prompts the target continues.

:func:`build_prompt_pool` gathers and varies prompts from the repository's data: open-chat
prompts, the workload documents (edit instructions, relays that re-emit a document, code
edits), the SWE-agent logs cut at every assistant turn, and tool-agent tasks, under a few
system prompts. Each prompt belongs to a *group* (its document, log or task); a share of the
groups is held out and never trained on, so the held-out evaluation of
:mod:`agentspec.training.eagle.recipe` measures text the head has not seen.
:func:`interleave` merges the two splits into generation order.

This module only reads files and renders chat templates: it knows nothing of the device,
the generation loop or the head (:mod:`agentspec.training.eagle.selfgen`,
:mod:`agentspec.training.eagle.fit`).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentspec.errors import TrainingDataError

__all__ = ["PromptItem", "PromptPool", "Render", "build_prompt_pool", "interleave"]

Render = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None"], list[int]]

_SYSTEMS = (
    None,
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly and precisely.",
    "You are an expert software engineer. Think step by step and show your work.",
)
_DOC_SYSTEMS = (
    None,
    "You are a careful document editor. Reproduce the document exactly, applying only the "
    "requested change.",
)
_RELAY_FOLLOW_UPS = (
    "Now undo that change and give me the whole document again.",
    "Show the full document once more, unchanged.",
    "Apply the same change again and print the complete result.",
)
_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file and return its contents.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path of the file."}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write text to a file, replacing it.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the project for a phrase.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "max_results": {"type": "integer"}},
            "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string"}}, "required": ["expression"]}}},
]
_TOOL_TASKS = (
    "Read {f} and summarise it in three sentences.",
    "Open {f}, then tell me how many entries it has.",
    "Find every mention of '{w}' in the project and list the files.",
    "Read {f} and rewrite its first lines as a bulleted list; save the result to notes.md.",
    "Check {f} for mistakes and explain what you would fix.",
)


@dataclass(frozen=True)
class PromptItem:
    """One generation prompt.

    Attributes:
        ids: The rendered prompt's token ids (its tail, at most ``max_prompt``).
        source: Where it comes from (``chat``, ``document``, ``relay``, ``delegate52``,
            ``swe_agent``, ``tool_agent``).
        group: The split key: prompts of one group are all trained on or all held out.
    """

    ids: tuple[int, ...]
    source: str
    group: str


@dataclass
class PromptPool:
    """Prompts split by group, and what was skipped while building them."""

    train: list[PromptItem] = field(default_factory=list)
    held_out: list[PromptItem] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    def counts(self) -> dict[str, Any]:
        """Prompts per source and split (for the report)."""
        return {
            "train": dict(Counter(p.source for p in self.train)),
            "held_out": dict(Counter(p.source for p in self.held_out)),
            "train_groups": len({p.group for p in self.train}),
            "held_out_groups": len({p.group for p in self.held_out}),
            "skipped": dict(self.skipped),
        }


def _text(content: Any) -> str:
    """A message's text (SWE-agent logs hold strings or lists of ``{"text": ...}``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(c.get("text", "")) if isinstance(c, dict) else str(c)
                         for c in content)
    return "" if content is None else str(content)


def _swe_conversations(folder: Path, max_chars: int) -> Iterable[tuple[str, list[dict[str, Any]]]]:
    """(group, messages) cut before every assistant turn of every SWE-agent log in
    ``folder/swe_agent_traces`` (tool observations become user turns; only the tail of a
    long history is kept, after the system prompt)."""
    logs = folder / "swe_agent_traces"
    if not logs.is_dir():
        return
    for path in sorted(logs.glob("*.traj")):
        history = json.loads(path.read_text(encoding="utf-8"))["history"]
        group = "swe:" + path.stem.rsplit("__", 1)[-1]  # the task: several files share one
        msgs: list[dict[str, Any]] = []
        for m in history:
            role = {"tool": "user", "system": "system", "assistant": "assistant"}.get(
                m.get("role"), "user")
            text = _text(m.get("content"))
            if role == "user" and m.get("role") == "tool":
                text = "Observation:\n" + text
            if text.strip():
                msgs.append({"role": role, "content": text[-max_chars:]})
        for k, m in enumerate(msgs):
            if m["role"] != "assistant" or k == 0:
                continue
            head = msgs[:1] if msgs[0]["role"] == "system" else []
            tail: list[dict[str, Any]] = []
            size = sum(len(x["content"]) for x in head)
            for x in reversed(msgs[len(head) : k]):
                if tail and size + len(x["content"]) > max_chars:
                    break
                tail.insert(0, x)
                size += len(x["content"])
            if tail and tail[0]["role"] == "assistant":  # templates want a user turn first
                tail.insert(0, {"role": "user", "content": "Continue."})
            if tail:
                yield group, head + tail


def _delegate52_edits(folder: Path) -> Iterable[tuple[str, str, str]]:
    """(domain, instruction, document) for every edit direction of every DELEGATE-52 row."""
    path = folder / "delegate52_domains.jsonl"
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        doc = str(row.get("seed_excerpt", ""))
        dom = str(row.get("domain") or row.get("title") or doc[:40])
        for edit in row.get("edits") or []:
            for key in ("forward", "backward"):
                if isinstance(edit, dict) and edit.get(key) and doc.strip():
                    yield dom, str(edit[key]), doc


def _held_out(group: str, seed: int, share: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < share


def build_prompt_pool(
    render: Render, documents: Sequence[tuple[str, str]], folder: Path | None,
    chat_prompts: Sequence[str], *, max_prompt: int = 768, val_share: float = 0.08,
    seed: int = 0, deadline: float | None = None,
) -> PromptPool:
    """The generation prompts, split by group (see the module doc).

    Args:
        render: OpenAI-style messages (and tool schemas or ``None``) to prompt token ids.
        documents: (user message, assistant text) pairs (``DrafterData.documents``).
        folder: The data folder (DELEGATE-52 edits, SWE-agent logs), if any.
        chat_prompts: Open-chat prompts (the benchmark's already left out).
        deadline: Stop adding prompts once ``time.monotonic()`` passes it.

    Raises:
        TrainingDataError: no prompt at all.
    """
    rng = random.Random(seed)
    items: list[tuple[str, str, list[dict[str, Any]], list[dict[str, Any]] | None]] = []
    for q in chat_prompts:
        sys_ = rng.choice(_SYSTEMS)
        msgs = ([{"role": "system", "content": sys_}] if sys_ else []) + [
            {"role": "user", "content": q}]
        items.append(("chat", "chat:" + q, msgs, None))
    for user, answer in documents:
        group = "doc:" + hashlib.sha256(answer.encode()).hexdigest()[:16]
        sys_ = rng.choice(_DOC_SYSTEMS)
        base = [{"role": "system", "content": sys_}] if sys_ else []
        items.append(("document", group, [*base, {"role": "user", "content": user}], None))
        items.append(("relay", group, [*base, {"role": "user", "content": user},
                                       {"role": "assistant", "content": answer},
                                       {"role": "user", "content": rng.choice(_RELAY_FOLLOW_UPS)}],
                      None))
    chars = max_prompt * 5
    skipped: Counter[str] = Counter()
    files: list[str] = []
    if folder is not None:
        try:
            for dom, instruction, doc in _delegate52_edits(folder):
                files.append(dom)
                items.append(("delegate52", "doc:d52:" + dom, [
                    {"role": "user", "content": f"{instruction}\n\n{doc}"[-chars:]}], None))
        except (OSError, ValueError, TypeError) as exc:
            skipped[f"delegate52: {type(exc).__name__}"] += 1
        try:
            for group, msgs in _swe_conversations(folder, chars):
                items.append(("swe_agent", group, msgs, None))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            skipped[f"swe_agent: {type(exc).__name__}"] += 1
    names = [f"{d.lower().replace(' ', '_')}.txt" for d in files[:64]] or ["notes.txt"]
    words = [w for w in (q.split()[-1].strip("?.") for q in chat_prompts[:64]) if w] or ["todo"]
    for i, tpl in enumerate(_TOOL_TASKS * 8):
        task = tpl.format(f=names[i % len(names)], w=words[i % len(words)])
        sys_ = "You are an agent with tools. Call a tool when you need information."
        items.append(("tool_agent", "tool:" + task, [{"role": "system", "content": sys_},
                                                     {"role": "user", "content": task}], _TOOLS))
    pool = PromptPool()
    rng.shuffle(items)  # a deadline then cuts every source alike
    for n, (source, group, msgs, tools) in enumerate(items):
        if n >= 64 and deadline is not None and time.monotonic() > deadline:
            skipped["deadline"] += 1
            continue
        try:
            ids = render(msgs, tools)
        except Exception as exc:  # a template may reject a conversation: skip it
            skipped[f"{source}: {type(exc).__name__}"] += 1
            continue
        if len(ids) < 2:
            skipped[f"{source}: empty"] += 1
            continue
        item = PromptItem(tuple(ids[-max_prompt:]), source, group)
        (pool.held_out if _held_out(group, seed, val_share) else pool.train).append(item)
    if not pool.train and not pool.held_out:
        raise TrainingDataError("no generation prompt could be built from the data")
    if not pool.held_out and len(pool.train) > 1:  # tiny data: hold out one group anyway
        last = pool.train[-1].group
        pool.held_out = [p for p in pool.train if p.group == last]
        pool.train = [p for p in pool.train if p.group != last]
    rng.shuffle(pool.train)
    rng.shuffle(pool.held_out)
    pool.skipped = dict(skipped)
    return pool


def interleave(pool: PromptPool, share: float) -> list[tuple[PromptItem, bool]]:
    """Training and held-out prompts merged so every stretch holds ~``share`` held-out ones
    (a short run still evaluates on something).

    Args:
        pool: The prompts, split by group.
        share: The held-out share to keep in every stretch.

    Returns:
        ``(prompt, held_out)`` pairs in generation order.
    """
    out: list[tuple[PromptItem, bool]] = []
    tr, ho = list(pool.train), list(pool.held_out)
    i = j = 0
    while i < len(tr) or j < len(ho):
        if j < len(ho) and (i >= len(tr) or j <= share * (i + j)):
            out.append((ho[j], True))
            j += 1
        else:
            out.append((tr[i], False))
            i += 1
    return out
