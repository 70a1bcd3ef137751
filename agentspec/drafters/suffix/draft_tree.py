"""Merging several indexes' draft trees into one token tree.

The session cache drafts from several indexes each step (the request, the session, the
agent, the tenant, the outputs; see :mod:`agentspec.drafters.suffix.drafter`). A chain
draft must pick one of them, and picks by score: on real agent logs even an oracle that
picked the best index every step would accept little more. Verified together as one tree, every
index's continuation gets its chance in the same forward, and the target's greedy walk
keeps whichever the model actually follows (``agentspec.verifiers.tree``).

Terms:
    tree: ``tokens[i]`` follows ``tokens[parents[i]]`` (``-1``: the context), parents
        before children, siblings likeliest first.
    value: the path probability of a node (the chance the target walks through it, as its
        index estimates it), times its tree's weight.

Two indexes that agree share nodes: a node's value is the largest any index gives it.
The cut to ``limit`` nodes keeps the first (best-scored) tree's first branch whole, then
the nodes of highest value. Values never grow along a path and the first branch is closed
under ancestors, so the kept nodes always include their ancestors: the cut is a sort.

The merge runs on every drafting step, so it is compiled (``_tree_merge.c``, built by the
package install: ~1.5 µs against ~7 µs in Python on agent logs); :func:`merge_trees_py` is
its reference, used where no C compiler was available, and a unit test holds the two equal.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

from agentspec.types import first_branch_nodes

# (weight, tokens, parents, path probabilities) of one index's draft tree
WeightedTree = tuple[float, list[int], list[int], list[float]]


def merge_trees_py(trees: Sequence[WeightedTree], limit: int) -> tuple[list[int], list[int], float]:
    """Merge draft trees into one of at most ``limit`` nodes (the reference; the session
    cache runs the compiled twin in ``_tree_merge.c`` where it was built).

    Args:
        trees: Each index's tree with its weight, the likeliest first (its nodes are
            listed first, so its continuation is the merged tree's first branch).
        limit: Most nodes kept: the first tree's first branch, then the highest values.

    Returns:
        ``(tokens, parents, score)``: the merged tree and the sum of its nodes' values (the
        expected accepted length, by the indexes' own estimates).
    """
    toks: list[int] = []
    pars: list[int] = []
    vals: list[float] = []
    main: set[int] = set()  # merged nodes on the first tree's first branch
    # (merged parent + 1) << 32 | token -> merged node: an int key hashes faster than a tuple.
    index: dict[int, int] = {}
    for t, (weight, tokens, parents, probs) in enumerate(trees):
        local = [0] * len(tokens)  # this tree's node -> merged node
        for i, tok in enumerate(tokens):
            p = parents[i]
            mp = local[p] if p >= 0 else -1
            key = ((mp + 1) << 32) | tok
            v = weight * probs[i]
            j = index.get(key)
            if j is None:
                j = index[key] = len(toks)
                toks.append(tok)
                pars.append(mp)
                vals.append(v)
            elif v > vals[j]:
                vals[j] = v
            local[i] = j
        if t == 0:
            main = {local[i] for i in first_branch_nodes(parents)}
    keep: Sequence[int] = range(len(toks))
    if len(toks) > limit:
        # The first tree's first branch ranks first, whole: where the best index continues
        # a copy for the whole budget, branches must not cut it short (a plain value cut
        # accepts less per step on copying workloads). Then by value, a stable
        # sort: on equal values a parent (lower index) stays ahead of its child.
        order = sorted(keep, key=lambda i: (i not in main, -vals[i]))
        keep = sorted(order[:limit])
    # Output: the first branch, then the rest in merge order (still parents first), so a
    # cut to the first n nodes (Draft.truncated) keeps the branch's first n tokens.
    out = [i for i in keep if i in main] + [i for i in keep if i not in main]
    new = [-1] * len(toks)
    for n, old in enumerate(out):
        new[old] = n
    return ([toks[i] for i in out], [new[pars[i]] if pars[i] >= 0 else -1 for i in out],
            sum(vals[i] for i in out))


MergeFn = Callable[[Sequence[WeightedTree], int], tuple[list[int], list[int], float]]


def _compiled() -> MergeFn | None:
    try:
        module = importlib.import_module("agentspec.drafters.suffix._tree_merge")
    except ImportError:  # built without a C compiler: the Python reference
        return None
    fn: MergeFn = module.merge_trees
    return fn


COMPILED = _compiled()
merge_trees: MergeFn = COMPILED or merge_trees_py
