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

Each request's feature stream and head cache are its own, keyed by request id
(:attr:`~agentspec.types.DraftContext.state_key`), so requests may interleave.

Devices: the head runs on the target model's device (:attr:`EagleHead.device`), and so do
its KV caches and the feature rows it keeps (moved there as they arrive: a no-op when the
target's ``last_features()`` is already there). A draft's tokens stay on that device
between the head's forwards (no host round trip per drafted token); the finished draft
(its ids, and ``probs`` of keyed drafts) is on the CPU, where the verifiers compare it with
the target's logits.

A session's next request usually resends the conversation, so its prompt extends the last
request's tokens. A finished request's head cache is therefore kept for its session (at
most ``_MAX_CARRY`` sessions) and the session's next request starts from it: the entries of
the pairs the new prompt still agrees with are kept, and the first draft catches up only the
pairs after them (a new tool result) instead of the whole prompt. An entry is a function of
the pair's feature row and token and the entries before it, and a position's feature row
is a function of the tokens up to it, so a kept entry is what the new request would have
computed (up to the last bits of the arithmetic); drafts only propose, so the output stays
exactly the target's either way.

Artifacts: one safetensors file, the head's tensors in fp16, ``draft_vocab`` as an int32
tensor and :meth:`HeadSpec.metadata`. Lookup order of :func:`load_default_eagle`:
``$AGENTSPEC_HOME/drafters/<target>-eagle.safetensors`` (what
``agentspec train-drafter --kind eagle`` writes), then the copy shipped in
``agentspec/data/drafters/``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentspec.drafters.model.eagle_head import EagleHead, HeadCache, HeadSpec
from agentspec.errors import ConfigError, ModelLoadError, RequestStateError
from agentspec.interfaces import ModelTarget, Target
from agentspec.lru import LRU
from agentspec.requests import REQUESTS, Slot
from agentspec.sampling import keyed_choice, process_logits, request_key, row_keys
from agentspec.tokens import common_prefix
from agentspec.types import Draft, DraftContext, SessionRef, VerifyResult, state_key

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


@dataclass
class _Stream:
    """One request's feature stream and the head's KV cache over it.

    Attributes:
        cache: The head's keys and values, one entry per pair fed.
        feats: Committed feature rows not yet fed to the head.
        n_feats: Positions ``0 .. n_feats - 1`` have features.
        fed: Pairs ``(f_i, x_{i+1})`` in the head cache: ``i < fed``.
        last: ``f̂`` after the last fed pair ``[H]``.
        in_sync: The rows arrived in order from position 0 (a gap stops drafting).
    """

    cache: HeadCache
    feats: list[torch.Tensor] = field(default_factory=list)
    n_feats: int = 0
    fed: int = 0
    last: torch.Tensor | None = None
    in_sync: bool = False


# Finished requests' head caches kept for their sessions' next requests (each ~1 KiB per
# position on Qwen2.5-0.5B's head: 2 KV heads x 64 dims x keys and values in fp32).
_MAX_CARRY = 16


@dataclass
class _Carry:
    """A finished request's head cache, kept for its session's next request.

    Attributes:
        tokens: The tokens ``x_0 .. x_fed`` of the pairs in ``cache``.
        cache: The head's entries of pairs ``i < fed``.
        fed: Pairs in ``cache``.
    """

    tokens: list[int]
    cache: HeadCache
    fed: int


class EagleDrafter:
    """Drafts greedily with an :class:`EagleHead` fed the target's features.

    Each request has its own feature stream and head KV cache, keyed by
    :attr:`~agentspec.types.DraftContext.state_key` (the engine's request id): begun by
    :meth:`begin_request` (or by its prefill's features, ``start == 0``), fed by
    :meth:`observe_features`, read by :meth:`propose`, released by :meth:`finish`.
    Requests may interleave. A step or features for a request that is not live raise
    :class:`~agentspec.errors.RequestStateError`.

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
        self._ids_dev = self._ids.to(head.device)  # the same, where the head's logits are
        self._ids_np = np.asarray(spec.draft_vocab, dtype=np.uint64)  # keyed-noise counters
        self._vocab = spec.target_vocab
        # Live requests' streams, in the one home of per-request state.
        self._streams: Slot[_Stream] = REQUESTS.slot("eagle")
        self._carry: LRU[tuple[str, str], _Carry] = LRU(_MAX_CARRY)
        self.carried_pairs = 0  # head entries reused from a session's earlier request

    def _new_stream(self, key: Hashable) -> _Stream:
        stream = _Stream(self.head.new_cache())
        self._streams.put(key, stream)
        return stream

    def _stream(self, ctx: DraftContext, what: str) -> _Stream:
        stream = self._streams.get(ctx.state_key)
        if stream is None:
            raise RequestStateError(
                f"EagleDrafter: {what} for request {ctx.state_key!r}, which is not live; "
                "begin_request (or its prefill's features, start=0) comes first and "
                "finish ends it")
        return stream

    # -- the FeatureDrafter protocol ------------------------------------------------------

    @property
    def wants_features(self) -> bool:
        """Always: the head drafts from nothing else."""
        return True

    def observe_features(self, ctx: DraftContext, start: int, features: torch.Tensor) -> None:
        """Take the feature rows ``[m, H]`` of ``ctx``'s request's committed positions
        ``start..start+m-1``; ``start == 0`` (the prefill's rows) begins its stream.

        Raises:
            RequestStateError: rows past position 0 for a request that is not live.
        """
        if start == 0:  # a new request: its prompt's rows
            stream = self._new_stream(ctx.state_key)
            self._resume(stream, ctx)
            stream.in_sync = True
        else:
            stream = self._stream(ctx, "features")
        if start != stream.n_feats:  # a gap or overlap: stop drafting for this request
            stream.in_sync = False
            return
        m = int(features.shape[0])
        if m:
            skip = max(0, stream.fed - start)  # rows whose pairs a carried cache holds
            if skip < m:  # kept on the head's device (a no-op when already there)
                stream.feats.append(features[skip:].detach().to(self.head.device))
            stream.n_feats += m

    # -- the Drafter protocol -------------------------------------------------------------

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens after ``ctx.tokens`` (empty without features).

        Raises:
            RequestStateError: ``ctx``'s request is not live.
        """
        stream = self._stream(ctx, "a draft")
        k = min(max_tokens, self.config.max_tokens)
        tokens = ctx.tokens
        if k < 1 or not stream.in_sync or stream.n_feats != len(tokens) - 1:
            return Draft(source=self.name)
        key = request_key(ctx.sampling)
        noise = None if key is None else row_keys(key, range(len(ctx.generated),
                                                             len(ctx.generated) + k))
        rows: list[torch.Tensor] = []
        dev = self.head.device
        with torch.inference_mode():
            last = self._catch_up(stream, tokens)
            if last is None:
                return Draft(source=self.name)
            cache = stream.cache
            picked: list[torch.Tensor] = []  # full-vocabulary ids [1], on the head's device
            base = cache.n
            pos = len(tokens) - 1  # position of the pending token's pair (f̂, d_1)
            while True:
                logits = self.head.logits(last)  # [N]
                top, j = logits.max(dim=-1)
                # p(top) = exp(top - logsumexp): only computed when a cut is configured.
                if (picked and self.config.min_confidence > 0.0 and float(
                        torch.exp(top - torch.logsumexp(logits, dim=-1)))
                        < self.config.min_confidence):
                    break
                if noise is not None and ctx.sampling is not None:  # coupled keyed draw
                    dist = process_logits(logits[None], ctx.sampling)[0].cpu()  # [N]
                    j = keyed_choice(dist[None], noise[len(picked) : len(picked) + 1],
                                     self._ids_np)[0].to(dev)
                    rows.append(torch.zeros(self._vocab).index_copy_(0, self._ids, dist))
                picked.append(self._ids_dev.index_select(0, j.view(1)))  # no host sync
                if len(picked) >= k:
                    break
                out = self.head(last.view(1, 1, -1), picked[-1].view(1, 1),
                                torch.tensor([pos], device=dev), cache)  # [1, 1, H]
                self.forwards += 1
                last, pos = out[0, -1], pos + 1
            cache.crop(base)  # drafted pairs were speculative
            draft = [int(t) for t in torch.cat(picked).cpu().tolist()]  # one host copy
        probs = torch.stack(rows) if rows else None  # [k, V] on the CPU
        return Draft(tokens=draft, probs=probs, source=self.name)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Nothing: the committed rows arrive through :meth:`observe_features`."""

    def finish(self, ctx: DraftContext) -> None:
        """Release the request's feature stream; its head cache is kept for the session's
        next request (module docstring)."""
        stream = self._streams.pop(ctx.state_key)
        s = ctx.session
        if stream is None or s is None or not stream.in_sync or stream.fed < 1:
            return
        key = (s.tenant, s.session_id)
        self._carry.put(key, _Carry(list(ctx.tokens[: stream.fed + 1]), stream.cache,
                                    stream.fed))

    def _resume(self, stream: _Stream, ctx: DraftContext) -> None:
        """Start ``stream`` from its session's carried head cache, cropped to the pairs its
        prompt still agrees with, leaving at least one pair to feed (the catch-up's last
        output is the first draft's ``f̂``)."""
        s = ctx.session
        carry = self._carry.pop((s.tenant, s.session_id)) if s is not None else None
        if carry is None:
            return
        # Pair i needs x_{i+1}: pairs below common_prefix - 1 are the same pairs.
        keep = min(carry.fed, common_prefix(carry.tokens, ctx.tokens) - 1, len(ctx.tokens) - 2)
        if keep < 1:
            return
        carry.cache.crop(keep)
        stream.cache, stream.fed = carry.cache, keep
        self.carried_pairs += keep

    def begin_request(
        self, session: SessionRef | None, rng: Any, request_id: str | None = None
    ) -> None:
        """Open the request's stream (drafts are greedy or keyed: ``rng`` is unused); it
        drafts once the prefill's features arrive.

        Raises:
            RequestStateError: ``request_id`` names a request that has not finished.
        """
        key = state_key(request_id, session)
        if request_id is not None and key in self._streams:
            raise RequestStateError(
                f"EagleDrafter: request {request_id!r} was begun twice; finish it first")
        self._new_stream(key)

    @property
    def live_requests(self) -> int:
        """Feature streams held (begun, not yet finished or aged out)."""
        return len(self._streams)

    def _catch_up(self, stream: _Stream, tokens: Any) -> torch.Tensor | None:
        """Feed the pairs committed since the last draft; return ``f̂`` of the pending
        position ``[H]`` (``None`` when there is no pair at all: a one-token prompt)."""
        n = len(tokens) - 1  # pairs i = 0 .. n-1 exist: f_i and x_{i+1} are committed
        if stream.fed < n:
            dev = self.head.device
            rows = torch.cat(stream.feats)  # [n - fed, H]: positions fed .. n-1
            nxt = torch.tensor([list(tokens[stream.fed + 1 : n + 1])], device=dev)  # [1, n - fed]
            out = self.head(rows[None], nxt, torch.arange(stream.fed, n, device=dev),
                            stream.cache)
            self.forwards += 1
            stream.last, stream.fed, stream.feats = out[0, -1], n, []
        return stream.last


def eagle_path(target_name: str) -> Path | None:
    """The artifact :func:`load_default_eagle` would use for ``target_name``, if any."""
    from agentspec.drafters.model.distilled import find_artifact

    return find_artifact(f"{target_name}-eagle.safetensors")


def save_eagle(path: Path, head: EagleHead) -> None:
    """Write ``head`` as an artifact (fp16 tensors copied to the CPU, atomically replaced)."""
    from safetensors.torch import save_file

    # Copied to the CPU first: a head trained on a GPU saves as it is.
    tensors = {k: v.detach().to(torch.float16).cpu().contiguous()
               for k, v in head.trained_state().items()}
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

    from agentspec.drafters.model.distilled import checksum_matches

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
    if not checksum_matches(model, spec.checksum):  # in any precision it is loaded in
        raise ModelLoadError(f"EAGLE head {path} was trained for {spec.target_name!r}, "
                             "whose weights differ from this target's")
    head = build_head(model, spec)
    try:  # load_state_dict copies the (CPU) file tensors onto the head's device
        head.load_state_dict({k: v.float() for k, v in tensors.items()})
    except RuntimeError as exc:
        raise ModelLoadError(f"EAGLE head {path} does not fit its own spec: {exc}") from None
    return head.eval()


def build_head(model: Any, spec: HeadSpec) -> EagleHead:
    """An (untrained) head on ``model``'s embedding and LM-head rows of the draft vocab,
    on the model's device (the head follows the target)."""
    embed = model.get_input_embeddings().weight.detach().float()  # [V, H]
    head_w = model.get_output_embeddings().weight.detach()
    ids = torch.tensor(spec.draft_vocab, dtype=torch.long, device=head_w.device)
    out = head_w.float()[ids]  # [N, H]
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
