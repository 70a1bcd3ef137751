"""Phase 2 of the EAGLE self-distillation recipe: the target writes its own training text.

:func:`generate_batch` continues a batch of left-padded prompts with the target's own
batched KV-cache loop, greedy or sampled per row; :func:`extract_batch_features` re-reads a
finished batch with one teacher-forced forward (in row chunks) and keeps the final-norm
features of every position (fp16); :class:`FeatureStore` holds the batches on the device
until training packs them. Nothing here reads a device value per token: the loop checks
"all rows finished" every ``check_every`` steps, so the GPU never waits on the host.

The budget, the out-of-memory fallback and the report belong to the recipe
(:func:`agentspec.training.eagle_scale.run_recipe`); the prompts come from
:mod:`agentspec.training.eagle_prompts`.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["FeatureStore", "extract_batch_features", "generate_batch"]


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


@dataclass
class FeatureStore:
    """Generated sequences with their features, on the device, per generation batch.

    Attributes:
        tokens: Per batch, right-padded ``[B, W]`` token ids.
        feats: Per batch, the target's final-norm features ``[B, W, H]`` (fp16).
        lengths: Per batch, the rows' lengths ``[B]``.
        starts: Per batch, the rows' prompt lengths ``[B]``.
        held: Per batch, whether each row is held out ``[B]`` (bool).
        sources: Sequences generated per prompt source.
    """

    tokens: list[torch.Tensor] = field(default_factory=list)  # [B, W]
    feats: list[torch.Tensor] = field(default_factory=list)  # [B, W, H] fp16
    lengths: list[torch.Tensor] = field(default_factory=list)  # [B]
    starts: list[torch.Tensor] = field(default_factory=list)  # [B] prompt lengths
    held: list[torch.Tensor] = field(default_factory=list)  # [B] bool
    sources: Counter[str] = field(default_factory=Counter)

    def packed(self, which: bool, pad: int) -> tuple[torch.Tensor, ...] | None:
        """The held-out or training rows, padded to one width.

        Args:
            which: ``True`` for the held-out rows, ``False`` for the training rows.
            pad: The token id that pads short rows.

        Returns:
            ``(tokens [R, W], feats [R, W, H], lengths [R], starts [R])``, or ``None`` when
            no such row exists.
        """
        parts = [(t, f, n, s, h) for t, f, n, s, h in
                 zip(self.tokens, self.feats, self.lengths, self.starts, self.held,
                     strict=True)]
        if not parts:
            return None
        width = max(int(t.shape[1]) for t, *_ in parts)
        sel = [(t[h == which], f[h == which], n[h == which], s[h == which])
               for t, f, n, s, h in parts]
        sel = [x for x in sel if int(x[0].shape[0])]
        if not sel:
            return None
        toks = torch.cat([F.pad(t, (0, width - int(t.shape[1])), value=pad) for t, *_ in sel])
        feats = torch.cat([F.pad(f, (0, 0, 0, width - int(f.shape[1]))) for _, f, *_ in sel])
        return toks, feats, torch.cat([x[2] for x in sel]), torch.cat([x[3] for x in sel])

