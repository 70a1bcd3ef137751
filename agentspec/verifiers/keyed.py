"""Position-keyed verification: seeded sampling that reproduces exactly, whatever was drafted.

The other sampling verifiers are lossless *in distribution*: their output is distributed
as plain sampling, but which tokens come out depends on the random numbers drawn, and a
draft changes how many are drawn. Two runs of one seeded request then differ as soon as
their drafts differ (a warm session cache, another drafter).

Here the token at output position ``t`` is a deterministic function of the target's
processed distribution at ``t`` (temperature, top-k, top-p), the seed and ``t``:

    y_t = argmin_v E_{seed,t}(v) / p_t(v),    E_{seed,t}(v) ~ Exp(1) i.i.d.

(:func:`agentspec.sampling.keyed_choice`; the Exp(1) race is Gumbel-max). Each position has
its own noise stream, so ``y_t`` is an exact draw from ``p_t`` given the prefix, and the
sequence is exactly the seeded *non-speculative* sample. Verification is then

    accept draft token ``x_i`` iff ``x_i == y_{t+i}``; at the first mismatch commit ``y``

which commits the same tokens as decoding one token per forward, for any draft.

Acceptance. A deterministic (cache) draft token is accepted with probability ``p(x_i)``,
exactly rejection sampling's (and the most any lossless rule can accept, since the output
must follow ``p``). A model drafter that samples from its own ``q`` with the *same* keyed
noise agrees with ``y`` with the Gumbel-coupling probability, at least
``(1 - TV) / (1 + TV)`` (rejection sampling with an independent draft: ``1 - TV``); the
benchmark measures both on the EAGLE head. K drafts (SpecTr-GBV's setting) keep the
longest branch that matches the keyed samples (:meth:`KeyedVerifier.verify_many`).

Limits. The guarantee is exact given the logits: the target must produce the same logits
at a position whether it scores 1 or k+1 tokens. In fp32 on CPU the differences across
batch shapes are ~1e-6 and flip a sample only when two perturbed scores tie that closely
(about as rare as a greedy argmax flip, which the fp32 engine tests never see); bf16 and
GPU kernels with shape-dependent reductions can flip more often. Unseeded sampled requests
go to the ``unseeded`` verifier (GBV by default); greedy requests to the greedy rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from agentspec.errors import ConfigError
from agentspec.interfaces import Verifier
from agentspec.sampling import keyed_choice, process_logits, row_keys, seed_key
from agentspec.types import Draft, SamplingParams, VerifyResult
from agentspec.verifiers.block import BlockVerifier
from agentspec.verifiers.greedy import GreedyVerifier
from agentspec.verifiers.multi_draft import MultiVerifyResult
from agentspec.verifiers.rejection import check_rows, result_from

__all__ = ["KeyedVerifier", "keyed_accept"]

RowLaw = Callable[[int, torch.Tensor], torch.Tensor]


def keyed_accept(
    law: RowLaw,  # (depth i, trial ids [M]) -> target distributions at depth i [M, V]
    x: torch.Tensor,  # [N, k] drafted ids
    keys: np.ndarray,  # [N, k+1] noise stream of each trial's output positions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keyed verification, batched over ``N`` trials.

    Depth ``i`` is evaluated only for trials that accepted every earlier draft token (a
    real request pays for the noise of committed positions only), so ``law`` is asked for
    the rows of those trials.

    Returns:
        ``(n, y)``: accepted lengths ``[N]`` and the keyed token committed after them ``[N]``.
    """
    n_rows, k = x.shape
    n = torch.zeros(n_rows, dtype=torch.long)
    y = torch.zeros(n_rows, dtype=torch.long)
    alive = torch.arange(n_rows)  # trials whose draft matched every keyed sample so far
    for i in range(k + 1):
        if alive.numel() == 0:
            break
        ids = alive.numpy()
        choice = keyed_choice(law(i, alive), keys[ids, i])  # [M]
        y[alive] = choice
        n[alive] = i
        if i < k:
            alive = alive[x[alive, i] == choice]
    return n, y


class KeyedVerifier:
    """Position-keyed verification for seeded sampled requests (see the module docstring).

    Args:
        unseeded: The verifier of sampled requests without a seed (GBV by default): they
            keep the usual lossless-in-distribution samplers. For multi-draft decoding it
            needs ``verify_many`` (a :class:`MultiDraftVerifier`).
    """

    lossless = True
    name = "keyed"

    def __init__(self, unseeded: Verifier | None = None) -> None:
        self.unseeded: Verifier = unseeded or BlockVerifier()
        self._greedy = GreedyVerifier()

    def verify(
        self,
        draft: Draft,
        logits: torch.Tensor,  # [k+1, V]
        sampling: SamplingParams,
        rng: torch.Generator | None = None,
        *,
        request_id: str | None = None,
    ) -> VerifyResult:
        """Accept the draft prefix equal to the keyed samples, then commit the next one.

        Raises:
            ConfigError: logits of the wrong shape, a tree draft, or a non-integer seed.
        """
        if sampling.greedy:
            return self._greedy.verify(draft, logits, sampling)
        if sampling.seed is None:
            return self.unseeded.verify(draft, logits, sampling, rng, request_id=request_id)
        check_rows(draft, logits)
        logits = logits.cpu()  # verification runs on the CPU (a no-op for target logits)
        k = len(draft.tokens)
        keys = row_keys(seed_key(sampling.seed), range(draft.position, draft.position + k + 1))
        x = torch.tensor([draft.tokens], dtype=torch.long).reshape(1, k)
        n, y = keyed_accept(lambda i, _: process_logits(logits[i : i + 1], sampling), x,
                            keys[None])
        return result_from(draft, int(n[0]), int(y[0]))

    def verify_many(
        self,
        drafts: Sequence[Draft],
        logits: torch.Tensor,  # [K, k+1, V]: row j scores [pending, *drafts[j]]
        sampling: SamplingParams,
        rng: torch.Generator | None = None,
    ) -> MultiVerifyResult:
        """Keep the draft whose prefix matches the keyed samples longest (the first such
        draft on ties) and commit the keyed sample after it.

        Every draft still matching at depth ``i`` shares the same prefix, so the target
        distribution there is one law; it is read from the first matching draft's row.

        Raises:
            ConfigError: no drafts, unequal lengths, or logits of the wrong shape; an
                unseeded sampled request when ``unseeded`` cannot verify K drafts.
        """
        if not drafts:
            raise ConfigError("verify_many needs at least one draft")
        k = len(drafts[0].tokens)
        if any(len(d.tokens) != k or d.is_tree for d in drafts):
            raise ConfigError("verify_many needs chain drafts of equal length")
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (len(drafts), k + 1):
            raise ConfigError(
                f"expected logits of shape [{len(drafts)}, {k + 1}, V], "
                f"got {tuple(logits.shape)}"
            )
        if sampling.seed is None or sampling.greedy:
            many = getattr(self.unseeded, "verify_many", None)
            if many is None:
                raise ConfigError(
                    f"{type(self.unseeded).__name__} cannot verify K drafts; use "
                    "KeyedVerifier(MultiDraftVerifier()) for unseeded multi-draft requests"
                )
            out: MultiVerifyResult = many(drafts, logits, sampling, rng)
            return out
        logits = logits.cpu()  # verification runs on the CPU (a no-op for target logits)
        start = drafts[0].position
        keys = row_keys(seed_key(sampling.seed), range(start, start + k + 1))
        x = torch.tensor([d.tokens for d in drafts], dtype=torch.long).reshape(len(drafts), k)
        alive = list(range(len(drafts)))
        for i in range(k + 1):
            p = process_logits(logits[alive[0], i : i + 1], sampling)  # [1, V]
            y = int(keyed_choice(p, keys[i : i + 1])[0])
            still = [j for j in alive if i < k and int(x[j, i]) == y]
            if not still:
                j = alive[0]
                return MultiVerifyResult(result_from(drafts[j], i, y), j)
            alive = still
        raise AssertionError("unreachable: depth k always ends the loop")
