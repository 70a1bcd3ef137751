"""Payoff gating for the vLLM proposer: how much of a cache draft is worth verifying.

In vLLM every draft token the proposer returns is scored by the target (and, on GPUs, takes
a slot of the step's token budget), so a draft that will be rejected at once is pure cost.
The gate asks agentspec's learned payoff predictor (:mod:`agentspec.payoff`) for the
draft's expected accepted length ŷ from the runtime features φ_t (match length, score,
position, the row's recent accepted lengths, token structure) and lets
:class:`~agentspec.payoff.policy.CostAwarePolicy` pick the length k maximising expected
committed tokens per unit of verify cost — 0 (send no draft) included. There is no model
drafter inside the proposer, so the choice is only "cache draft, cut to k" or "none".

Cost model: ``c(k) = 1 + cost_per_token · k`` relative to a one-token forward
(``AGENTSPEC_VLLM_COST_PER_TOKEN``; default 0.04, the slope of the measured CPU curve on
this project's machines; on GPUs small drafts are nearly free, use ~0.01).

The policy's online calibration of ŷ (:meth:`~agentspec.payoff.policy.CostAwarePolicy.outcome`,
fed with full-length labels by ``HybridDrafter`` in-process) is not wired into the proposer
yet, so here ŷ is used as trained.

Enable with ``AGENTSPEC_VLLM_PAYOFF=cost_aware`` (default ``off``). The shipped predictor
is trained for the embedded model's tokenizer; ``AGENTSPEC_VLLM_PREDICTOR`` names another
(``agentspec train-predictor``). A predictor made for another vocabulary or tokenizer is
refused (:class:`~agentspec.payoff.predictor.PredictorError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from adapters.vllm import envs
from agentspec.errors import ConfigError
from agentspec.payoff.features import TokenTable, features
from agentspec.payoff.policy import CACHE, CostAwarePolicy
from agentspec.payoff.predictor import PayoffPredictor
from agentspec.types import Draft

# The variables this module reads (declared, with their defaults, in adapters/vllm/envs.py).
ENV_PAYOFF, ENV_PREDICTOR, ENV_COST = envs.PAYOFF, envs.PREDICTOR, envs.COST
MODES = ("off", "cost_aware")


class PayoffGate:
    """Cuts (or withholds) cache drafts by their predicted payoff.

    Args:
        predictor: The payoff predictor.
        table: Character classes of the target's vocabulary.
        cost_per_token: Verify cost of one more draft token, relative to a plain step.
    """

    def __init__(
        self, predictor: PayoffPredictor, table: TokenTable, cost_per_token: float = 0.04
    ) -> None:
        if not cost_per_token >= 0.0:
            raise ConfigError(f"cost_per_token must be >= 0, got {cost_per_token!r}")
        self.table = table
        self.policy = CostAwarePolicy(predictor, cost=lambda k: 1.0 + cost_per_token * k)
        self.withheld = 0
        self.cut_tokens = 0

    @classmethod
    def from_env(cls, vllm_config: Any) -> PayoffGate | None:
        """The gate the environment asks for (``None`` when ``AGENTSPEC_VLLM_PAYOFF=off``).

        Raises:
            ConfigError: an unknown mode or a bad cost.
            PredictorError: the predictor does not fit the served model's tokenizer.
        """
        mode = envs.read(ENV_PAYOFF, "off")
        if mode not in MODES:
            raise ConfigError(f"{ENV_PAYOFF} must be one of {MODES}, got {mode!r}")
        if mode == "off":
            return None
        raw = envs.read(ENV_COST, "0.04")
        try:
            cost = float(raw)
        except ValueError:
            raise ConfigError(f"{ENV_COST} must be a number, got {raw!r}") from None
        from transformers import AutoTokenizer

        from agentspec.payoff.defaults import load_predictor, token_table

        model_config = vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
        target = SimpleNamespace(tokenizer=tokenizer, vocab_size=model_config.get_vocab_size())
        path = envs.read(ENV_PREDICTOR)
        predictor = load_predictor(target, Path(path) if path else None)
        return cls(predictor, token_table(target), cost)

    def length(
        self,
        tokens: Sequence[int],
        prompt_len: int,
        draft: Draft,
        recent: Sequence[tuple[int, int]],
    ) -> int:
        """Draft tokens worth verifying (0: decode one token without a draft).

        Args:
            tokens: The request's tokens so far (prompt + output).
            prompt_len: Prompt tokens at their start.
            draft: The cache draft.
            recent: ``(draft_len, accepted)`` of the row's previous steps.
        """
        if not draft.tokens:
            return 0
        phi = features(tokens, prompt_len, draft, recent, self.table)
        choice = self.policy.choose(draft, 0, phi)
        k = min(choice.length, len(draft.tokens)) if choice.source == CACHE else 0
        if k == 0:
            self.withheld += 1
        self.cut_tokens += len(draft.tokens) - k
        return k
