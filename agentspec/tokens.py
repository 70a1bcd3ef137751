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

    The one copy every caller uses (the model drafter's KV-cache sync, the session cache's
    new part of a turn and its score calibration, HVD's draft labels). Slices are compared
    in C (a 32k-token prefix in ~0.1 ms): first whole (the usual case: one sequence extends
    the other), then bisecting to the first difference, then a short Python scan.
    """
    n = min(len(a), len(b))
    x, y = list(a[:n]), list(b[:n])
    if x == y:
        return n
    lo, hi = 0, n  # x[:lo] == y[:lo]; x[:hi] != y[:hi]
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if x[lo:mid] == y[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and x[lo] == y[lo]:
        lo += 1
    return lo
