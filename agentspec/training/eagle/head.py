"""The head that self-distillation trains: its draft vocabulary, its making and its artifact.

:func:`make_head` reads a head to continue training (``--init-from``) or builds a fresh one
over the :func:`draft_vocab` of the training rows (the most frequent generated ids, the stop
tokens always kept), starting as the identity
(:meth:`~agentspec.drafters.model.eagle_head.EagleHead.init_identity`). :func:`save_head`
writes the artifact (:func:`~agentspec.drafters.model.eagle.save_eagle` copies the tensors
to the CPU) and reports its size; the recipe calls it for the half-way checkpoint and at the
end (:func:`~.recipe.run_recipe`).

The CPU recipe (``train-drafter --kind eagle`` without ``--device``) picks its draft
vocabulary from its teacher sequences instead (:mod:`agentspec.cli.train_drafter`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["draft_vocab", "make_head", "save_head"]


def save_head(head: Any, out: Path) -> int:
    """Write ``head`` to ``out`` (:func:`~agentspec.drafters.model.eagle.save_eagle`).

    Returns:
        The artifact's size in bytes.
    """
    from agentspec.drafters.model.eagle import save_eagle

    save_eagle(out, head)
    return out.stat().st_size


def draft_vocab(tokens: torch.Tensor, lengths: torch.Tensor, size: int, vocab: int,
                always: Sequence[int]) -> tuple[int, ...]:
    """The ``size`` most frequent ids of the training rows (``always`` first), ties and
    never-seen ids by id.

    Args:
        tokens: Right-padded training rows ``[R, W]``.
        lengths: Their lengths ``[R]``.
        size: Rows of the draft vocabulary.
        vocab: The target's vocabulary size.
        always: Ids kept whatever their counts (the stop tokens).
    """
    cols = torch.arange(int(tokens.shape[1]), device=tokens.device)[None, :]
    real = tokens[cols < lengths[:, None]]
    counts = torch.bincount(real, minlength=vocab)[:vocab].tolist()
    size = min(size, vocab)
    order = sorted(range(vocab), key=lambda t: (-counts[t], t))
    head = [t for t in always if 0 <= t < vocab]
    return tuple(list(dict.fromkeys(head + order))[:size])


def make_head(model: Any, tokens: torch.Tensor, lengths: torch.Tensor, *, size: int,
              vocab: int, stop_ids: Sequence[int], target_name: str,
              intermediate: int | None, seed: int, device: torch.device,
              init_from: Path | None = None) -> Any:
    """The head to train, on ``device``: read from ``init_from``, else a fresh one.

    A fresh head drafts over the :func:`draft_vocab` of the training rows and starts as
    the identity (``init_identity(seed)``).

    Args:
        model: The target (transformers causal LM).
        tokens: Right-padded training rows ``[R, W]``.
        lengths: Their lengths ``[R]``.
        size: Rows of a fresh head's draft vocabulary.
        vocab: The target's vocabulary size.
        stop_ids: Ids every draft vocabulary keeps.
        target_name: The target's name, recorded in the head's spec.
        intermediate: MLP width of a fresh head (``None``: the target's).
        seed: Seeds a fresh head's initialisation.
        device: Where the head trains.
        init_from: A head artifact to continue training.
    """
    from agentspec.drafters.model.distilled import embedding_checksum
    from agentspec.drafters.model.eagle import build_head, read_head
    from agentspec.drafters.model.eagle_head import HeadSpec

    if init_from is not None:
        return read_head(model, init_from).to(device)
    dv = draft_vocab(tokens, lengths, size, vocab, stop_ids)
    spec = HeadSpec.for_target(model, dv, target_name, embedding_checksum(model),
                               intermediate=intermediate)
    head = build_head(model, spec)
    head.init_identity(seed)
    return head.to(device)
