"""What the EAGLE head trains on: sequences with the target's features, packed and batched.

Both recipes end in one shape, :class:`FeatureRows`: right-padded token rows ``[R, W]``,
their features ``[R, W, H]`` (fp16), lengths and first answer positions, all on one device.
The CPU recipe packs its :class:`FeatureSeq` list (:meth:`FeatureRows.from_seqs`); the
self-distillation recipe collects generation batches in a :class:`FeatureStore` and packs
them (:meth:`FeatureStore.pack`). Training and evaluation then cut :class:`Batch` es from the
rows: training by length (:func:`length_batches`, less padding), evaluation in order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from agentspec.errors import TrainingDataError
from agentspec.training.eagle.loss import pair_weights

__all__ = ["Batch", "FeatureRows", "FeatureSeq", "FeatureStore", "length_batches"]


@dataclass(frozen=True)
class FeatureSeq:
    """A sequence and the target's features at every position.

    Attributes:
        tokens: Token ids ``[T]``.
        feats: Final-norm hidden states ``[T, H]`` (fp16 to halve memory).
        start: First answer position: pairs predicting tokens after it are the ones
            drafting meets (earlier ones are the prompt, mostly the chat template).
    """

    tokens: torch.Tensor
    feats: torch.Tensor
    start: int = 0


@dataclass(frozen=True)
class Batch:
    """Rows cut to their widest length, ready for the head's passes.

    Attributes:
        tokens: Token ids ``[B, w]``.
        feats: The target's features ``[B, w, H]`` (float).
        lengths: The rows' lengths ``[B]``.
        starts: The rows' first answer positions ``[B]``.
        pos: The pair positions ``[w-1]`` (``arange``).
    """

    tokens: torch.Tensor
    feats: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    pos: torch.Tensor

    def weights(self, prompt_weight: float) -> torch.Tensor:
        """Pair weights ``[B, w-1]`` (:func:`~.loss.pair_weights`)."""
        return pair_weights(self.lengths, self.starts, int(self.tokens.shape[1]),
                            prompt_weight)


@dataclass(frozen=True)
class FeatureRows:
    """Right-padded sequences and their features, on one device.

    Attributes:
        tokens: Token ids ``[R, W]``, padded after each row's end.
        feats: The target's final-norm features ``[R, W, H]`` (fp16), zeros on padding.
        lengths: The rows' lengths ``[R]``.
        starts: The rows' first answer positions (prompt lengths) ``[R]``.
    """

    tokens: torch.Tensor
    feats: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor

    @classmethod
    def from_seqs(cls, seqs: Sequence[FeatureSeq], pad: int = 0) -> FeatureRows:
        """Pack ``seqs`` (in order) into rows padded with ``pad`` (features with zeros).

        Raises:
            TrainingDataError: no sequence.
        """
        if not seqs:
            raise TrainingDataError("no sequence to pack")
        width = max(int(s.tokens.shape[0]) for s in seqs)
        toks = torch.cat([F.pad(s.tokens.long(), (0, width - int(s.tokens.shape[0])),
                                value=pad)[None] for s in seqs])  # [R, W]
        feats = torch.stack([F.pad(s.feats, (0, 0, 0, width - int(s.feats.shape[0])))
                             for s in seqs])  # [R, W, H]
        lengths = torch.tensor([int(s.tokens.shape[0]) for s in seqs])  # [R]
        starts = torch.tensor([s.start for s in seqs])  # [R]
        return cls(toks, feats, lengths, starts)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        """The padded width ``W``."""
        return int(self.tokens.shape[1])

    def first(self, n: int) -> FeatureRows:
        """The first ``n`` rows."""
        return FeatureRows(self.tokens[:n], self.feats[:n], self.lengths[:n],
                           self.starts[:n])

    def positions(self, prompt_weight: float) -> int:
        """Pairs of non-zero weight (:func:`~.loss.pair_weights`) over every row."""
        weights = pair_weights(self.lengths, self.starts, self.width, prompt_weight)
        return int((weights > 0).sum())  # [R, W-1] -> one read

    def batch(self, rows: torch.Tensor | slice, width: int) -> Batch:
        """Rows ``rows`` (indices or a slice) cut to ``width`` columns, features as float.

        Args:
            rows: Row indices ``[B]`` on the rows' device, or a slice.
            width: Columns kept (at least the rows' longest length).
        """
        return Batch(self.tokens[rows, :width], self.feats[rows, :width].float(),
                     self.lengths[rows], self.starts[rows],
                     torch.arange(width - 1, device=self.tokens.device))

    def in_order(self, rows: int) -> list[Batch]:
        """Consecutive batches of ``rows`` rows, each cut to its longest row."""
        out = []
        for i in range(0, len(self), rows):
            out.append(self.batch(slice(i, i + rows), int(self.lengths[i : i + rows].max())))
        return out


def length_batches(lengths: torch.Tensor, rows: int) -> list[tuple[torch.Tensor, int]]:
    """Training batches of similar lengths: row indices ``[B]`` and their width.

    Rows are sorted by length (stable), cut into groups of ``rows``; a group whose
    longest row has fewer than 3 tokens (no pair to learn from) is dropped.

    Args:
        lengths: The rows' lengths ``[R]``.
        rows: Rows per batch.

    Raises:
        TrainingDataError: no row of at least 3 tokens.
    """
    lens = lengths.tolist()
    by_len = sorted(range(len(lens)), key=lambda r: lens[r])
    batches = []
    for i in range(0, len(lens), rows):
        group = by_len[i : i + rows]
        batches.append((torch.tensor(group, device=lengths.device), max(lens[r] for r in group)))
    batches = [b for b in batches if b[1] >= 3]
    if not batches:
        raise TrainingDataError("no training sequence of at least 3 tokens")
    return batches


@dataclass
class FeatureStore:
    """Generated sequences with their features, on the device, per generation batch.

    Attributes:
        tokens: Per batch, right-padded ``[B, W]`` token ids.
        feats: Per batch, the target's final-norm features ``[B, W, H]`` (fp16).
        lengths: Per batch, the rows' lengths ``[B]``.
        starts: Per batch, the rows' prompt lengths ``[B]``.
        held: Per batch, whether each row is held out ``[B]`` (bool).
        sources: Sequences generated per prompt source.
    """

    tokens: list[torch.Tensor] = field(default_factory=list)  # [B, W]
    feats: list[torch.Tensor] = field(default_factory=list)  # [B, W, H] fp16
    lengths: list[torch.Tensor] = field(default_factory=list)  # [B]
    starts: list[torch.Tensor] = field(default_factory=list)  # [B] prompt lengths
    held: list[torch.Tensor] = field(default_factory=list)  # [B] bool
    sources: Counter[str] = field(default_factory=Counter)

    def packed(self, which: bool, pad: int) -> FeatureRows | None:
        """The held-out or training rows, padded to one width.

        Args:
            which: ``True`` for the held-out rows, ``False`` for the training rows.
            pad: The token id that pads short rows.

        Returns:
            The rows, or ``None`` when no such row exists.
        """
        parts = list(zip(self.tokens, self.feats, self.lengths, self.starts, self.held,
                         strict=True))
        if not parts:
            return None
        width = max(int(t.shape[1]) for t, *_ in parts)
        sel = [(t[h == which], f[h == which], n[h == which], s[h == which])
               for t, f, n, s, h in parts]
        sel = [x for x in sel if int(x[0].shape[0])]
        if not sel:
            return None
        toks = torch.cat([F.pad(t, (0, width - int(t.shape[1])), value=pad) for t, *_ in sel])
        feats = torch.cat([F.pad(f, (0, 0, 0, width - int(f.shape[1]))) for _, f, *_ in sel])
        return FeatureRows(toks, feats, torch.cat([x[2] for x in sel]),
                           torch.cat([x[3] for x in sel]))

    def pack(self, pad: int) -> tuple[FeatureRows | None, FeatureRows | None]:
        """The training and the held-out rows (:meth:`packed`); the store lets go of its
        batches, so only the packed copies hold the data afterwards.

        Args:
            pad: The token id that pads short rows.
        """
        train, held = self.packed(False, pad), self.packed(True, pad)
        for part in (self.tokens, self.feats, self.lengths, self.starts, self.held):
            part.clear()
        return train, held
