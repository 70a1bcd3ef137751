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
  :func:`agentspec.targets.attention.stable_attention`: PyTorch's SDPA kernel takes
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

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from agentspec.errors import ConfigError
from agentspec.targets import attention  # called as a module attribute: tests replace it
from agentspec.targets.int8 import Int8Linear
from agentspec.targets.w8a8 import W8A8Linear

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


def _products(model: Any) -> Iterator[tuple[int, Callable[[torch.Tensor], torch.Tensor],
                                             torch.dtype]]:
    """Each distinct CPU product of ``model``'s linear layers once: (input width, the
    product ``x -> x @ Wᵀ`` its forward runs, the activations' dtype)."""
    seen: set[tuple[int, int, torch.dtype]] = set()
    product: Callable[[torch.Tensor], torch.Tensor]
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight
            product = partial(torch.nn.functional.linear, weight=w)
        elif isinstance(mod, (Int8Linear, W8A8Linear)):  # its own kernel, probed alike
            w = mod.qweight
            product = mod.product
        else:
            continue
        key = (int(w.shape[0]), int(w.shape[1]), w.dtype)
        if key in seen or w.device.type != "cpu":
            continue
        seen.add(key)
        yield key[1], product, torch.bfloat16 if w.dtype == torch.int8 else w.dtype


def _probe_input(width: int, dtype: torch.dtype, trial: int,
                 gen: torch.Generator) -> torch.Tensor:
    """``[1, width]``: inputs of varied scale; odd trials as an MLP's (heavy-tailed, many
    values near zero)."""
    scale = 10.0 * float(torch.rand(1, generator=gen)) + 1e-3
    x = torch.randn(1, width, generator=gen) * scale
    if trial % 2:
        x = F.silu(x) * torch.randn(1, width, generator=gen)
    return x.to(dtype)


def invariant_rows(model: Any, trials: int = 48, seed: int = 0) -> int | None:
    """The fewest rows from which every linear layer of ``model`` gives a row the same bits
    whatever the row count and the row's place among the rows: 1, 2, or ``None`` (no such
    count up to 33: the CPU policy then pads and chunks every decode forward to
    :data:`CPU_MIN_ROWS` rows).

    Measured on the model's own weights with inputs of varied scale: a one-row product is
    often another kernel (a matrix-vector product) whose fp32 sums round to bf16 one ulp
    apart in a few percent of rows, which random weights and unit inputs rarely show (on
    SmolLM2's MLP, 4 rows in 50).
    """
    gen = torch.Generator().manual_seed(seed)
    one_ok = True
    with torch.inference_mode():
        for width, product, dtype in _products(model):
            for trial in range(trials):
                x = _probe_input(width, dtype, trial, gen)
                outs = []
                for m in (1, 2, 8, 33):
                    xs = torch.randn(m, width, generator=gen).to(dtype)
                    at = m - 1 if trial % 3 else trial % m
                    xs[at] = x[0]
                    outs.append(product(xs)[at])
                if not all(torch.equal(outs[1], o) for o in outs[2:]):
                    return None
                one_ok = one_ok and torch.equal(outs[0], outs[1])
    return 1 if one_ok else 2


def thread_invariant(model: Any, trials: int = 8, seed: int = 0) -> bool:
    """Whether every linear layer of ``model`` gives the same bits with one thread as with
    the process's thread count, over 1-33 rows. The live cost model runs a forward with
    one thread when the machine is busy (:mod:`.live_cost`); where this is ``False`` a
    shape-stable target keeps the thread count fixed (:attr:`StablePolicy.pin_threads`)."""
    threads = torch.get_num_threads()
    if threads == 1:
        return True
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for width, product, dtype in _products(model):
            for trial in range(trials):
                xs = torch.cat([_probe_input(width, dtype, trial, gen)
                                for _ in range((1, 2, 8, 33)[trial % 4])])  # [m, width]
                many = product(xs)
                torch.set_num_threads(1)
                try:
                    one = product(xs)
                finally:
                    torch.set_num_threads(threads)
                if not torch.equal(one, many):
                    return False
    return True


#: Key lengths :func:`attention_invariant` tries: one, four and eight alignment blocks.
PROBE_KEYS = (CPU_ALIGN, 4 * CPU_ALIGN, 8 * CPU_ALIGN)


def attention_invariant(model: Any, trials: int = 4, seed: int = 0) -> bool:
    """Whether decode attention (:func:`~agentspec.targets.attention.stable_attention`) gives
    a query row the same bits in a forward of any row count (1-33), at any place among the
    rows, with one thread as with the process's thread count, and over the next aligned
    key length (the keys past the row masked), in ``model``'s head shapes and activation
    dtype, at the key lengths of :data:`PROBE_KEYS` (those within its window). Where it
    does not, a CPU target runs every decode forward in one shape with a pinned thread
    count (:meth:`~agentspec.targets.target_config.TargetConfig.stable_policy`).

    Why a probe: the products inside attention pick their kernel by shape like any other
    product, and a kernel that rounds a row otherwise for some row counts breaks a verify's
    exactness as surely as a linear layer would (docs/cpu_step.md has the case found)."""
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    dtype = model.get_input_embeddings().weight.dtype
    window = int(getattr(cfg, "max_position_embeddings", 0) or PROBE_KEYS[-1])
    keys = [n for n in PROBE_KEYS if n <= window] or [window]
    return attention_rows_invariant(heads, kv, dim, dtype, keys, trials, seed)


def attention_rows_invariant(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                             keys: Sequence[int] = PROBE_KEYS, trials: int = 4,
                             seed: int = 0) -> bool:
    """:func:`attention_invariant` for explicit head shapes. Per trial and key length
    ``n``: a block of 33 consecutive query rows near the end of ``n`` keys, each row
    attended alone (a one-row forward, the process's threads); then for every row count
    2-33 windows of that many consecutive rows of the block at random offsets (every other
    count with one thread, every third window over ``n`` + 512 keys), each of their rows
    compared with its one-row bits."""
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(seed)
    scale, block = head_dim ** -0.5, 33
    with torch.inference_mode():
        for _ in range(trials):
            for n in keys:
                spread = 1.0 + 4.0 * float(torch.rand(1, generator=gen))  # softmax peakiness
                long = n + CPU_ALIGN  # a longer key span: the next aligned length
                key = (torch.randn(1, kv_heads, long, head_dim, generator=gen)
                       * spread).to(dtype)  # [1, kv, n + align, d]
                value = torch.randn(1, kv_heads, long, head_dim, generator=gen).to(dtype)
                rows = (torch.randn(1, heads, block, head_dim, generator=gen)
                        * spread).to(dtype)  # [1, heads, 33, d]
                first = max(0, n - block - int(torch.randint(0, 64, (1,), generator=gen)))
                # Row i at position first + i sees keys 0 .. first + i: [1, 1, 33, long]
                mask = step_inputs(torch.tensor(first), block, long, dtype)[1]
                alone = torch.cat([attention.stable_attention(
                    rows[:, :, i : i + 1], key[:, :, :n], value[:, :, :n],
                    mask[:, :, i : i + 1, :n], scale)
                    for i in range(block)], dim=1)  # [1, 33, heads, d]
                # Short windows cost little: a few of each, so rare roundings show.
                counts = [q for q in range(2, block + 1) for _ in range(max(1, 12 // q))]
                for j, q in enumerate(counts):
                    at = int(torch.randint(0, block - q + 1, (1,), generator=gen))
                    span = long if j % 3 == 0 else n  # also over more (masked) keys
                    if q % 2:
                        torch.set_num_threads(1)
                    try:
                        got = attention.stable_attention(
                            rows[:, :, at : at + q], key[:, :, :span], value[:, :, :span],
                            mask[:, :, at : at + q, :span], scale)
                    finally:
                        torch.set_num_threads(threads)
                    if not torch.equal(got, alone[:, at : at + q]):
                        return False
    return True


def prompt_thread_rows(kv: Any, switch: int | None = None,
                       lengths: tuple[int, ...] = (70, 40, 9), seed: int = 0) -> int | None:
    """Below how many rows a prompt's forwards give the same bits with one thread as with
    the process's thread count: ``None`` for any row count, 0 for none. Where this allows
    a forward, a prefill may run with one thread on a busy machine without changing an
    answer (:meth:`~agentspec.targets.cost_meter.CostMeter.prefill`).

    First a cold prefill of ``lengths[0]`` random tokens (a forward of many rows, as every
    chunk of 64 rows or more), then chunks of the other lengths fed after them (tails after
    reused KV: one of :data:`~agentspec.targets.attention.SPLIT_ROWS` rows or more, whose
    attention is split, and a short one, which may take other kernels); each chunk's last
    logits and the keys and values every position left in the cache are compared. Where
    they differ: 0. Where the model's products change kernel at ``switch`` rows, above those
    lengths (w8a16's integer product leaves for bf16's GEMM:
    :func:`~agentspec.targets.w8a8.prefill_switch`), a cold forward of ``switch`` rows is
    compared too: where it differs, ``switch``.

    Args:
        kv: The target's :class:`~agentspec.targets.kv.ModelKV` (its cache is left
            empty).
        switch: The row count at which the products change kernel, if above ``lengths``.
    """
    if torch.get_num_threads() == 1:
        return None
    if not _prompt_agrees(kv, lengths, seed):
        return 0
    # A switch past the model's window is never reached: every prompt forward is below it.
    if switch is not None and switch <= kv.max_positions and not _prompt_agrees(
            kv, (switch,), seed):
        return switch
    return None


def _prompt_agrees(kv: Any, lengths: tuple[int, ...], seed: int) -> bool:
    """Whether chunks of ``lengths`` fed from an empty cache give the same logits and keys
    and values with one thread as with the process's count."""
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, kv.vocab, (sum(lengths),), generator=gen).tolist()
    outs = []
    try:
        for t in (threads, 1):
            torch.set_num_threads(t)
            kv.cache = kv.new_cache()
            start, seen = 0, []
            for n in lengths:
                seen.append(kv.forward(ids[start : start + n], last_only=True))  # [1, V]
                start += n
            seen += [x.clone() for layer in kv.layers() for x in layer]  # [1, h, Σ, d] each
            outs.append(seen)
    finally:
        torch.set_num_threads(threads)
        kv.cache = kv.new_cache()
    return all(torch.equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))


def full_attention(model: Any) -> bool:
    """Whether every decoder layer of ``model`` attends the whole context (no sliding
    window): a shape-stable forward masks positions itself."""
    types = getattr(model.config, "layer_types", None)
    if types and any(t != "full_attention" for t in types):
        return False
    return not getattr(model.config, "sliding_window", None) or not getattr(
        model.config, "use_sliding_window", False)
