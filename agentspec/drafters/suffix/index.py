"""The suffix index behind the session cache: arctic-inference's C++ tree or the Python one.

Both backends answer the same four calls (``extend``, ``remove``, ``speculate``,
``memory_bytes``) so :class:`~agentspec.drafters.suffix.drafter.SuffixDrafter` does not care
which one holds its tokens:

* :class:`ArcticTree` wraps ``arctic_inference.suffix_decoding._C.SuffixTree`` (what vLLM's
  suffix decoding uses): a depth-limited suffix tree in C++, ~10-40 us per ``speculate`` on
  a 32k-token history, O(depth) per appended token, sequences removable in place, ~280 bytes
  per cached token (``estimate_memory``).
* :class:`PyTree` wraps :class:`~agentspec.drafters.suffix.automaton.SuffixIndex` (a suffix
  automaton in pure Python): ~50-60 bytes per token on agent text, but 5-20x slower per
  step. It is the fallback when arctic-inference is not installed (it is an optional
  extra), and the reference the tests compare against.

``docs/suffix-index.md`` records the measurements behind choosing the C++ tree by default.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from agentspec.drafters.suffix.automaton import SuffixIndex
from agentspec.errors import ConfigError

BACKENDS = ("auto", "arctic", "python")


class Speculation(NamedTuple):
    """One index's draft for a context: a chain, or a token tree when asked for one.

    Attributes:
        tokens: The drafted token ids (a tree's nodes, parents always before children);
            empty when the index holds no continuation.
        match_len: Length of the context suffix the index matched (the draft's evidence).
        score: The index's estimate of the draft's expected accepted length: the sum of its
            tokens' path probabilities.
        parents: For a tree, the index of each token's parent in ``tokens`` (-1 for children
            of the root); ``None`` for a chain.
        probs: For a tree, each token's path probability; ``None`` for a chain (and for a
            merged tree, whose nodes are not re-weighed).
    """

    tokens: list[int]
    match_len: int
    score: float
    parents: list[int] | None = None
    probs: list[float] | None = None


class Tree(Protocol):
    """A suffix index over numbered token sequences."""

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (created on first use)."""
        ...

    def remove(self, seq_id: int) -> None:
        """Forget sequence ``seq_id`` entirely."""
        ...

    def speculate(self, window: Sequence[int], limit: int, factor: float, offset: float,
                  min_prob: float, tree: bool) -> Speculation:
        """Best-scoring continuation of ``window`` (see ``SuffixIndex.speculate``)."""
        ...

    def memory_bytes(self) -> int:
        """Estimated bytes held."""
        ...


def arctic_available() -> bool:
    """True when arctic-inference's compiled suffix tree can be imported."""
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree  # noqa: F401
    except ImportError:
        return False
    return True


class ArcticTree:
    """arctic-inference's C++ ``SuffixTree`` (see the module docstring).

    Args:
        max_depth: Deepest suffix indexed and matched.
    """

    def __init__(self, max_depth: int) -> None:
        from arctic_inference.suffix_decoding._C import SuffixTree

        self._tree: Any = SuffixTree(max_depth)

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (a list, or an int32 numpy array: no copy) to ``seq_id``."""
        if len(tokens):
            if isinstance(tokens, list):
                self._tree.extend(seq_id, tokens)
            else:
                self._tree.extend_ndarray(seq_id, tokens)

    def remove(self, seq_id: int) -> None:
        """Remove ``seq_id`` from the tree (in place, no rebuild)."""
        self._tree.remove(seq_id)

    def speculate(self, window: Sequence[int], limit: int, factor: float, offset: float,
                  min_prob: float, tree: bool) -> Speculation:
        """One ``SuffixTree.speculate`` call; ``parents`` and ``probs`` only for trees."""
        d = self._tree.speculate(window, limit, factor, offset, min_prob, tree)
        toks = d.token_ids
        if not toks:
            return Speculation([], 0, 0.0)
        if tree:
            return Speculation(toks, d.match_len, d.score, d.parents, d.probs)
        return Speculation(toks, d.match_len, d.score)

    def memory_bytes(self) -> int:
        """arctic's own estimate of the tree's size."""
        return int(self._tree.estimate_memory())


class PyTree:
    """:class:`SuffixIndex` with removable sequences (removal rebuilds from kept tokens).

    Args:
        max_depth: Longest suffix matched.
        max_draft: Longest draft.
    """

    def __init__(self, max_depth: int, max_draft: int) -> None:
        self._depth, self._draft = max_depth, max_draft
        self._index = SuffixIndex(max_depth, max_draft)
        self._seqs: dict[int, array[int]] = {}

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to ``seq_id`` (kept, to rebuild after a removal)."""
        toks = [int(t) for t in tokens]
        self._seqs.setdefault(seq_id, array("i")).extend(toks)
        self._index.append(seq_id, toks)

    def remove(self, seq_id: int) -> None:
        """Drop ``seq_id``; the automaton cannot delete, so it is rebuilt."""
        if self._seqs.pop(seq_id, None) is None:
            return
        self._index = SuffixIndex(self._depth, self._draft)
        for sid, toks in self._seqs.items():
            self._index.append(sid, toks)

    def speculate(self, window: Sequence[int], limit: int, factor: float, offset: float,
                  min_prob: float, tree: bool) -> Speculation:
        """``SuffixIndex.speculate`` (or ``speculate_tree``)."""
        if tree:
            t = self._index.speculate_tree(window, limit, self._depth, factor, offset, min_prob)
            return Speculation(t.tokens, t.match_len, t.score, t.parents, t.probs)
        toks, ell, score = self._index.speculate(window, limit, self._depth, factor, offset,
                                                 min_prob)
        return Speculation(toks, ell, score)

    def memory_bytes(self) -> int:
        """The automaton's estimate plus the kept tokens."""
        return self._index.memory_bytes() + sum(4 * len(s) for s in self._seqs.values())


def resolve_backend(name: str) -> str:
    """``"arctic"`` or ``"python"`` for a configured backend name.

    Raises:
        ConfigError: an unknown name, or ``"arctic"`` without arctic-inference installed.
    """
    if name not in BACKENDS:
        raise ConfigError(f"suffix index backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "arctic" if arctic_available() else "python"
    if name == "arctic" and not arctic_available():
        raise ConfigError("suffix index backend 'arctic' needs arctic-inference "
                          "(pip install agentspec[peers]; see agentspec/drafters/arctic.py)")
    return name


def new_tree(backend: str, max_depth: int, max_draft: int) -> Tree:
    """A fresh index of the resolved ``backend`` (``"arctic"`` or ``"python"``)."""
    if backend == "arctic":
        return ArcticTree(max_depth)
    return PyTree(max_depth, max_draft)
