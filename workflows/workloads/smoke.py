"""The smoke workload: a short agent-style session, fast enough for tests and the demo.

One session of a tool-using agent that edits a small JSON document over a few turns: every
turn resends the tool schema and the current document, the model re-emits the document
with one change, and the next turn edits the model's own output. This is the repetition a
session cache exploits; it finishes in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from workflows.workloads.base import Session, WorkloadRequest

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write the full contents of a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "File path"},
                    "content": {"type": "string", "description": "New file contents"},
                },
                "required": ["path", "content"],
            },
        },
    }
]

DOCUMENT = {
    "service": "checkout",
    "version": "1.4.2",
    "replicas": 3,
    "region": "eu-west-1",
    "timeouts": {"connect_ms": 500, "read_ms": 2000},
    "features": ["coupons", "gift_cards", "express_shipping"],
    "owner": "payments-team",
}

EDITS = [
    "Change the number of replicas to 5.",
    "Set the region to us-east-2.",
    "Add the feature \"loyalty_points\" to the features list.",
    "Change the version to 1.5.0.",
    "Set read_ms to 3000.",
    "Change the owner to platform-team.",
]

_JSON_BLOCK = re.compile(r"```(?:json)?\s*\n(.*?)```", re.S)


def _prompt(doc: str, edit: str) -> str:
    return (
        "Here is the file config.json:\n```json\n" + doc + "\n```\n"
        f"{edit} Reply with the complete updated file in a ```json block."
    )


class SmokeSession:
    """Edits ``config.json`` turn after turn; each turn edits the previous output."""

    def __init__(self, session_id: str, turns: int, offset: int = 0) -> None:
        self.session_id = session_id
        self.turns = turns
        self.offset = offset
        self.doc = json.dumps(DOCUMENT, indent=2)
        self.i = 0

    def next_request(self, last_output: str | None) -> WorkloadRequest | None:
        """The next edit of the current document."""
        if last_output is not None:
            m = _JSON_BLOCK.search(last_output)
            if m and m.group(1).strip():
                self.doc = m.group(1).strip()
        if self.i >= self.turns:
            return None
        edit = EDITS[(self.i + self.offset) % len(EDITS)]
        self.i += 1
        messages = [
            {"role": "system", "content": "You are a careful configuration editor."},
            {"role": "user", "content": _prompt(self.doc, edit)},
        ]
        return WorkloadRequest(messages=messages, max_tokens=160, tools=TOOLS, meta={"edit": edit})

    def turn_metrics(self, request: WorkloadRequest, output: str) -> dict[str, Any]:
        """Whether the output holds a JSON block that parses."""
        m = _JSON_BLOCK.search(output)
        ok = False
        if m:
            try:
                json.loads(m.group(1))
                ok = True
            except ValueError:
                ok = False
        return {"json_block": bool(m), "json_valid": ok}


class SmokeWorkload:
    """A few short agent sessions (``limit`` sessions of ``turns`` turns)."""

    name = "smoke"

    def sessions(self, limit: int | None, turns: int) -> Iterable[Session]:
        """Fresh sessions; session i starts at edit i."""
        n = 2 if limit is None else limit
        return [SmokeSession(f"smoke-{i}", turns, offset=i) for i in range(n)]
