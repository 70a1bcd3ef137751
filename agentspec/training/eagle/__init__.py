"""Training the EAGLE head (:mod:`agentspec.drafters.model.eagle_head`) on the target's features.

Two recipes, one training core:

* the CPU recipe (``train-drafter --kind eagle``): teacher sequences, one target forward each
  for the features, then :func:`train_head` (:mod:`.train`);
* self-distillation on a device (``train-drafter --kind eagle --device DEV``): the target
  writes its own training text from a pool of prompts, keeps its features on the device,
  and :func:`run_recipe` trains, evaluates and saves inside one wall-clock budget
  (:mod:`.recipe`; its command-line side :mod:`.command`).

Both use the same loss (:mod:`.loss`: soft cross-entropy against the target's
draft-vocabulary distribution plus a feature regression, true features in, then the head's
own predictions in), the same packed rows and batches (:mod:`.data`), the same fit loop
(:mod:`.fit`) and the same held-out evaluation (:mod:`.evaluate`); their settings
(:mod:`.config`) decide where they differ (the decay, how often the loss is read).

The modules, one concept each:

* :mod:`.config` — :class:`FitConfig`, :class:`TrainEagleConfig`, :class:`ScaleConfig`;
* :mod:`.loss` — the passes, the pair weights, the soft loss;
* :mod:`.data` — :class:`FeatureSeq`, :class:`FeatureRows`, :class:`FeatureStore`, batches;
* :mod:`.fit` — :func:`fit_head`, the one training loop;
* :mod:`.evaluate` — :func:`evaluate_head`, the one evaluation;
* :mod:`.selfgen` — the target's side: features, batched generation;
* :mod:`.prompts` — the self-distillation prompts and their held-out split;
* :mod:`.head` — the draft vocabulary, making and saving the head;
* :mod:`.train` — the CPU recipe; :mod:`.recipe` and :mod:`.report` — self-distillation;
* :mod:`.command` — the ``train-drafter --device`` options and run.

The submodules import each other directly, never this package (no import cycle).
"""

from __future__ import annotations

from agentspec.training.eagle.command import (
    add_self_distill_arguments,
    run_self_distill,
    scale_config,
)
from agentspec.training.eagle.config import FitConfig, ScaleConfig, TrainEagleConfig
from agentspec.training.eagle.data import FeatureRows, FeatureSeq, FeatureStore
from agentspec.training.eagle.evaluate import evaluate_head
from agentspec.training.eagle.fit import fit_head
from agentspec.training.eagle.head import draft_vocab, make_head, save_head
from agentspec.training.eagle.loss import pair_weights
from agentspec.training.eagle.prompts import PromptItem, PromptPool, build_prompt_pool
from agentspec.training.eagle.recipe import run_recipe
from agentspec.training.eagle.selfgen import (
    extract_batch_features,
    extract_features,
    generate_batch,
)
from agentspec.training.eagle.train import train_head

__all__ = [
    "FeatureRows",
    "FeatureSeq",
    "FeatureStore",
    "FitConfig",
    "PromptItem",
    "PromptPool",
    "ScaleConfig",
    "TrainEagleConfig",
    "add_self_distill_arguments",
    "build_prompt_pool",
    "draft_vocab",
    "evaluate_head",
    "extract_batch_features",
    "extract_features",
    "fit_head",
    "generate_batch",
    "make_head",
    "pair_weights",
    "run_recipe",
    "run_self_distill",
    "save_head",
    "scale_config",
    "train_head",
]
