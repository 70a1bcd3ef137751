"""The EAGLE drafter: drafts from the target's hidden states with a trained one-layer head.

The engine feeds the target's final-norm features of committed positions
(:class:`~agentspec.interfaces.FeatureDrafter`): after the prefill the prompt's rows, after
each step the rows of ``pending`` and the accepted tokens. The drafter turns them into
pairs ``(f_i, x_{i+1})`` for :class:`~agentspec.drafters.model.eagle_head.EagleHead`, whose own
KV cache holds one entry per committed pair. A draft of k tokens then costs:

* one head forward over the pairs committed since the last draft (the accepted block,
  batched; the whole prompt on a request's first draft) — its last output is ``f̂`` of
  the pending token's position, whose logits give ``d_1``;
* k - 1 one-pair forwards ``(f̂, d_j) -> d_{j+1}``, whose cache entries are cropped
  afterwards (they were speculative).

Drafting stops early when the head's top draft probability falls below
``EagleConfig.min_confidence`` (EAGLE-2's confidence cut: a low-probability token is
likely rejected, and every later token with it).

Drafts are greedy point masses (``probs=None``); lossless sampling verifiers accept them
with the right probabilities. Seeded sampled requests (``ctx.sampling`` with a seed) are
drafted instead with the position-keyed noise of the keyed verifier over the head's draft
vocabulary, under the request's temperature / top-k / top-p (a Gumbel coupling with the
target's keyed sample; ``probs`` ``[k, V]`` filled, zero outside the draft vocabulary).
Without features (a target that cannot give them, or a desynchronised stream) the drafter
drafts nothing rather than guessing.

Artifacts: one safetensors file, the head's tensors in fp16, ``draft_vocab`` as an int32
tensor and :meth:`HeadSpec.metadata`. Lookup order of :func:`load_default_eagle`:
``$AGENTSPEC_HOME/drafters/<target>-eagle.safetensors`` (what
``agentspec train-drafter --kind eagle`` writes), then the copy shipped in
``agentspec/data/drafters/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentspec.drafters.model.eagle_head import EagleHead, HeadCache, HeadSpec
from agentspec.errors import ConfigError, ModelLoadError
from agentspec.interfaces import ModelTarget, Target
from agentspec.sampling import keyed_choice, process_logits, request_key, row_keys
from agentspec.types import Draft, DraftContext, SessionRef, VerifyResult

__all__ = ["EagleConfig", "EagleDrafter", "build_head", "eagle_path", "load_default_eagle",
           "load_eagle", "read_head", "save_eagle"]


@dataclass(frozen=True)
class EagleConfig:
    """Settings of :class:`EagleDrafter`.

    Attributes:
        max_tokens: Most tokens drafted per step (the engine may ask for fewer).
        min_confidence: Stop drafting once the head's top probability (over the draft
            vocabulary) falls below this; 0 always drafts ``max_tokens``.
    """

    max_tokens: int = 6
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ConfigError(f"min_confidence must be in [0, 1), got {self.min_confidence}")


class EagleDrafter:
    """Drafts greedily with an :class:`EagleHead` fed the target's features.

    Attributes:
        forwards: Head forward passes so far (cost accounting).
    """

    def __init__(self, head: EagleHead, config: EagleConfig | None = None,
                 name: str = "eagle") -> None:
        self.head = head.eval()
        self.config = config or EagleConfig()
        self.name = name
        self.forwards = 0
        spec = head.spec
        self._ids = torch.tensor(spec.draft_vocab, dtype=torch.long)  # [N] -> full vocab id
        self._ids_np = np.asarray(spec.draft_vocab, dtype=np.uint64)  # keyed-noise counters
        self._vocab = spec.target_vocab
        self._cache = HeadCache(spec.kv_heads, spec.head_dim)
        self._feats: list[torch.Tensor] = []  # committed feature rows not yet in the cache
        self._n_feats = 0  # positions 0 .. n_feats-1 have features
        self._fed = 0  # pairs (f_i, x_{i+1}) in the head cache: i < fed
        self._last: torch.Tensor | None = None  # f̂ after the last committed pair [H]
        self._in_sync = False

    # -- the FeatureDrafter protocol ------------------------------------------------------

    @property
    def wants_features(self) -> bool:
        """Always: the head drafts from nothing else."""
        return True

    def observe_features(self, start: int, features: torch.Tensor) -> None:
        """Take the feature rows ``[m, H]`` of committed positions ``start..start+m-1``."""
        if start == 0:  # a new request: its prompt's rows
            self._cache.crop(0)
            self._feats, self._n_feats, self._fed, self._last = [], 0, 0, None
            self._in_sync = True
        if start != self._n_feats:  # a gap or overlap: stop drafting until the next request
            self._in_sync = False
            return
        if features.shape[0]:
            self._feats.append(features.detach())
            self._n_feats += int(features.shape[0])

    # -- the Drafter protocol -------------------------------------------------------------

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens after ``ctx.tokens`` (empty without features)."""
        k = min(max_tokens, self.config.max_tokens)
        tokens = ctx.tokens
        if k < 1 or not self._in_sync or self._n_feats != len(tokens) - 1:
            return Draft(source=self.name)
        key = request_key(ctx.sampling)
        noise = None if key is None else row_keys(key, range(len(ctx.generated),
                                                             len(ctx.generated) + k))
        rows: list[torch.Tensor] = []
        with torch.inference_mode():
            last = self._catch_up(tokens)
            if last is None:
                return Draft(source=self.name)
            draft: list[int] = []
            base = self._cache.n
            pos = len(tokens) - 1  # position of the pending token's pair (f̂, d_1)
            while True:
                logits = self.head.logits(last)  # [N]
                top, j = logits.max(dim=-1)
                # p(top) = exp(top - logsumexp): only computed when a cut is configured.
                if (draft and self.config.min_confidence > 0.0 and float(
                        torch.exp(top - torch.logsumexp(logits, dim=-1)))
                        < self.config.min_confidence):
                    break
                if noise is not None and ctx.sampling is not None:  # coupled keyed draw
                    dist = process_logits(logits[None], ctx.sampling)  # [1, N]
                    j = keyed_choice(dist, noise[len(draft) : len(draft) + 1], self._ids_np)[0]
                    rows.append(torch.zeros(self._vocab).index_copy_(0, self._ids, dist[0]))
                draft.append(int(self._ids[int(j)]))
                if len(draft) >= k:
                    break
                out = self.head(last.view(1, 1, -1), torch.tensor([[draft[-1]]]),
                                torch.tensor([pos]), self._cache)  # [1, 1, H]
                self.forwards += 1
                last, pos = out[0, -1], pos + 1
            self._cache.crop(base)  # drafted pairs were speculative
        probs = torch.stack(rows) if rows else None  # [k, V]
        return Draft(tokens=draft, probs=probs, source=self.name)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Nothing: the committed rows arrive through :meth:`observe_features`."""

    def finish(self, ctx: DraftContext) -> None:
        """Nothing: the next request's prefill features reset the head's cache."""

    def begin_request(
        self, session: SessionRef | None, rng: Any, request_id: str | None = None
    ) -> None:
        """Nothing until the prefill's features arrive (drafts are greedy). The head's
        feature stream is the one request's the engine is decoding: keying it per request
        would need the request id in ``observe_features`` too."""
        self._in_sync = False

    def _catch_up(self, tokens: Any) -> torch.Tensor | None:
        """Feed the pairs committed since the last draft; return ``f̂`` of the pending
        position ``[H]`` (``None`` when there is no pair at all: a one-token prompt)."""
        n = len(tokens) - 1  # pairs i = 0 .. n-1 exist: f_i and x_{i+1} are committed
        if self._fed < n:
            rows = torch.cat(self._feats)  # [n - fed, H]: positions fed .. n-1
            nxt = torch.tensor([list(tokens[self._fed + 1 : n + 1])])  # [1, n - fed]
            out = self.head(rows[None], nxt, torch.arange(self._fed, n), self._cache)
            self.forwards += 1
            self._last, self._fed, self._feats = out[0, -1], n, []
        return self._last


def eagle_path(target_name: str) -> Path | None:
    """The artifact :func:`load_default_eagle` would use for ``target_name``, if any."""
    from agentspec.drafters.model.distilled import find_artifact

    return find_artifact(f"{target_name}-eagle.safetensors")


def save_eagle(path: Path, head: EagleHead) -> None:
    """Write ``head`` as an artifact (fp16 tensors, atomically replaced)."""
    from safetensors.torch import save_file

    tensors = {k: v.to(torch.float16).contiguous() for k, v in head.trained_state().items()}
    tensors["draft_vocab"] = torch.tensor(head.spec.draft_vocab, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=head.spec.metadata())
    tmp.replace(path)


def load_eagle(target: Target, path: str | Path, config: EagleConfig | None = None) -> EagleDrafter:
    """Build the drafter of artifact ``path`` on the in-process ``target``.

    Raises:
        ModelLoadError: missing or damaged file, or trained for a different target.
        ConfigError: the target holds no in-process transformers model.
    """
    if not isinstance(target, ModelTarget) or target.model is None:
        raise ConfigError(f"{type(target).__name__} holds no in-process transformers model; "
                          "the EAGLE drafter needs the target's weights and hidden states")
    return EagleDrafter(read_head(target.model, path), config)


def read_head(model: Any, path: str | Path) -> EagleHead:
    """The trained head of artifact ``path`` on the transformers ``model`` it was made for.

    Raises:
        ModelLoadError: missing or damaged file, or trained for a different model.
    """
    from safetensors import safe_open

    from agentspec.drafters.model.distilled import embedding_checksum

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"EAGLE head {path} does not exist; train one with "
                             "`agentspec train-drafter --kind eagle`")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        vocab = tuple(int(t) for t in tensors.pop("draft_vocab").tolist())
        spec = HeadSpec.from_metadata(meta, vocab)
    except Exception as exc:  # safetensors raises its own error type on a bad header
        raise ModelLoadError(f"EAGLE head {path} is damaged: {exc}") from None
    embed = model.get_input_embeddings().weight
    if int(embed.shape[0]) != spec.target_vocab or int(embed.shape[1]) != spec.hidden:
        raise ModelLoadError(
            f"EAGLE head {path} was trained for a {spec.target_vocab}-token, "
            f"{spec.hidden}-wide target, not this {tuple(embed.shape)} one; retrain it with "
            "`agentspec train-drafter --kind eagle`"
        )
    if abs(embedding_checksum(model) - spec.checksum) > 1e-3 * max(1.0, abs(spec.checksum)):
        raise ModelLoadError(f"EAGLE head {path} was trained for {spec.target_name!r}, "
                             "whose weights differ from this target's")
    head = build_head(model, spec)
    try:
        head.load_state_dict({k: v.float() for k, v in tensors.items()})
    except RuntimeError as exc:
        raise ModelLoadError(f"EAGLE head {path} does not fit its own spec: {exc}") from None
    return head.eval()


def build_head(model: Any, spec: HeadSpec) -> EagleHead:
    """An (untrained) head on ``model``'s embedding and LM-head rows of the draft vocab."""
    ids = torch.tensor(spec.draft_vocab, dtype=torch.long)
    embed = model.get_input_embeddings().weight.detach().float()  # [V, H]
    out = model.get_output_embeddings().weight.detach().float()[ids]  # [N, H]
    return EagleHead(spec, embed, out)


def load_default_eagle(target: Target, config: EagleConfig | None = None) -> EagleDrafter:
    """The trained EAGLE head for ``target`` (the embedded model ships one).

    Raises:
        ModelLoadError: no artifact for this target; the message says how to build one.
    """
    name = target.name
    path = eagle_path(name)
    if path is None:
        raise ModelLoadError(f"no EAGLE head for target {name!r}; build it with "
                             "`agentspec train-drafter --kind eagle` (or `make drafter`)")
    return load_eagle(target, path, config)
