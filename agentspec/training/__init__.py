"""Offline training: everything that learns a drafter or the payoff predictor from traces.

* :mod:`~agentspec.training.corpus` — the model drafter's training corpus;
* :mod:`~agentspec.training.drafter` — distilled causal-LM drafter training;
* :mod:`~agentspec.training.eagle` — EAGLE head training on the target's hidden states: one
  loss, batching, fit loop and evaluation (``loss``, ``data``, ``fit``, ``evaluate``) under
  two recipes, the CPU one on teacher sequences (``train``) and self-distillation on a
  device (``train-drafter --device``: ``recipe``, with ``prompts``, ``selfgen``, ``head``,
  ``report``, and its command-line side ``command``);
* :mod:`~agentspec.training.payoff_traces` — greedy trace files (generate, validate, read);
* :mod:`~agentspec.training.payoff_replay` — trace replay into oracle accepted lengths, the
  session-level split, τ selection and quality numbers;
* :mod:`~agentspec.training.payoff_fit` — the pipeline behind ``train-predictor``.

The runtime half of HVD (features, predictor, policies, defaults) is :mod:`agentspec.payoff`.
"""
