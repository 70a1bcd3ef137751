"""The target's side of EAGLE training: its features, and its own training text.

:func:`extract_features` (the CPU recipe) runs one target forward per teacher sequence and
keeps its final-norm features (fp16) as :class:`~.data.FeatureSeq` s. Self-distillation
(phase 2 of :func:`~.recipe.run_recipe`) makes its text first: :func:`generate_batch`
continues a batch of left-padded prompts with the target's own batched KV-cache loop, greedy
or sampled per row, and :func:`extract_batch_features` re-reads a finished batch with one
teacher-forced forward (in row chunks), keeping the features of every position; the recipe
collects the batches in a :class:`~.data.FeatureStore`. Nothing in the generation loop reads
a device value per token: it checks "all rows finished" every ``check_every`` steps, so the
GPU never waits on the host.

The budget, the out-of-memory fallback and the report belong to the recipe; the prompts come
from :mod:`.prompts`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from agentspec.errors import TrainingDataError
from agentspec.training.eagle.data import FeatureSeq

__all__ = ["extract_batch_features", "extract_features", "generate_batch"]


def generate_batch(
    model: Any, prompts: Sequence[Sequence[int]], temps: Sequence[float], max_new: int,
    stop_ids: Sequence[int], pad: int, device: torch.device, generator: torch.Generator,
    deadline: float | None = None, check_every: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Continue left-padded ``prompts`` with the target's KV-cache loop on ``device``.

    Row ``b`` is greedy when ``temps[b] == 0``, else sampled at that temperature (Gumbel
    max). A row ends after a stop token (kept); the loop ends when every row has (read
    every ``check_every`` steps), after ``max_new`` steps, or at ``deadline``.

    Args:
        model: The transformers causal LM, on ``device``.
        prompts: Prompt token ids, one sequence per row.
        temps: Per row: 0 for greedy, else the sampling temperature.
        max_new: Most tokens generated per row.
        stop_ids: Tokens that end a row.
        pad: The padding token id.
        device: Where the loop runs.
        generator: The random source of the sampled rows.
        deadline: Stop generating once ``time.monotonic()`` passes it.
        check_every: Steps between reads of "all rows finished".

    Returns:
        ``(tokens [B, W], lengths [B], prompt_lengths [B])`` on ``device``, right-aligned:
        row ``b`` is its prompt then its continuation, ``lengths[b]`` tokens, padded with
        ``pad``.
    """
    b = len(prompts)
    width = max(len(p) for p in prompts)
    total = width + max_new
    ids_cpu = torch.full((b, total), pad, dtype=torch.long)
    mask_cpu = torch.zeros((b, total), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids_cpu[r, width - len(p) : width] = torch.tensor(list(p), dtype=torch.long)
        mask_cpu[r, width - len(p) :] = 1
    plen = torch.tensor([len(p) for p in prompts], device=device)  # [B]
    ids, mask = ids_cpu.to(device), mask_cpu.to(device)  # [B, P + G]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P + G]
    temp = torch.tensor(list(temps), dtype=torch.float32, device=device)[:, None]  # [B, 1]
    greedy = temp[:, 0] <= 0
    stops = torch.tensor(sorted(set(stop_ids)) or [pad], device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    with torch.inference_mode(), warnings.catch_warnings():
        # transformers >= 5.2x renames ``past_key_values`` (``cache``); 5.17 knows only it.
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        out = model(input_ids=ids[:, :width], attention_mask=mask[:, :width],
                    position_ids=pos[:, :width], use_cache=True, logits_to_keep=1)
        steps = 0
        sampled = any(x > 0 for x in temps)
        for t in range(max_new):
            logits = out.logits[:, -1].float()  # [B, V]
            pick = logits.argmax(-1)
            if sampled:  # Gumbel max: argmax(logits / T + G) draws from softmax(logits / T)
                u = torch.rand(logits.shape, generator=generator, device=device)
                noisy = logits / temp.clamp(min=1e-4) - torch.log(-torch.log(
                    u.clamp(min=1e-10, max=1.0 - 1e-7)))
                pick = torch.where(greedy, pick, noisy.argmax(-1))
            nxt = torch.where(done, torch.full_like(pick, pad), pick)  # [B]
            ids[:, width + t] = nxt
            done = done | torch.isin(nxt, stops)
            steps = t + 1
            if steps >= max_new or (deadline is not None and time.monotonic() > deadline):
                break
            if steps % check_every == 0 and bool(done.all()):
                break
            out = model(input_ids=nxt[:, None], attention_mask=mask[:, : width + steps],
                        position_ids=pos[:, width + t : width + steps],
                        past_key_values=out.past_key_values, use_cache=True)
    gen = ids[:, width : width + steps]  # [B, S]
    is_stop = torch.isin(gen, stops)
    before = (is_stop.cumsum(-1) == 0).sum(-1)  # tokens before the first stop
    glen = torch.clamp(before + is_stop.any(-1).long(), max=steps)  # keep the stop token
    length = plen + glen  # [B]
    w = int(length.max())  # one read per batch
    cols = torch.arange(w, device=device)[None, :]  # [1, W]
    src = (width - plen)[:, None] + cols  # [B, W]
    tokens = ids.gather(1, src.clamp(max=total - 1))
    tokens = torch.where(cols < length[:, None], tokens, torch.full_like(tokens, pad))
    return tokens, length, plen


def extract_batch_features(model: Any, tokens: torch.Tensor, rows: int) -> torch.Tensor:
    """Final-norm features ``[B, W, H]`` (fp16) of right-padded ``tokens [B, W]``.

    Padding sits after every real token, so causal attention alone keeps the real positions
    exact.

    Args:
        model: The transformers causal LM (its ``model`` is the decoder stack).
        tokens: Right-padded token ids ``[B, W]``, on the model's device.
        rows: Rows per forward.
    """
    chunks = []
    with torch.inference_mode():
        for i in range(0, int(tokens.shape[0]), rows):
            hidden = model.model(input_ids=tokens[i : i + rows]).last_hidden_state
            chunks.append(hidden.to(torch.float16))
    return torch.cat(chunks)


def extract_features(
    model: Any, sequences: Sequence[torch.Tensor], max_len: int = 384,
    deadline: float | None = None, tick: Callable[[int], None] | None = None,
    starts: Sequence[int] | None = None,
) -> list[FeatureSeq]:
    """One target forward per sequence (its last ``max_len`` tokens); keeps features.

    Args:
        model: The transformers causal LM (its ``model`` is the decoder stack).
        sequences: Token ids ``[T]`` per sequence.
        max_len: Longest sequence kept (its tail).
        deadline: Stop once ``time.monotonic()`` passes it.
        tick: Called with 1 after each sequence (a progress bar).
        starts: Each sequence's first answer position (default 0: all of it).

    Raises:
        TrainingDataError: no sequence of at least 3 tokens.
    """
    out: list[FeatureSeq] = []
    for n, seq in enumerate(sequences):
        if deadline is not None and time.monotonic() > deadline:
            break
        ids = seq[-max_len:].long()  # [T]
        start = max(0, (starts[n] if starts is not None else 0) - (seq.numel() - ids.numel()))
        if ids.numel() >= 3:
            hidden = extract_batch_features(model, ids[None], 1)[0]  # [T, H] fp16
            out.append(FeatureSeq(ids.clone(), hidden.clone(), start))
        if tick is not None:
            tick(1)
    if not out:
        raise TrainingDataError("no training sequence of at least 3 tokens to extract from")
    return out
