"""How a loaded target shapes its decode forwards: the shape-stable policy, from the config
and the load-time probes of the model's own kernels.

Why here: the policy's CPU rows, thread pinning and one-shape fallback are each the answer
of a probe (:mod:`.products`, :mod:`.attention_rows`), kept between loads by
:mod:`.probe_cache`; the config (:class:`~agentspec.targets.target_config.TargetConfig`)
only says whether the policy is on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agentspec.targets.forward import shapes
from agentspec.targets.forward.shapes import StablePolicy
from agentspec.targets.kernels.precision import QUANTIZED
from agentspec.targets.probes import attention_rows, products
from agentspec.targets.probes.probe_cache import ProbeCache, is_bool, is_rows, probed
from agentspec.targets.target_config import TargetConfig

__all__ = ["stable_policy"]


def stable_policy(config: TargetConfig, device: str, model: Any = None,
                  probes: ProbeCache | None = None) -> StablePolicy | None:
    """The shape-stable policy for ``device`` (``None``: forwards keep their shapes).

    On the CPU ``model``'s products are checked for row-count invariance
    (:func:`~agentspec.targets.probes.products.invariant_rows`): a plain step is padded to
    the fewest rows they are invariant from (fixed-size chunks where they are not), and
    their thread count is pinned where their bits depend on it
    (:func:`~agentspec.targets.probes.products.thread_invariant`); where decode attention
    depends on either (:func:`~agentspec.targets.probes.attention_rows.attention_invariant`),
    every decode forward takes one shape and the process's thread count.

    Args:
        config: The target's settings (``shape_stable``, ``dtype``, ``cuda_graphs``).
        device: The device the target runs on.
        model: The loaded model whose kernels are probed (``None``: no probes).
        probes: Where the probes' results are kept between loads (``None``: probed here).
    """
    on = config.shape_stable
    if on is None:
        on = config.dtype in ("bfloat16", *QUANTIZED) or device.startswith("cuda")
    if not on or (model is not None and not shapes.full_attention(model)):
        return None
    policy = StablePolicy.for_device(device, graphs=config.cuda_graphs)
    if model is None or device.startswith("cuda"):
        return policy
    rows = probed(probes, "invariant_rows", lambda: products.invariant_rows(model), is_rows)
    policy = (dataclasses.replace(policy, min_rows=rows) if rows is not None else
              dataclasses.replace(policy, min_rows=shapes.CPU_MIN_ROWS,
                                  max_rows=shapes.CPU_MIN_ROWS))
    if not probed(probes, "thread_invariant", lambda: products.thread_invariant(model),
                  is_bool):
        policy = dataclasses.replace(policy, pin_threads=True)
    if not probed(probes, "attention_invariant",
                  lambda: attention_rows.attention_invariant(model), is_bool):
        # Attention's products: one shape and one thread count for every forward.
        policy = dataclasses.replace(policy, min_rows=shapes.CPU_MIN_ROWS,
                                     max_rows=shapes.CPU_MIN_ROWS, pin_threads=True)
    return policy
