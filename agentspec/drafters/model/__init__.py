"""Drafters that run a model: a small causal LM, a distilled drafter, an EAGLE head.

* :mod:`~agentspec.drafters.model.causal` — :class:`ModelDrafter`, any causal LM as drafter;
* :mod:`~agentspec.drafters.model.distilled` — the shipped distilled drafter and its files;
* :mod:`~agentspec.drafters.model.eagle_head` — the EAGLE head (weights, forward);
* :mod:`~agentspec.drafters.model.eagle` — :class:`EagleDrafter` on the target's features.
"""
