"""HVD's payoff half for a loaded target: the shipped predictor, the token table, the policies.

:func:`load_predictor` finds and checks the payoff predictor for a target, :func:`token_table`
builds its vocabulary's character classes once, :func:`make_policy` names a source policy.
The drafters build HVD from these (:mod:`agentspec.drafters.hybrid_build`); nothing here
imports a drafter.

The default predictor (``default_predictor.json`` next to this file, a few KB) was trained
by ``agentspec train-predictor`` on greedy traces of the embedded model over the shared
workloads. It records the vocabulary size and tokenizer fingerprint it was trained with;
loading it for another tokenizer raises instead of producing meaningless predictions.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from agentspec.errors import ConfigError
from agentspec.interfaces import ContextCostTarget, Target
from agentspec.payoff.features import TokenTable
from agentspec.payoff.policy import ArcticRule, CostAwarePolicy, SourcePolicy, ThresholdPolicy
from agentspec.payoff.predictor import PayoffPredictor, PredictorError, tokenizer_fingerprint

DEFAULT_PREDICTOR = Path(__file__).with_name("default_predictor.json")
# Predictors trained for other shipped models, one ``<model name>.json`` each.
PACKAGED_PREDICTORS = Path(__file__).parent.parent / "data" / "predictors"
POLICIES = ("cost_aware", "threshold", "arctic_rule")

_tables: dict[int, TokenTable] = {}
_lock = threading.Lock()


def token_table(target: Any) -> TokenTable:
    """The character-class table of ``target``'s vocabulary (built once per tokenizer).

    ``target`` is a :class:`~agentspec.interfaces.Target` or any object with ``vocab_size``
    and an optional ``tokenizer`` (the vLLM adapter describes its served model so).
    """
    tok = getattr(target, "tokenizer", None)
    key = id(tok) if tok is not None else -int(target.vocab_size)
    with _lock:
        if key not in _tables:
            _tables[key] = (TokenTable.from_tokenizer(tok, target.vocab_size) if tok is not None
                            else TokenTable.blank(target.vocab_size))
        return _tables[key]


def predictor_path(target: Any) -> Path:
    """The predictor :func:`load_predictor` uses for ``target`` when given no path.

    First the user's own (``agentspec train-predictor`` writes
    ``$AGENTSPEC_HOME/payoff/<model>.json``), then the one shipped for this model
    (``agentspec/data/predictors/<model>.json``), then one shipped for another model with
    the same tokenizer (a model family shares its vocabulary: the features the predictor
    reads are the session cache's match and the draft's tokens, and the cost-aware policy
    calibrates its predictions on the target's own verifies), then the embedded model's
    default.
    """
    from agentspec.models import agentspec_home

    name = str(getattr(target, "name", "") or "")
    if name and "/" not in name and name not in (".", ".."):
        for folder in (agentspec_home() / "payoff", PACKAGED_PREDICTORS):
            candidate = folder / f"{name}.json"
            if candidate.is_file():
                return candidate
    have = tokenizer_fingerprint(getattr(target, "tokenizer", None))
    if have != "none":
        for candidate in sorted(PACKAGED_PREDICTORS.glob("*.json")):
            try:
                if PayoffPredictor.load(candidate).meta.get("tokenizer") == have:
                    return candidate
            except PredictorError:
                continue  # a damaged file is reported where it is someone's own predictor
    return DEFAULT_PREDICTOR


def load_predictor(target: Any, path: Path | None = None) -> PayoffPredictor:
    """The predictor at ``path`` (default: :func:`predictor_path`), checked against
    ``target`` (as in :func:`token_table`: a target, or anything with ``vocab_size`` and
    ``tokenizer``).

    Raises:
        PredictorError: missing/malformed file, or trained for another vocabulary or
            tokenizer (the message names both).
    """
    path = path or predictor_path(target)
    pred = PayoffPredictor.load(path)
    vocab = pred.meta.get("vocab_size")
    if vocab is not None and vocab != target.vocab_size:
        raise PredictorError(
            f"payoff predictor {str(path)!r} was trained for "
            f"vocab_size={vocab}, the target has {target.vocab_size}; run "
            "`agentspec train-predictor` for this model"
        )
    want = pred.meta.get("tokenizer")
    have = tokenizer_fingerprint(getattr(target, "tokenizer", None))
    if want not in (None, "none") and have != "none" and want != have:
        raise PredictorError(
            f"payoff predictor was trained with tokenizer {want!r}, the target's is {have!r}; "
            "run `agentspec train-predictor` for this model"
        )
    return pred


def make_policy(
    name: str, target: Target, predictor: PayoffPredictor | None = None
) -> SourcePolicy:
    """Build a source policy by name (``cost_aware``, ``threshold`` or ``arctic_rule``).

    Raises:
        ValueError: unknown name.
    """
    if name == "arctic_rule":
        return ArcticRule()
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    pred = predictor or load_predictor(target)
    if name == "threshold":
        return ThresholdPolicy(pred)
    # Priced at each request's context length, by the machine as loaded now, where the
    # target tracks it (the draft gate's prices); else by the measured curve.
    live = target.context_cost if isinstance(target, ContextCostTarget) else None
    return CostAwarePolicy(pred, target.verify_cost, context_cost=live)

