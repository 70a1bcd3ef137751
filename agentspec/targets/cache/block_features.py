"""The target's final-norm features kept beside its KV, so prefix reuse can feed an EAGLE head.

An EAGLE head (:mod:`agentspec.drafters.model.eagle`) runs its own causal layer over a
feature row of *every* prompt position. A prefill that reuses KV computes only the tail, so
the rows of the reused positions have to come from where the KV came from: the live cache
(the request that just ended) or the prefix store's blocks
(:mod:`agentspec.targets.cache.prefix_cache`, which keeps each block's rows with its keys and
values). :class:`FeatureLog` is the live half: the rows of every position the target's KV
cache holds, in step with its token ids, so a reused prefix's rows can be read back and a
finished request's rows stored with its blocks.

Rows are kept in the model's dtype, exactly as the final norm produced them: a drafter fed
stored rows sees the very values it would have seen when those positions were fed.
"""

from __future__ import annotations

import torch

from agentspec.errors import ConfigError

_MIN_CAPACITY = 64  # rows allocated at first: one block of a short prompt, without regrowth


class FeatureLog:
    """Feature rows of the positions a KV cache holds (row i: position i), in one buffer.

    Rows before :attr:`first` are unknown: the prefix they belong to was reused from blocks
    stored without features (files of an older version), or the log lost step with the
    cache. A prefix is usable for a drafter only when it starts at :attr:`first` ``== 0``.

    The buffer grows by half when full and a cut only moves the fill mark (as the target's
    KV cache does, :mod:`agentspec.targets.cache.kv_cache`), so appending a step's rows costs
    those rows, not the context.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None  # [capacity, H], model dtype and device
        self.n = 0  # positions held
        self.first = 0  # rows 0 .. first-1 are unknown

    def __len__(self) -> int:
        return self.n

    def _reserve(self, n: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buf
        if (buf is not None and buf.shape[0] >= n and buf.shape[1] == like.shape[-1]
                and buf.dtype == like.dtype and buf.device == like.device):
            return buf
        cap = max(n, _MIN_CAPACITY, 0 if buf is None else buf.shape[0] * 3 // 2)
        grown = torch.empty(cap, like.shape[-1], dtype=like.dtype, device=like.device)
        if buf is not None and self.first < self.n and buf.shape[1] == like.shape[-1]:
            # Only the known rows were ever written (forget() may hold more positions than
            # the old buffer has rows); a dtype change copies over.
            grown[self.first : self.n] = buf[self.first : self.n]
        else:  # nothing known, or another width: nothing held is comparable any more
            self.first = self.n
        self._buf = grown
        return grown

    def reset(self, rows: torch.Tensor | None = None, n: int = 0) -> None:
        """Start over at ``n`` positions whose rows are ``rows`` ``[n, H]`` (``None``: the
        rows are unknown, e.g. reused from blocks stored without features)."""
        self.n = self.first = 0
        if rows is not None:
            self.append(rows)
        else:
            self.n = self.first = n

    def append(self, rows: torch.Tensor) -> None:
        """Add the rows ``[m, H]`` of the next ``m`` positions (copied)."""
        if rows.dim() != 2:
            raise ConfigError(f"feature rows must be [m, H], got shape {tuple(rows.shape)}")
        m = int(rows.shape[0])
        if not m:
            return
        with torch.inference_mode():  # the buffer is an inference tensor, as the KV is
            buf = self._reserve(self.n + m, rows)
            buf[self.n : self.n + m] = rows
        self.n += m

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (a rollback, or the live cache cut to a prefix)."""
        self.n = max(0, min(self.n, n))
        self.first = min(self.first, self.n)

    def forget(self, n: int) -> None:
        """Hold ``n`` positions of unknown rows: the log fell out of step with the cache
        (never guess which rows are whose)."""
        self.n = self.first = max(0, n)

    def covers(self, n: int) -> bool:
        """Whether the rows of positions ``0 .. n-1`` are all known."""
        return n <= 0 or (self.first == 0 and self.n >= n and self._buf is not None)

    def known(self) -> tuple[torch.Tensor | None, int]:
        """``(rows, first)``: the rows of every position held ``[n, H]`` (a view; rows
        before ``first`` are garbage) and the first known one; ``(None, 0)`` if none is."""
        if self._buf is None or self.first >= self.n:
            return None, 0
        return self._buf[: self.n], self.first

    def view(self, end: int) -> torch.Tensor:
        """The rows of positions ``0 .. end-1`` ``[end, H]``: a view of the buffer, valid
        until the next append (copy it to keep it). Rows before :attr:`first` are garbage;
        callers check :meth:`covers` or slice from :attr:`first`.

        Raises:
            ConfigError: ``end`` past the positions held, or no row was ever appended.
        """
        if self._buf is None or not 0 <= end <= self.n:
            raise ConfigError(f"feature rows 0..{end} asked of a log holding {self.n}")
        return self._buf[:end]


def check_feature_rows(rows: object, dtype: torch.dtype, n: int,
               width: int | None) -> torch.Tensor | None:
    """A block's feature rows as read from disk, checked: ``None`` stays ``None`` (a file
    written without rows); anything else must be ``[n, H]`` in the keys' ``dtype``, with
    ``H == width`` once a width is known.

    Raises:
        ValueError: another shape, dtype or width (the file is refused, as a bad KV layout).
    """
    if rows is None:
        return None
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[0] != n:
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"feature rows {shape} for {n} tokens")
    if rows.dtype != dtype or width not in (None, int(rows.shape[1])):
        raise ValueError("feature rows' width or dtype differ from this model's blocks")
    return rows
