"""Offline training: everything that learns a drafter or the payoff predictor from traces.

* :mod:`~agentspec.training.corpus` — the model drafter's training corpus;
* :mod:`~agentspec.training.drafter` — distilled causal-LM drafter training;
* :mod:`~agentspec.training.eagle` — EAGLE head training on the target's hidden states;
* :mod:`~agentspec.training.eagle_scale` — the EAGLE self-distillation recipe on a device
  (``train-drafter --device``): :mod:`~agentspec.training.eagle_prompts` (prompts),
  :mod:`~agentspec.training.eagle_selfgen` (generation and features),
  :mod:`~agentspec.training.eagle_fit` (training and evaluation),
  :mod:`~agentspec.training.eagle_scale_run` (its command-line side);
* :mod:`~agentspec.training.payoff_traces` — greedy trace files (generate, validate, read);
* :mod:`~agentspec.training.payoff_replay` — trace replay into oracle accepted lengths, the
  session-level split, τ selection and quality numbers;
* :mod:`~agentspec.training.payoff_fit` — the pipeline behind ``train-predictor``.

The runtime half of HVD (features, predictor, policies, defaults) is :mod:`agentspec.payoff`.
"""
