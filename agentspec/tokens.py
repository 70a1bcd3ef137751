"""Token-sequence helpers shared by the engine, the drafters, the faces and training.

Each lived in two to four copies before; one definition keeps them from drifting:

* :func:`eos_ids`: a tokenizer's end-of-sequence id(s) as a list (tokenizers give an int,
  a list, or ``None``);
* :func:`cut_at_stop`: text cut before the earliest stop string;
* :func:`common_prefix`: length of the longest common prefix of two token sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["common_prefix", "cut_at_stop", "eos_ids"]


def eos_ids(tokenizer: Any) -> list[int]:
    """The token ids that end a request for ``tokenizer`` (``[]`` when it has none).

    Hugging Face tokenizers expose ``eos_token_id`` as an int, a list of ints (several
    end-of-turn tokens) or ``None``; the engine wants a list.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(t) for t in eos]


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` cut before the earliest occurrence of any stop string (unchanged if none)."""
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``.

    Compares whole slices first (the usual case: one sequence extends the other), then
    binary-searches on prefix equality, so the comparisons run at C speed on long prompts.
    """
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo
