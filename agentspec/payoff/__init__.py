"""Hybrid Verified Decoding's payoff predictor (HVD, docs/hvd.md).

* :mod:`~agentspec.payoff.features` — the runtime features φ_t of a cache draft;
* :mod:`~agentspec.payoff.predictor` — the MLP g_θ(φ_t) -> ŷ_t (save/load as small JSON);
* :mod:`~agentspec.training.payoff_traces` — greedy trace files (generate, validate, read);
* :mod:`~agentspec.training.payoff_replay` — trace replay into oracle accepted lengths, the
  session-level split, τ selection and quality numbers;
* :mod:`~agentspec.training.payoff_fit` — the training pipeline behind ``train-predictor``;
* :mod:`~agentspec.payoff.policy` — source policies (cost-aware, threshold, ArcticRule);
* :mod:`~agentspec.payoff.labels` — a cache draft's full-length label once the committed
  tokens decide it (HVD in-process and the vLLM payoff gate);
* :mod:`~agentspec.payoff.estimators` — the decayed ratios the draft gate and the session
  cache's levels calibrate with;
* :mod:`~agentspec.payoff.defaults` — the shipped predictor, the token table, policies by name.

The drafter itself is :class:`agentspec.drafters.hybrid.HybridDrafter`, built by
:mod:`agentspec.drafters.hybrid_build`; the drafters import this package, never the reverse.
"""
