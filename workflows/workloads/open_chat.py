"""Open chat: the control workload with little repetition.

Short, varied questions and tasks (one or two user turns each) where the answer is mostly
new text, not a copy of the prompt or of earlier outputs. A cache drafter should gain little
here; the workload shows what a method costs when drafts rarely pay off.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from agentspec.errors import BenchmarkError
from workflows.workloads.base import Message, WorkloadRequest

# Each entry is one session: its user turns in order. A second turn follows up on the
# model's first answer, so the session has a real (short) history.
PROMPTS: tuple[tuple[str, ...], ...] = (
    ("What is the capital of Australia?",),
    ("Give me three tips for falling asleep faster.",),
    ("Explain what a prime number is to a ten-year-old.", "Now give two examples."),
    ("Write a haiku about autumn rain.",),
    ("What is the difference between weather and climate?",),
    ("Suggest a name for a bakery that sells only croissants.", "Why did you pick that one?"),
    ("How many minutes are there in a week? Show the calculation.",),
    ("Translate 'good morning, how are you?' into Spanish.",),
    ("What causes the seasons on Earth?",),
    ("Write a two-sentence story about a lost umbrella.", "Give it a happy ending."),
    ("Name four instruments in a string quartet.",),
    ("What should I pack for a one-day hike?",),
    ("Why is the sky blue? Answer in two sentences.",),
    ("Give me a simple recipe for scrambled eggs.", "How do I make them fluffier?"),
    ("What does a compiler do?",),
    ("List three benefits of learning a second language.",),
    ("Who wrote 'Pride and Prejudice', and when was it published?",),
    ("Write a polite email declining a meeting invitation.", "Make it shorter."),
    ("What is photosynthesis?",),
    ("Recommend a board game for four players and explain the rules briefly.",),
)


class ChatSession:
    """One open-chat conversation of one or two user turns.

    Args:
        session_id: Id of the session.
        questions: The user turns in order.
        max_tokens: Generation budget per request.
    """

    def __init__(self, session_id: str, questions: tuple[str, ...], max_tokens: int) -> None:
        self.session_id = session_id
        self._questions = questions
        self.turns = len(questions)  # requests this session will make
        self._max_tokens = max_tokens
        self._messages: list[Message] = []
        self._turn = 0

    def next_request(self, last_output: str | None) -> WorkloadRequest | None:
        """The next user turn, after the model's previous answer; ``None`` when done."""
        if self._turn >= len(self._questions):
            return None
        if self._turn > 0:
            self._messages.append({"role": "assistant", "content": last_output or ""})
        self._messages.append({"role": "user", "content": self._questions[self._turn]})
        self._turn += 1
        return WorkloadRequest(
            messages=[dict(m) for m in self._messages],
            max_tokens=self._max_tokens,
            meta={"turn": self._turn},
        )

    def turn_metrics(self, request: WorkloadRequest, output: str) -> dict[str, Any]:
        """Only the answer's length: open chat has no reference answer."""
        return {"output_chars": len(output)}


class ChatWorkload:
    """Twenty short open-chat sessions (the low-repetition control).

    Args:
        data_dir: Accepted so every workload is built the same way; unused (the prompts
            are part of this module).
        max_tokens: Generation budget per request.
    """

    name = "chat"

    def __init__(
        self, data_dir: str | os.PathLike[str] | None = None, max_tokens: int = 128
    ) -> None:
        self.max_tokens = max_tokens

    def sessions(self, limit: int | None, turns: int) -> Iterator[ChatSession]:
        """Fresh sessions in a fixed order (at most ``limit``; at most ``turns`` turns each).

        Raises:
            BenchmarkError: ``turns`` < 1 or ``limit`` < 0.
        """
        if turns < 1 or (limit is not None and limit < 0):
            raise BenchmarkError(f"need turns >= 1 and limit >= 0, got {turns=} {limit=}")
        prompts = PROMPTS if limit is None else PROMPTS[:limit]
        for i, questions in enumerate(prompts):
            yield ChatSession(f"chat-{i:02d}", questions[:turns], self.max_tokens)
