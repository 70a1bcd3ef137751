"""Scoring drafts on the target's cache: a chain, a token tree, or a batch of rows.

A chain (:meth:`Scorer.score`) appends tokens to the cache's one row. A tree
(:meth:`Scorer.score_tree`) appends every node in one forward with tree attention and leaves
the cache holding the whole tree until :meth:`Scorer.keep_tree_path` keeps one path; a batch
(:meth:`Scorer.score_batch`) expands the cache to one row per continuation until
:meth:`Scorer.select_row` keeps one. Between the two calls the cache is in a state no other
call can continue from, so the scorer says which state it is in (:attr:`Scorer.mode`:
:class:`Chain`, :class:`Tree` or :class:`Batch`) and refuses a call that does not fit it,
naming the state, instead of guessing from leftovers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import torch

from agentspec.errors import ConfigError
from agentspec.targets.forward.kv import ModelKV
from agentspec.targets.request.reuse import PrefixReuse


@dataclass(frozen=True)
class Chain:
    """Nothing unresolved: the cache is one row, continued by any call."""

    name = "chain"


@dataclass(frozen=True)
class Tree:
    """A :meth:`Scorer.score_tree` waiting for :meth:`Scorer.keep_tree_path`.

    Attributes:
        tokens: The tree's tokens, root first (all of them sit in the cache).
    """

    tokens: tuple[int, ...]
    name = "tree"


@dataclass(frozen=True)
class Batch:
    """A :meth:`Scorer.score_batch` waiting for :meth:`Scorer.select_row`.

    Attributes:
        rows: Each cache row's tokens after the shared prefix, as cut by rollbacks since;
            ``None`` once a rollback went past them (the rows' tokens are then unknown).
    """

    rows: tuple[tuple[int, ...], ...] | None
    name = "batch"


Mode: TypeAlias = Chain | Tree | Batch
CHAIN = Chain()


class Timer(Protocol):
    """Times verify forwards (:class:`~agentspec.targets.cost.cost_meter.CostMeter`)."""

    def timed(self, rows: int, context: int) -> contextlib.AbstractContextManager[None]:
        """Run a forward over ``rows`` tokens at ``context`` positions inside."""
        ...


class Scorer:
    """Chain, tree and batch scoring on one :class:`~agentspec.targets.forward.kv.ModelKV`,
    keeping :class:`~agentspec.targets.request.reuse.PrefixReuse`'s token ids in step.

    Args:
        kv: The model and its cache.
        reuse: The token ids the cache holds.
        timer: Times each verify forward (the target's live cost).
    """

    def __init__(self, kv: ModelKV, reuse: PrefixReuse, timer: Timer) -> None:
        self.kv = kv
        self.reuse = reuse
        self.timer = timer
        self.mode: Mode = CHAIN

    def _check(self, call: str, want: type[Chain] | type[Tree] | type[Batch]) -> None:
        """Raise :class:`ConfigError` unless the cache exists and is in a ``want`` state."""
        if self.kv.cache is None:
            raise ConfigError(f"{call}() called before prefill()")
        mode = self.mode
        if isinstance(mode, want):
            return
        if want is Chain:
            first = "keep_tree_path()" if isinstance(mode, Tree) else "select_row()"
            raise ConfigError(f"{call}() while the cache holds an unresolved {mode.name}: "
                              f"call {first} first")
        scored = "score_tree()" if want is Tree else "score_batch()"
        raise ConfigError(f"{call}() without a {scored} before it (the cache holds a "
                          f"{mode.name})")

    def feed(self, tokens: Sequence[int], last_only: bool = False,
             step: bool = False) -> torch.Tensor:
        """One forward appending ``tokens`` to the one row, their feature rows logged for
        reuse; the logits as :meth:`~agentspec.targets.forward.kv.ModelKV.forward` returns them
        (``step``: a decode-phase forward, shape-stable when the model is)."""
        logits = self.kv.forward(tokens, last_only, step=step)
        if self.kv.features is not None:
            self.reuse.log_rows(self.kv.features[0])  # [n, H]: this forward's positions
        return logits

    def score(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` in one forward; return their logits ``[len(tokens), V]``."""
        self._check("score", Chain)
        if not tokens:
            raise ConfigError("score() needs at least one token")
        self.kv.check_fits(self.kv.num_cached + len(tokens))
        with self.timer.timed(len(tokens), self.kv.num_cached):
            logits = self.feed(tokens, step=True)
        self.reuse.fed(tokens)
        return logits

    def score_batch(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Score K equal-length continuations of the cached prefix in one batched forward
        (the cache becomes K rows); logits ``[K, n, V]``."""
        self._check("score_batch", Chain)
        if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
            raise ConfigError("score_batch() needs non-empty rows of equal length")
        self.kv.check_fits(self.kv.num_cached + len(rows[0]))
        self.kv.expand(len(rows))
        ids = torch.tensor([list(r) for r in rows], dtype=torch.long, device=self.kv.device)
        with self.timer.timed(ids.numel(), self.kv.num_cached):
            logits = self.kv.run(ids)
        self.mode = Batch(tuple(tuple(r) for r in rows))
        return logits.float().cpu()  # [K, n, V] (on the CPU, as ModelKV.forward)

    def score_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append a token tree (``tokens[0]`` the root, node ``i`` under
        ``tokens[parents[i]]``) in one forward with tree attention; logits ``[n, V]``."""
        self._check("score_tree", Chain)
        n = len(tokens)
        if n == 0 or len(parents) != n or parents[0] != -1:
            raise ConfigError("score_tree() needs a root token (parent -1) and a parent per token")
        past = self.kv.num_cached
        depth = [0] * n
        for i in range(1, n):
            if not 0 <= parents[i] < i:
                raise ConfigError(f"score_tree(): parent {parents[i]} of node {i} must come "
                                  "before it")
            depth[i] = depth[parents[i]] + 1
        self.kv.check_fits(past + max(depth) + 1)
        # anc[i, j]: node j is node i or one of its ancestors (rows built parent first).
        anc = torch.zeros(n, n, dtype=torch.bool)  # [n, n]
        for i in range(n):
            if i:
                anc[i] = anc[parents[i]]
            anc[i, i] = True
        device = self.kv.device
        dtype = next(self.kv.model.parameters()).dtype
        mask = torch.zeros(1, 1, n, past + n, dtype=dtype)  # [1, 1, n, past + n], additive
        mask[0, 0, :, past:].masked_fill_(~anc, torch.finfo(dtype).min)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)  # [1, n]
        pos = torch.tensor([[past + d for d in depth]], dtype=torch.long, device=device)
        with self.timer.timed(n, past):
            logits = self.kv.run(ids, attention_mask=mask.to(device), position_ids=pos)
        self.mode = Tree(tuple(tokens))
        return logits[0].float().cpu()  # [n, V]

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """Keep the tree's root and the nodes ``path`` (indices into its tokens, root to
        leaf, without the root) in the cache, drop the other nodes.

        Raises:
            ConfigError: the cache holds no unresolved tree.
        """
        self._check("keep_tree_path", Tree)
        assert isinstance(self.mode, Tree)
        tree, self.mode = self.mode.tokens, CHAIN
        n_tree = len(tree)
        if self.reuse.ids is not None:
            self.reuse.fed([tree[0], *(tree[int(i)] for i in path)])
        past = self.kv.num_cached - n_tree
        n = len(path)
        if n and list(path) != list(range(1, n + 1)):
            self.kv.move(past, path)  # the kept nodes right behind the root
        if n_tree - 1 - n:
            self.kv.crop(n_tree - 1 - n)
        features = self.kv.features
        if features is not None and features.shape[1] == n_tree:
            local = torch.tensor([0, *(int(i) for i in path)], dtype=torch.long)
            self.kv.features = features.index_select(1, local.to(features.device))
            self.reuse.log_rows(self.kv.features[0])  # [n + 1, H]: the kept path

    def select_row(self, row: int) -> None:
        """Keep only cache row ``row`` of the unresolved batch.

        Raises:
            ConfigError: the cache holds no unresolved batch.
        """
        self._check("select_row", Batch)
        assert isinstance(self.mode, Batch)
        rows, self.mode = self.mode.rows, CHAIN
        self.kv.select_row(row)
        if self.reuse.ids is not None and rows is not None and 0 <= row < len(rows):
            self.reuse.fed(rows[row])
        else:
            self.reuse.forget()
        features = self.kv.features
        if features is not None and features.shape[0] > row:
            self.kv.features = features[row : row + 1]
            if rows is not None and 0 <= row < len(rows):  # (after a rollback: fewer rows)
                self.reuse.log_rows(self.kv.features[0, : len(rows[row])])

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` cached positions of every row (exact: later logits equal a
        fresh run's). An unresolved batch's rows are cut with them; an unresolved tree's
        layout cannot be followed, so the cached ids are forgotten (no reuse)."""
        if n < 0 or n > self.kv.num_cached:
            raise ConfigError(f"rollback({n}) with {self.kv.num_cached} cached positions")
        if not n:
            return
        self.kv.crop(n)
        mode = self.mode
        if isinstance(mode, Batch) and mode.rows is not None:
            if n <= len(mode.rows[0]):
                self.mode = Batch(tuple(r[: len(r) - n] for r in mode.rows))
            else:
                self.mode = Batch(None)
                self.reuse.forget()
        elif isinstance(mode, Tree):
            self.reuse.forget()
        else:
            self.reuse.dropped(n)

    @property
    def pending(self) -> bool:
        """Whether a tree or a batch is unresolved (the cache's layout is not a chain)."""
        return not isinstance(self.mode, Chain)

    def reset(self) -> None:
        """A prefill started the cache afresh: nothing is unresolved."""
        self.mode = CHAIN

    @contextlib.contextmanager
    def scratch(self, context: int, gen: torch.Generator) -> Iterator[None]:
        """Score on a throwaway cache of ``context`` random positions (timing), then put
        the request's cache, ids, features and mode back as they were."""
        kv, reuse = self.kv, self.reuse
        saved = kv.cache, reuse.ids, reuse.scope, kv.features, self.mode
        try:
            kv.cache, reuse.ids = kv.random_cache(context, gen), None
            self.mode = CHAIN
            yield
        finally:
            kv.cache, reuse.ids, reuse.scope, kv.features, self.mode = saved
            if kv.static_length:  # the random keys went into the buffers it sits on
                kv.cache = None
                reuse.forget()
