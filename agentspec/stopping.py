"""Where a request's output ends, what of it is certain enough to stream, and cancelling.

The engine commits several tokens per step; the output must still end exactly where
one-token-at-a-time decoding would: at the first EOS, the token completing a stop string,
or ``max_tokens``. A streamed delta must never be taken back, so text that could still
become a stop string, or ends inside a multi-byte character, is held back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from agentspec.errors import Cancelled, ConfigError
from agentspec.tokens import cut_at_stop

Decode = Callable[[Sequence[int]], str]


class StopChecker:
    """Finds where the output must end: EOS, a stop string, or max_tokens.

    Checked token by token within each committed block, so the result is exactly what
    one-token-at-a-time decoding would stop at.
    """

    def __init__(
        self, eos: set[int], stop: Sequence[str], decode: Decode | None, max_tokens: int
    ) -> None:
        if stop and decode is None:
            raise ConfigError("stop strings need a decode function (a tokenizer)")
        self.eos, self.stop, self.decode, self.max_tokens = eos, list(stop), decode, max_tokens

    def cut(self, generated: list[int], block: list[int]) -> tuple[list[int], str | None]:
        """Return the part of ``block`` to keep and the finish reason if the request ends.

        The earliest end wins: a stop string completed by a token before an EOS in the same
        block ends the output there, exactly as token-by-token decoding would.
        """
        kept = block[: self.max_tokens - len(generated)]
        eos_at = next((i for i, tok in enumerate(kept) if tok in self.eos), None)
        if eos_at is not None:
            kept = kept[: eos_at + 1]
        if self.stop and self.decode is not None and kept:
            text = self.decode(generated + kept)
            if any(s in text for s in self.stop):
                # Find the first token whose prefix completes a stop string.
                for i in range(len(kept)):
                    t = self.decode(generated + kept[: i + 1])
                    if any(s in t for s in self.stop):
                        return kept[: i + 1], "stop"
        if eos_at is not None:
            return kept, "stop"
        if len(generated) + len(kept) >= self.max_tokens:
            return kept, "length"
        return kept, None

    def final_text(self, tokens: list[int]) -> str:
        """Decoded output, cut before the first stop string."""
        if self.decode is None:
            return ""
        return cut_at_stop(self.decode(tokens), self.stop)


def check_cancel(cancel: threading.Event | None, message: str = "the request was cancelled"
                 ) -> None:
    """Raise :class:`Cancelled` (with ``message``) once the caller set ``cancel``."""
    if cancel is not None and cancel.is_set():
        raise Cancelled(message)


def certain_length(text: str, stop: Sequence[str]) -> int:
    """Characters of ``text`` (the output so far, cut before any stop string) that no later
    token can change: a trailing replacement character (a multi-byte character still being
    decoded) and a tail that is a prefix of a stop string are held back."""
    safe = len(text)
    if text.endswith("\ufffd"):
        safe = len(text.rstrip("\ufffd"))
    for s in stop:
        for n in range(min(len(s) - 1, safe), 0, -1):
            if text[:safe].endswith(s[:n]):
                safe = min(safe, len(text[:safe]) - n)
                break
    return safe
