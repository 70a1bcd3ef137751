"""Shape-stable decode forwards: a row's logits never depend on how many rows share its
forward, so speculation is token-identical to plain decoding in bf16 too.

Why: a verify forward over ``k`` rows and a one-row plain step compute the same row with
different kernels (a matrix-vector product against a matrix product, another attention
split, a key length that differs by the draft's length), and in bf16 the last bits they
disagree in flip argmaxes: on an H200, 25-46 % of agent turns decoded with the suffix
cache differed from plain bf16 decoding. fp32 hides it (the flips need near-ties that fp32
rounding does not reach in practice); bf16 does not.

The cure is to give every decode-phase forward, plain or verify, the same shapes:

- **rows**: on CUDA every decode forward has exactly :attr:`StablePolicy.min_rows` rows
  (a plain step is one real row and padding rows; a verify of more runs in chunks of
  that many): the GPU's products pick their kernel by shape. Padding rows continue the
  causal pattern after the real ones, write their keys past the fill mark (overwritten
  later) and their logits are dropped. On the CPU, ``linear`` gives a row the same bits
  for any row count from two rows on (a one-row product is a matrix-vector kernel that
  rounds differently), checked at load on the model's own weights by
  :func:`invariant_rows`: a plain step is padded to two rows, a verify keeps its rows
  (where even that fails, every forward is padded and chunked to :data:`CPU_MIN_ROWS`
  rows, as on CUDA).
- **keys**: every query attends a fixed number of key positions, ``attend``; the mask
  hides what lies past the query (weight exactly 0, and the cache's buffers are zeroed so
  stale slots are finite). On CUDA ``attend`` is the static cache's whole length; on the
  CPU, where attention over the whole window would cost more than the model, it is the
  end of the forward rounded up to :attr:`StablePolicy.align` positions (PyTorch's CPU
  attention gives a row the same bits for any key length that is a multiple of 512,
  checked by the tests; a key length in between is not).
- **kernels**: one attention function for every row count (on the CPU
  :func:`agentspec.targets.forward.attention.stable_attention`: PyTorch's SDPA kernel takes
  another branch for one or two query rows than for more; its own products are probed at
  load by :func:`attention_invariant`, and where they fail every decode forward takes one
  shape) and plain ``linear`` products.

A row's logits are then a function of its token, its position and the keys before it,
whichever forward computes it. Trees (siblings at other cache slots than their chain's)
and batches of rows (another product shape) are not shape-stable: in this mode the engine
verifies a tree draft's first branch as a chain. The prompt's prefill is not padded: plain
and speculative decoding prefill the same tokens the same way.

On CUDA the one-row-bucket step is also captured as a CUDA graph (:mod:`.step_graph`): the
forward's inputs are the token ids and the start position (mask, positions and key slots
are computed from it on the device), so a step is one graph replay and two tiny copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentspec.errors import ConfigError
from agentspec.targets.forward import attention

#: Key-length alignment on the CPU (see the module docstring): attention's value product
#: runs in blocks of this many keys, so every block of an aligned span has one shape.
CPU_ALIGN = attention.VALUE_BLOCK
#: Rows of every CPU decode forward where ``linear`` is not row-invariant.
CPU_MIN_ROWS = 8
#: Row bucket of a CUDA step: verifies of up to this many rows cost one step there.
CUDA_ROWS = 32


@dataclass(frozen=True)
class StablePolicy:
    """How decode-phase forwards are shaped.

    Attributes:
        min_rows: Query rows a decode forward is padded up to.
        max_rows: Most rows per decode forward (a longer verify runs in chunks); 0: no
            limit. Equal to ``min_rows``: one shape for every decode forward.
        align: Key positions attended are the forward's end rounded up to this; ``None``:
            the static cache's whole length (CUDA).
        graphs: Capture the one-shape step as a CUDA graph (CUDA only).
        pin_threads: Run every decode forward with the process's thread count (the
            products' bits depend on it: :func:`thread_invariant`); else the live cost
            model may pick one thread on a busy machine.
    """

    min_rows: int = 1
    max_rows: int = 0
    align: int | None = CPU_ALIGN
    graphs: bool = False
    pin_threads: bool = False

    def __post_init__(self) -> None:
        if self.min_rows < 1:
            raise ConfigError(f"min_rows must be >= 1, got {self.min_rows}")
        if self.max_rows and self.max_rows < self.min_rows:
            raise ConfigError(f"max_rows={self.max_rows} is below min_rows={self.min_rows}")
        if self.align is not None and self.align < 1:
            raise ConfigError(f"align must be >= 1 or None, got {self.align}")

    @classmethod
    def for_device(cls, device: str, rows: int | None = None,
                   graphs: bool = True) -> StablePolicy:
        """The policy for ``device``: CUDA runs every decode forward as ``rows``
        (:data:`CUDA_ROWS`) rows over the whole static cache, graphs on; the CPU keeps
        row counts and aligns key lengths."""
        if device.startswith("cuda"):
            m = CUDA_ROWS if rows is None else rows
            return cls(min_rows=m, max_rows=m, align=None, graphs=graphs)
        return cls(min_rows=1 if rows is None else rows, align=CPU_ALIGN)

    @property
    def one_shape(self) -> bool:
        """Whether every decode forward has exactly :attr:`min_rows` rows."""
        return self.max_rows == self.min_rows


def chunks(tokens: Sequence[int], max_rows: int) -> list[list[int]]:
    """``tokens`` in forwards of at most ``max_rows`` (one forward when it is 0)."""
    toks = list(tokens)
    if max_rows <= 0:
        return [toks]
    return [toks[i : i + max_rows] for i in range(0, len(toks), max_rows)]


def attend_length(end: int, policy: StablePolicy, capacity: int) -> int:
    """Key positions a forward ending at ``end`` attends: ``capacity`` (static) or ``end``
    rounded up to the policy's alignment."""
    if policy.align is None:
        return capacity
    return -(-end // policy.align) * policy.align


def step_inputs(start: torch.Tensor, rows: int, attend: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[1, rows]`` and the additive mask ``[1, 1, rows, attend]`` of a forward
    whose first row sits at position ``start`` (a 0-d long tensor on the model's device:
    a captured graph recomputes both from it). Row ``i`` sees keys ``0 .. start + i``."""
    device = start.device
    pos = start + torch.arange(rows, device=device)  # [rows]
    keys = torch.arange(attend, device=device)  # [attend]
    hidden = keys[None, :] > pos[:, None]  # [rows, attend]
    mask = torch.zeros(rows, attend, dtype=dtype, device=device)
    mask = mask.masked_fill(hidden, torch.finfo(dtype).min)
    return pos[None], mask[None, None]


def full_attention(model: Any) -> bool:
    """Whether every decoder layer of ``model`` attends the whole context (no sliding
    window): a shape-stable forward masks positions itself."""
    types = getattr(model.config, "layer_types", None)
    if types and any(t != "full_attention" for t in types):
        return False
    return not getattr(model.config, "sliding_window", None) or not getattr(
        model.config, "use_sliding_window", False)
