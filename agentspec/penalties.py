"""Frequency, presence and repetition penalties inside the speculative loop.

The penalties a request may set (:class:`~agentspec.types.SamplingParams`), applied to the
raw logits ``z`` of the position being predicted, in vLLM's order:

    repetition (vLLM / transformers; Ollama's ``repeat_penalty``), over prompt + output:
        z_v <- z_v / r   if v was seen and z_v > 0
        z_v <- z_v * r   if v was seen and z_v <= 0
    frequency and presence (OpenAI), over the generated tokens only:
        z_v <- z_v - f * c_v - p * [c_v > 0]

with ``c_v`` the number of times ``v`` was generated before the position. Temperature,
top-k and top-p then act on the penalised logits (:func:`agentspec.sampling.process_logits`).

Why per row. A step scores ``[pending, d_1..d_k]`` and gets logits ``[k+1, V]`` whose row
``i`` predicts the token after ``d_1..d_i``. Decoding without drafts would reach that
position only after committing ``d_1..d_i``, so its counts there are the committed ones
*plus* ``d_1..d_i``. Penalising row ``i`` by exactly those counts makes every verified
row the penalised distribution plain decoding would see on that prefix, so every lossless
verifier (greedy, keyed, GBV, rejection) commits what penalised plain decoding commits.
A tree draft's row for node ``n`` counts ``n``'s ancestors (its root-to-node path): the
tokens plain decoding would have committed to reach ``n``. Rows of rejected prefixes are
penalised by a prefix that is never committed, which is harmless: only accepted rows and
the row after them decide the committed tokens.

Cost. Only columns whose penalty can differ from zero are touched: the tokens seen so
far (generated ones only, without a repetition penalty) and the drafted tokens. The
counts are kept incrementally (:meth:`PenaltyState.commit` costs O(committed tokens)), and
:meth:`PenaltyState.apply` gathers ``[R, C]`` logits, penalises them and scatters them back:
O(R * C) for ``R`` rows and ``C`` touched columns, never O(context) per step.

Exactness. Both the plain and the speculative path compute each penalised cell with the
same elementwise function (:func:`penalise_cells`) from the same raw logit and count, so a
cell's value is bit-identical whichever path computes it; a column outside the touched set
has count 0 and is not seen, for which the function is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentspec.types import SamplingParams

__all__ = ["PenaltyState", "chain_prefixes", "penalise_cells", "tree_prefixes"]


def penalise_cells(
    z: torch.Tensor,  # [..., C] raw logits
    count: torch.Tensor,  # [..., C] float32: times generated before the position
    seen: torch.Tensor,  # [..., C] bool: in the prompt or generated before the position
    sampling: SamplingParams,
) -> torch.Tensor:
    """The penalised logits ``[..., C]`` of ``z`` (see the module docstring's formulas).

    Shapes broadcast, so the same function serves one row and ``[R, C]`` blocks: a cell's
    value depends only on its own raw logit, count and seen flag, never on the shape.
    """
    r = sampling.repetition_penalty
    if r != 1.0:
        # transformers' RepetitionPenaltyLogitsProcessor and vLLM: shrink positive logits,
        # push negative ones further down, so a seen token always loses probability.
        z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
    f, p = sampling.frequency_penalty, sampling.presence_penalty
    if f != 0.0 or p != 0.0:
        z = z - (f * count + p * (count > 0).to(count.dtype))
    return z


def chain_prefixes(tokens: Sequence[int]) -> list[list[int]]:
    """Draft tokens before each verify row of a chain: row ``i`` (of ``k + 1``) follows
    ``tokens[:i]``."""
    return [list(tokens[:i]) for i in range(len(tokens) + 1)]


def tree_prefixes(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """Draft tokens before each row of a tree scored as ``[pending, *tokens]``: row 0 is the
    pending token (no draft tokens), row ``n + 1`` follows node ``n``'s root-to-node path.

    ``parents`` index into ``tokens`` (-1: child of the pending root), parents first.
    """
    rows: list[list[int]] = [[]]
    for n, (tok, par) in enumerate(zip(tokens, parents, strict=True)):
        if not -1 <= par < n:
            raise ValueError(f"parent {par} of node {n} must be in [-1, {n})")
        rows.append([*rows[par + 1], tok])
    return rows


class PenaltyState:
    """One request's token counts, kept incrementally, and the per-row penalty.

    Args:
        sampling: The request's penalties (a state is only built when
            ``sampling.penalised``).
        vocab_size: ``V``, the logits per row.
        prompt: The prompt token ids (seen tokens for the repetition penalty).
    """

    def __init__(self, sampling: SamplingParams, vocab_size: int, prompt: Sequence[int]) -> None:
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)  # [V] times generated
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V] in prompt or generated
        # The touched columns in first-seen order, and each one's index among them.
        self._repetition = sampling.repetition_penalty != 1.0
        self._cols: list[int] = []
        self._col_of: dict[int, int] = {}
        self._cols_t = torch.zeros(0, dtype=torch.long)
        if self._repetition:
            ids = sorted({t for t in prompt if 0 <= t < vocab_size})
            self.seen[ids] = True
            self._add_cols(ids)

    def _add_cols(self, ids: Sequence[int]) -> None:
        new = [t for t in ids if t not in self._col_of]
        for t in new:
            self._col_of[t] = len(self._cols)
            self._cols.append(t)
        if new:
            self._cols_t = torch.tensor(self._cols, dtype=torch.long)

    def commit(self, tokens: Sequence[int]) -> None:
        """Count newly committed output tokens (O(len(tokens)))."""
        ids = [t for t in tokens if 0 <= t < self.vocab_size]
        if not ids:
            return
        idx = torch.tensor(ids, dtype=torch.long)
        self.counts.index_put_((idx,), torch.ones(len(ids)), accumulate=True)
        self.seen[idx] = True
        self._add_cols(ids)

    def apply(self, logits: torch.Tensor, prefixes: Sequence[Sequence[int]]) -> None:
        """Penalise ``logits`` ``[R, V]`` in place; row ``j`` by the committed counts plus
        the draft tokens ``prefixes[j]`` before it (:func:`chain_prefixes`,
        :func:`tree_prefixes`)."""
        rows = logits.shape[0]
        if len(prefixes) != rows:
            raise ValueError(f"{rows} logit rows but {len(prefixes)} draft prefixes")
        extra = sorted({t for p in prefixes for t in p
                        if t not in self._col_of and 0 <= t < self.vocab_size})
        cols = self._cols_t
        if extra:
            cols = torch.cat([cols, torch.tensor(extra, dtype=torch.long)])
        if cols.numel() == 0:
            return
        col_of = self._col_of
        if extra:
            col_of = {**col_of, **{t: len(self._cols) + j for j, t in enumerate(extra)}}
        n = cols.numel()
        count = self.counts[cols].expand(rows, n).clone()  # [R, C]
        seen = self.seen[cols].expand(rows, n).clone()  # [R, C]
        # The draft tokens of each row's own prefix, as (row, column) pairs.
        r_idx = [j for j, p in enumerate(prefixes) for t in p if 0 <= t < self.vocab_size]
        c_idx = [col_of[t] for p in prefixes for t in p if 0 <= t < self.vocab_size]
        if r_idx:
            at = (torch.tensor(r_idx, dtype=torch.long), torch.tensor(c_idx, dtype=torch.long))
            count.index_put_(at, torch.ones(len(r_idx)), accumulate=True)
            seen[at] = True
        # The counts live on the CPU; the penalised cells go where the logits are (a no-op
        # for the target's logits, which come back to the CPU).
        dev = logits.device
        cols, count, seen = cols.to(dev), count.to(dev), seen.to(dev)
        with torch.inference_mode():  # the target's logits are inference tensors
            raw = logits[:, cols].float()  # [R, C]
            logits[:, cols] = penalise_cells(raw, count, seen, self.sampling).to(logits.dtype)
