"""Payoff gating for the vLLM proposer: how much of a cache draft is worth verifying.

In vLLM every draft token the proposer returns is scored by the target (and, on GPUs, takes
a slot of the step's token budget), so a draft that will be rejected at once is pure cost.
The gate asks agentspec's learned payoff predictor (:mod:`agentspec.payoff`) for the
draft's expected accepted length ŷ from the runtime features φ_t (match length, score,
position, the row's recent accepted lengths, token structure) and lets
:class:`~agentspec.payoff.policy.CostAwarePolicy` pick the length k maximising expected
committed tokens per unit of verify cost — 0 (send no draft) included. There is no model
drafter inside the proposer, so the choice is only "cache draft, cut to k" or "none".

Cost model: by default ``c(k) = 1 + cost_per_token · k`` relative to a one-token forward
(``AGENTSPEC_VLLM_COST_PER_TOKEN``; default 0.04, the slope of the measured CPU curve on
this project's machines; on GPUs small drafts are nearly free, use ~0.01). Where the
served model's curve has been measured, ``AGENTSPEC_VLLM_COST_CURVE`` names a JSON file
of it instead (:func:`load_cost_curve`): ``{"k": cost}`` for the measured forward lengths
k (any unit: only ratios matter), or an agentspec cost file (its ``"costs"`` curve), read
between the measured points as :func:`agentspec.targets.cost.costs.interpolate` reads a target's.
A straight line misprices a real curve (on GPUs c(k) is nearly flat up to some k, then
steps up), and the cut k is chosen on it. Setting both variables is refused.

Online calibration, as in-process. The predictor is trained on a few dozen sessions and
can be off by a factor on new traffic, so the policy calibrates ŷ from each cache draft's
*full-length* label (:meth:`~agentspec.payoff.policy.CostAwarePolicy.outcome`): the
proposer keeps every draft the gate rated — cut, withheld or sent whole — in the request's
:class:`~agentspec.payoff.labels.ShadowLabels` and labels it once the committed tokens
decide it (:meth:`observe`), exactly as ``HybridDrafter`` does in-process; each verified
draft also teaches the policy β, the rate of refuted cache drafts
(:meth:`~agentspec.payoff.policy.CostAwarePolicy.update`). The gate is one per proposer
(one per vLLM worker), so its calibration spans the worker's requests.

Enable with ``AGENTSPEC_VLLM_PAYOFF=cost_aware`` (default ``off``). The shipped predictor
is trained for the embedded model's tokenizer; ``AGENTSPEC_VLLM_PREDICTOR`` names another
(``agentspec train-predictor``). A predictor made for another vocabulary or tokenizer is
refused (:class:`~agentspec.payoff.predictor.PredictorError`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from adapters.vllm import envs
from agentspec.errors import ConfigError
from agentspec.payoff.features import TokenTable, features
from agentspec.payoff.labels import ShadowLabels
from agentspec.payoff.policy import CACHE, CostAwarePolicy
from agentspec.payoff.predictor import PayoffPredictor
from agentspec.targets.cost.costs import Curve, interpolate
from agentspec.types import Draft

# The variables this module reads (declared, with their defaults, in adapters/vllm/envs.py).
ENV_PAYOFF, ENV_PREDICTOR, ENV_COST = envs.PAYOFF, envs.PREDICTOR, envs.COST
ENV_COST_CURVE = envs.COST_CURVE
MODES = ("off", "cost_aware")
DEFAULT_COST_PER_TOKEN = 0.04


def load_cost_curve(path: Path) -> Curve:
    """The measured c(k) in ``path``: a JSON object ``{"k": cost}`` (k >= 1, cost > 0,
    any unit), or an agentspec cost file whose ``"costs"`` entry is one.

    Raises:
        ConfigError: the file cannot be read, is not JSON, or holds no such curve (the
            message names the path and what is wrong).
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{ENV_COST_CURVE}: cannot read {path}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{ENV_COST_CURVE}: {path} is not JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("costs"), dict):
        data = data["costs"]  # an agentspec cost file: its base curve
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{ENV_COST_CURVE}: {path} must hold a JSON object "
                          f"{{\"k\": cost, ...}} with at least one point, got {data!r:.80}")
    curve: Curve = {}
    for key, value in data.items():
        try:
            k = int(key)
        except (TypeError, ValueError):
            k = 0
        if k < 1 or str(k) != str(key).strip():
            raise ConfigError(f"{ENV_COST_CURVE}: {path}: draft length {key!r} is not an "
                              "integer >= 1")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{ENV_COST_CURVE}: {path}: cost of k={k} must be a finite "
                              f"number > 0, got {value!r}")
        curve[k] = float(value)
    return curve


class PayoffGate:
    """Cuts (or withholds) cache drafts by their predicted payoff.

    Args:
        predictor: The payoff predictor.
        table: Character classes of the target's vocabulary.
        cost_per_token: Verify cost of one more draft token, relative to a plain step
            (``c(k) = 1 + cost_per_token · k``; default 0.04 when no ``curve`` is given).
        curve: A measured ``{k: cost}`` curve, interpolated between its points, instead.

    Raises:
        ConfigError: a negative ``cost_per_token``, or both it and ``curve``.
    """

    def __init__(
        self, predictor: PayoffPredictor, table: TokenTable,
        cost_per_token: float | None = None, curve: Mapping[int, float] | None = None,
    ) -> None:
        if curve is not None:
            if cost_per_token is not None:
                raise ConfigError("give cost_per_token or a measured curve, not both "
                                  f"(got {cost_per_token!r} and {dict(curve)!r})")
            if not curve:
                raise ConfigError("the measured cost curve has no points")
            points = dict(curve)
            self.policy = CostAwarePolicy(predictor, cost=lambda k: interpolate(points, k))
        else:
            per_token = DEFAULT_COST_PER_TOKEN if cost_per_token is None else cost_per_token
            if not per_token >= 0.0:
                raise ConfigError(f"cost_per_token must be >= 0, got {per_token!r}")
            self.policy = CostAwarePolicy(predictor, cost=lambda k: 1.0 + per_token * k)
        self.table = table
        self.withheld = 0
        self.cut_tokens = 0
        self.labelled = 0  # cache drafts whose full-length label reached the policy

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
        raw = envs.read(ENV_COST)
        curve_path = envs.read(ENV_COST_CURVE)
        cost: float | None = None
        curve: Curve | None = None
        if curve_path:
            if raw is not None:
                raise ConfigError(f"set {ENV_COST} ({raw!r}) or {ENV_COST_CURVE} "
                                  f"({curve_path!r}), not both")
            curve = load_cost_curve(Path(curve_path))
        else:
            raw = raw if raw is not None else str(DEFAULT_COST_PER_TOKEN)
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
        return cls(predictor, token_table(target), cost, curve)

    def length(
        self,
        tokens: Sequence[int],
        prompt_len: int,
        draft: Draft,
        recent: Sequence[tuple[int, int]],
        labels: ShadowLabels | None = None,
    ) -> int:
        """Draft tokens worth verifying (0: decode one token without a draft).

        Args:
            tokens: The request's tokens so far (prompt + output).
            prompt_len: Prompt tokens at their start.
            draft: The cache draft.
            recent: ``(draft_len, accepted)`` of the row's previous steps.
            labels: The request's drafts awaiting their label: ``draft`` (whole, with the
                predictor's raw ŷ and its score) joins them, to be labelled by
                :meth:`observe` (``None``: the gate does not learn from it).
        """
        if not draft.tokens:
            return 0
        phi = features(tokens, prompt_len, draft, recent, self.table)
        choice = self.policy.choose(draft, 0, phi)
        if labels is not None and math.isfinite(choice.raw):
            labels.add(len(tokens), draft, choice.raw, choice.score)
        k = min(choice.length, len(draft.tokens)) if choice.source == CACHE else 0
        if k == 0:
            self.withheld += 1
        self.cut_tokens += len(draft.tokens) - k
        return k

    def observe(self, tokens: Sequence[int], labels: ShadowLabels, draft_len: int,
                accepted: int) -> None:
        """Learn from a row's verified step, as ``HybridDrafter.observe`` does in-process.

        Args:
            tokens: The request's tokens, the step's committed ones included.
            labels: The request's drafts awaiting their label (those ``tokens`` now decide
                are labelled and leave it).
            draft_len: Draft tokens the step verified (0: none was sent).
            accepted: How many of them the target accepted.
        """
        if draft_len:  # a verified cache draft (refuted ones teach β)
            self.policy.update(CACHE, draft_len, accepted, math.nan)
        self.labelled += labels.label(self.policy.outcome, tokens)
