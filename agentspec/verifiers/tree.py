"""Greedy verification of a draft tree, one branch per batch row.

A tree draft (e.g. several continuations a suffix cache has seen after the same context)
is verified in one batched forward: each root-to-leaf branch becomes a row
``[pending, *branch]`` (shorter branches padded to the longest), all rows share the cached
prefix, and the target's logits of row ``j`` at position ``i`` condition exactly on
``pending`` followed by the first ``i`` tokens of branch ``j``. Strict greedy verification
accepts, per row, the longest prefix where every drafted token equals the target's argmax,
and the row with the longest accepted prefix wins; the committed block is that prefix plus
the target's argmax after it. Every committed token is the target's greedy choice given
everything before it, so the output is the model's own greedy decoding: lossless,
whatever the tree holds. Padding tokens are ordinary (unlikely) draft tokens and obey the
same rule.

Sampling (temperature > 0) with trees would need a tree-aware acceptance rule
(e.g. SpecTr over branches that share prefixes); this module is greedy only and the engine
refuses sampled requests with tree drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentspec.errors import ConfigError
from agentspec.types import Draft


def branch_rows(
    draft: Draft, pending: int, max_branches: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Batch rows for the first ``max_branches`` branches of ``draft``.

    Args:
        draft: A tree (or chain) draft.
        pending: The last committed token, not yet in the target's cache.
        max_branches: Most rows (the longest branches are kept).

    Returns:
        ``(rows, paths)``: rows ``[pending, *tokens]`` of equal length ``k + 1`` (short
        branches padded by repeating their last token) and each row's node indices.

    Raises:
        ConfigError: ``max_branches`` < 1 or an empty draft.
    """
    if max_branches < 1:
        raise ConfigError(f"max_branches must be >= 1, got {max_branches}")
    paths = draft.branches()[:max_branches]
    if not paths:
        raise ConfigError("cannot build branch rows for an empty draft")
    k = max(len(p) for p in paths)
    rows = []
    for path in paths:
        toks = [draft.tokens[i] for i in path]
        rows.append([pending, *toks, *[toks[-1]] * (k - len(toks))])
    return rows, paths


def greedy_branch_accept(
    rows: Sequence[Sequence[int]], logits: torch.Tensor
) -> tuple[int, int, int]:
    """Pick the branch whose drafted prefix the target's greedy choices confirm longest.

    Args:
        rows: ``K`` rows ``[pending, *drafted]`` of length ``k + 1``.
        logits: Target logits ``[K, k + 1, V]``; row ``j`` position ``i`` predicts the token
            after ``rows[j][: i + 1]``.

    Returns:
        ``(row, accepted, token)``: the winning row, how many of its drafted tokens are
        accepted, and the target's greedy token after them (correction or bonus).
    """
    pred = logits.argmax(-1).cpu()  # [K, k+1] (a no-op for the target's CPU logits)
    drafted = torch.tensor([list(r[1:]) for r in rows], dtype=torch.long)  # [K, k]
    ok = (drafted == pred[:, :-1]).to(torch.int64)  # [K, k]
    accepted = ok.cumprod(dim=1).sum(dim=1)  # [K]: longest all-true prefix per row
    row = int(accepted.argmax())  # first row among equals: the longest branch
    n = int(accepted[row])
    return row, n, int(pred[row, n])


def tree_rows(draft: Draft, pending: int) -> tuple[list[int], list[int]]:
    """The tree of :meth:`TreeTarget.score_tree` for ``draft``: ``(tokens, parents)`` with
    the pending token as root (index 0) and draft node ``i`` at index ``i + 1``."""
    parents = draft.parents if draft.parents is not None else list(range(-1, len(draft.tokens) - 1))
    return [pending, *draft.tokens], [-1, *(p + 1 for p in parents)]


def greedy_tree_accept(
    tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor
) -> tuple[list[int], int]:
    """Walk a tree verified with tree attention along the target's greedy choices.

    From the root, the target's argmax at the current node is looked up among its
    children; a child holding it is accepted and becomes the current node. Every
    committed token is the target's greedy choice after the tokens before it, so the
    result is the model's own greedy decoding (lossless). With distinct tokens among
    siblings (a trie) this is the longest accepted branch.

    Args:
        tokens: ``[pending, *draft]`` (see :func:`tree_rows`).
        parents: Parent index per token, ``-1`` for the root.
        logits: ``[len(tokens), V]``; row ``i`` predicts the token after node ``i``'s path.

    Returns:
        ``(path, token)``: the accepted draft nodes (indices into the draft, root side
        first) and the target's greedy token after them.
    """
    pred = logits.argmax(-1).tolist()  # [n] (.tolist() reads any device)
    children: dict[tuple[int, int], int] = {}
    for i in range(len(tokens) - 1, 0, -1):  # reversed: the first listed sibling wins
        children[(parents[i], int(tokens[i]))] = i
    path: list[int] = []
    cur = 0
    while True:
        nxt = children.get((cur, int(pred[cur])))
        if nxt is None:
            return path, int(pred[cur])
        path.append(nxt - 1)
        cur = nxt
