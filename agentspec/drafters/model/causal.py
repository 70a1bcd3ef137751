"""The model drafter: a small causal LM that shares the target's tokenizer drafts k tokens
autoregressively.

It keeps its own KV cache across decode steps: each :meth:`ModelDrafter.propose` finds the
longest common prefix of the cached tokens and the new context, crops the cache back to
it (the rejected draft tail) and feeds only the new tokens (the accepted ones plus the
verifier's token), so a step costs about ``k`` one-token forwards of the drafter.

Drafts are greedy (deterministic: ``probs=None``, point masses for the verifier) or sampled
from :func:`agentspec.sampling.process_logits` of the drafter's logits, with ``probs``
``[k, V]`` filled so lossless sampling verifiers can form ``p / q``.

Seeded sampled requests (``ctx.sampling`` with a seed) are drafted with the position-keyed
noise the keyed verifier uses (:func:`agentspec.sampling.keyed_choice`), under the
request's own temperature / top-k / top-p, whatever the drafter's config says: draft token
``i`` is ``argmin_v E_{seed,t+i}(v) / q(v)`` while the target's sample is the same race over
``p``. This Gumbel coupling makes draft and target agree as often as the two distributions
allow; each draft is still an exact sample from ``q`` (``probs`` filled), so any lossless
verifier may check it.
:meth:`ModelDrafter.propose_many` draws K i.i.d. sampled drafts in one batched pass (the
cache is expanded to K rows and collapsed back afterwards) for SpecTr-GBV.

Devices: the draft model decides (:attr:`ModelDrafter.device`, its parameters'); input ids
are built there and its KV cache grows there. Each forward's last-position logits come
back to the CPU in fp32, like the target's: drafts are sampled with the request's (CPU)
generator or keyed noise, and the verifiers compare ``probs`` with the target's CPU logits.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentspec.errors import ConfigError
from agentspec.requests import REQUESTS, Slot
from agentspec.sampling import keyed_choice, process_logits, request_key, row_keys, sample
from agentspec.tokens import common_prefix
from agentspec.types import (
    Draft,
    DraftContext,
    SamplingParams,
    SessionRef,
    VerifyResult,
    state_key,
)

__all__ = ["ModelDrafter", "ModelDrafterConfig"]


@dataclass(frozen=True)
class ModelDrafterConfig:
    """Settings of :class:`ModelDrafter`.

    Attributes:
        max_tokens: Most tokens drafted per step (the engine may ask for fewer).
        temperature: 0 drafts greedily (point masses); > 0 samples and fills ``probs``.
            Match the request's sampling for the best acceptance.
        top_p: Nucleus mass of sampled drafts.
        top_k: Top-k cut of sampled drafts (0 = off).
        seed: Seed of the drafter's own generator, used when a request brings none
            (greedy requests, or calls outside the engine).
    """

    max_tokens: int = 8
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.sampling()  # validates temperature, top_p, top_k

    def sampling(self) -> SamplingParams:
        """The drafter's own sampling parameters."""
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.seed)


class ModelDrafter:
    """Drafts with any Hugging Face causal LM whose vocabulary matches the target's.

    Args:
        model: The draft model (eval mode).
        config: Draft length and sampling.
        vocab_size: The target's vocabulary size ``V`` (the drafter's logits are cut to
            it; ``None``: the drafter's own).
        name: Source name recorded in each :class:`Draft`.
    """

    def __init__(
        self,
        model: Any,
        config: ModelDrafterConfig | None = None,
        vocab_size: int | None = None,
        name: str = "model",
    ) -> None:
        own = int(model.get_output_embeddings().weight.shape[0])
        self._init_state(config, name, min(own, vocab_size) if vocab_size is not None else own,
                         device=next(model.parameters()).device,
                         max_positions=int(getattr(model.config, "max_position_embeddings",
                                                   8192) or 8192))
        self.model = model
        # transformers 5.2x renames forward(past_key_values=) to forward(cache=).
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def _init_state(self, config: ModelDrafterConfig | None, name: str, vocab: int,
                    device: torch.device, max_positions: int) -> None:
        """The state every model drafter keeps, whatever runs its forwards."""
        self.config = config or ModelDrafterConfig()
        self.name = name
        self.vocab = vocab
        self.device = device
        self.max_positions = max_positions
        self.forwards = 0  # drafter forward passes, for cost accounting
        self._rng = torch.Generator().manual_seed(self.config.seed)
        # Each request's generator, in the one home of per-request state. The KV cache
        # is the model's, not a request's: it is re-synced (cropped to the common
        # prefix) with whatever context comes next.
        self._rngs: Slot[torch.Generator] = REQUESTS.slot("causal")
        self._cache: Any = None
        self._cached: list[int] = []  # tokens whose keys/values the cache holds

    @classmethod
    def load(
        cls,
        model: str | None,
        config: ModelDrafterConfig | None = None,
        vocab_size: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> ModelDrafter:
        """Load the draft model ``model`` (embedded name or local folder)."""
        from agentspec.models import load_model_and_tokenizer

        lm, _tok, files = load_model_and_tokenizer(model, dtype, device)
        return cls(lm, config, vocab_size, name=f"model:{files.name}")

    # -- the Drafter protocol -------------------------------------------------------------

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens continuing ``ctx.tokens``."""
        k = self._draft_len(ctx, max_tokens)
        if k == 0:
            return Draft(source=self.name)
        key = request_key(ctx.sampling)
        sampling = ctx.sampling if key is not None and ctx.sampling else self.config.sampling()
        noise = None if key is None else row_keys(key, range(len(ctx.generated),
                                                             len(ctx.generated) + k))
        logits = self._sync(ctx.tokens)  # [V]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            if sampling.greedy:
                tok = int(logits.argmax())
            else:
                dist = process_logits(logits, sampling)  # [V]
                if noise is not None:  # the keyed sample of the drafter's law (coupling)
                    tok = int(keyed_choice(dist[None], noise[i : i + 1])[0])
                else:
                    tok = int(sample(dist, self._rngs.get(ctx.state_key, self._rng)))
                rows.append(dist)
            tokens.append(tok)
            if i < k - 1:  # the last token's successor is never needed
                logits = self._feed([[tok]])[0]
                self._cached.append(tok)
        probs = torch.stack(rows) if rows else None  # [k, V]
        return Draft(tokens=tokens, probs=probs, source=self.name)

    def propose_many(
        self, ctx: DraftContext, max_tokens: int, num_drafts: int, rng: torch.Generator
    ) -> list[Draft]:
        """Draw ``num_drafts`` i.i.d. sampled drafts of equal length in one batched pass.

        For a seeded request the first draft is the keyed (coupled) one, the others are
        drawn from ``rng``: K copies of the coupled draft would all be the same.

        Raises:
            ConfigError: the drafter is greedy (K identical drafts help nobody) or
                ``num_drafts < 1``.
        """
        key = request_key(ctx.sampling)
        sampling = ctx.sampling if key is not None and ctx.sampling else self.config.sampling()
        if sampling.greedy:
            raise ConfigError("propose_many needs a sampling drafter (temperature > 0)")
        if num_drafts < 1:
            raise ConfigError(f"num_drafts must be >= 1, got {num_drafts}")
        k = self._draft_len(ctx, max_tokens)
        if k == 0:
            return []
        noise = None if key is None else row_keys(key, range(len(ctx.generated),
                                                             len(ctx.generated) + k))
        logits = self._sync(ctx.tokens)[None].expand(num_drafts, -1)  # [K, V]
        base = len(self._cached)
        self._cache.batch_repeat_interleave(num_drafts)  # one cache row per draft
        tokens, rows = [], []
        try:
            for i in range(k):
                dist = process_logits(logits, sampling)  # [K, V]
                tok = sample(dist, rng)  # [K]
                if noise is not None:  # draft 0 is coupled with the keyed target sample
                    tok[0] = keyed_choice(dist[:1], noise[i : i + 1])[0]
                tokens.append(tok)
                rows.append(dist)
                if i < k - 1:
                    logits = self._feed(tok[:, None].tolist())  # [K, V]
        finally:
            # Back to one row holding the context only: the drafts' own positions go.
            self._cache.batch_select_indices(torch.tensor([0], device=self.device))
            extra = int(self._cache.get_seq_length()) - base
            if extra > 0:
                self._cache.crop(-extra)
        ids = torch.stack(tokens, dim=1)  # [K, k]
        probs = torch.stack(rows, dim=1)  # [K, k, V]
        return [
            Draft(tokens=ids[j].tolist(), probs=probs[j], source=self.name)
            for j in range(num_drafts)
        ]

    def begin_request(
        self, session: SessionRef | None, rng: torch.Generator | None,
        request_id: str | None = None,
    ) -> None:
        """Draw this request's sampled drafts from its generator ``rng`` (the engine calls
        this). Lossless sampling needs drafts that are fresh draws from ``q`` for every
        request, and reproducibility needs them to depend on the request's seed only:
        both hold when drafts and verification share the request's seeded generator.
        Without one (greedy requests) the request gets a generator seeded with the
        drafter's own seed.
        """
        own = rng if rng is not None else torch.Generator().manual_seed(self.config.seed)
        self._rngs.put(state_key(request_id, session), own)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Nothing to do: the next :meth:`propose` syncs the cache with the new context."""

    def finish(self, ctx: DraftContext) -> None:
        """Drop the request's generator; a new request's context is synced (cropped) on
        first use."""
        self._rngs.pop(ctx.state_key)

    def reset(self) -> None:
        """Drop the KV cache."""
        self._cache, self._cached = None, []

    # -- the KV cache ---------------------------------------------------------------------

    def _draft_len(self, ctx: DraftContext, max_tokens: int) -> int:
        room = self.max_positions - len(ctx.tokens)
        return max(0, min(max_tokens, self.config.max_tokens, room))

    def _sync(self, tokens: Sequence[int]) -> torch.Tensor:
        """Make the cache hold ``tokens``; return the logits after the last one ``[V]``."""
        from transformers import DynamicCache

        if not tokens:
            raise ConfigError("the model drafter needs a non-empty context")
        common = common_prefix(self._cached, tokens)
        common = min(common, len(tokens) - 1)  # re-feed >= 1 token: we need its logits
        if self._cache is None or common == 0:
            self._cache, self._cached, common = DynamicCache(config=self.model.config), [], 0
        elif common < len(self._cached):
            self._cache.crop(-(len(self._cached) - common))  # drop the rejected tail
            del self._cached[common:]
        logits = self._feed([list(tokens[common:])])[0]  # [V]
        self._cached.extend(tokens[common:])
        return logits

    def _feed(self, rows: list[list[int]]) -> torch.Tensor:
        """Append ``rows`` ``[B, n]`` to the cache; return each row's last logits ``[B, V]``."""
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)  # [B, n]
        with torch.inference_mode():
            out = self.model(
                input_ids=ids, use_cache=True, logits_to_keep=1,
                **{self._cache_kw: self._cache},
            )
        self.forwards += 1
        # fp32 on the CPU, as the target's (module docstring): one [B, V] copy per forward.
        return out.logits[:, -1, : self.vocab].float().cpu()  # [B, V]

