"""The distilled drafter: a few of the target's own layers, adapted by low-rank deltas,
with a reduced draft vocabulary.

The drafter is *built from the target* at load time: the token embedding is the target's
(shared, not copied), its first ``L`` decoder layers and its final norm are copied, and the
output head is the target's (tied) embedding restricted to the ``N`` draft-vocabulary rows.
Only small corrections are trained and stored (see :mod:`agentspec.training.drafter`):

* a LoRA pair per linear map of each copied layer, ``W' = W + B A`` (``B: [out, r]``,
  ``A: [r, in]``), merged into the copied weights at load, so drafting runs a plain
  transformers model with no adapter overhead;
* the RMSNorm gains of the copied layers and of the final norm (``[H]`` each);
* a LoRA pair on the head, ``W_head' = E[ids] + B_h A_h`` (``E[ids]: [N, H]``).

Why this shape: one drafted token must cost ≲ 10 % of a target forward to pay off. For
SmolLM2-135M (30 layers, H = 576, V = 49,152, tied embeddings) the head alone is ~20 % of
a target forward; a 2-layer body plus an 8,192-row head is ~9 %. The reduced vocabulary
(the ``N`` tokens the target emits most often, as in EAGLE-3) loses little: the drafter
simply never proposes a token outside it. Logits are scattered back to the full vocabulary
(``-inf`` elsewhere), so greedy drafts are full-vocabulary ids and sampled drafts carry a
proper ``q`` over ``V`` for lossless sampling verifiers.

The artifact is one safetensors file (fp16 tensors + JSON metadata), ~2 MB. Lookup order
of :func:`load_default_drafter`: ``$AGENTSPEC_HOME/drafters/<target>.safetensors`` (what
``agentspec train-drafter`` writes by default), then the copy shipped in
``agentspec/data/drafters/``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentspec.drafters.model.causal import ModelDrafter, ModelDrafterConfig
from agentspec.errors import ConfigError, ModelLoadError
from agentspec.interfaces import ModelTarget, Target
from agentspec.sampling import request_key
from agentspec.types import Draft, DraftContext

__all__ = [
    "ARTIFACT_FORMAT",
    "DistilledDrafter",
    "DraftSpec",
    "build_draft_model",
    "checksum_matches",
    "default_drafter_path",
    "embedding_checksum",
    "load_default_drafter",
    "load_distilled_drafter",
    "target_parts",
]

ARTIFACT_FORMAT = "agentspec-distilled-drafter/1"
PACKAGED_DIR = Path(__file__).resolve().parents[2] / "data" / "drafters"
# The linear maps of a Llama-style decoder layer that carry a LoRA delta.
PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)
NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True)
class DraftSpec:
    """The shape of a distilled drafter (everything but the trained tensors).

    Attributes:
        num_layers: How many of the target's first decoder layers the drafter copies.
        draft_vocab: Full-vocabulary ids of the draft vocabulary, most frequent first.
        rank: LoRA rank of the deltas.
        target_name: Name of the target it was distilled from.
        target_vocab: The target's vocabulary size ``V``.
        checksum: :func:`embedding_checksum` of the target (catches a wrong target).
    """

    num_layers: int
    draft_vocab: tuple[int, ...]
    rank: int
    target_name: str
    target_vocab: int
    checksum: float

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.rank < 1:
            raise ConfigError(f"rank must be >= 1, got {self.rank}")
        if not self.draft_vocab:
            raise ConfigError("the draft vocabulary is empty")
        bad = [t for t in self.draft_vocab if not 0 <= t < self.target_vocab]
        if bad:
            raise ConfigError(
                f"draft vocabulary id {bad[0]} is outside the target vocabulary "
                f"[0, {self.target_vocab})"
            )

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata block (string to string)."""
        return {
            "format": ARTIFACT_FORMAT, "num_layers": str(self.num_layers),
            "rank": str(self.rank), "target_name": self.target_name,
            "target_vocab": str(self.target_vocab), "checksum": repr(self.checksum),
        }


def target_parts(model: Any) -> tuple[torch.nn.Embedding, torch.nn.ModuleList, torch.nn.Module]:
    """The embedding, decoder layers and final norm of a Llama-style causal LM.

    Raises:
        ConfigError: the model has no ``model.embed_tokens / model.layers / model.norm``
            (the distilled drafter supports Llama-family decoders: Llama, SmolLM, Qwen,
            Mistral).
    """
    body = getattr(model, "model", None)
    parts = [getattr(body, n, None) for n in ("embed_tokens", "layers", "norm")]
    if any(p is None for p in parts):
        raise ConfigError(
            f"{type(model).__name__} is not a Llama-style decoder (needs model.embed_tokens, "
            "model.layers, model.norm): the distilled drafter cannot be built from it"
        )
    return parts[0], parts[1], parts[2]  # type: ignore[return-value]


def embedding_checksum(model: Any) -> float:
    """A fingerprint of the target: the sum of its first 64 embedding rows (fp64)."""
    embed, _, _ = target_parts(model)
    return float(embed.weight[:64].detach().double().sum())


def checksum_matches(model: Any, expected: float) -> bool:
    """Whether ``model``'s :func:`embedding_checksum` is ``expected`` (a drafter trained on
    the model, in whatever precision it was loaded then), up to the rounding of the
    precision it is loaded in now.

    A model loaded in bf16 holds its fp32 weights rounded to 8 significant bits: each
    summed value moves by at most ``eps/2`` of itself, in random directions, so the sum
    moves by about ``eps * sqrt(sum of squares)``; six times that still sits ~30x below
    what another model's rows differ by (about ``sqrt(2 * sum of squares)``). In fp32 the
    rule is the old relative 1e-3.
    """
    embed, _, _ = target_parts(model)
    rows = embed.weight[:64].detach().double()
    got = float(rows.sum())
    eps = float(torch.finfo(embed.weight.dtype).eps) if embed.weight.is_floating_point() \
        else 0.0
    tol = max(1e-3 * max(1.0, abs(expected)), 6.0 * eps * float(rows.pow(2).sum().sqrt()))
    return abs(got - expected) <= tol


def build_draft_model(target_model: Any, spec: DraftSpec) -> Any:
    """The untrained drafter: the target's first layers, final norm and a reduced head.

    The embedding module is shared with the target (never trained); layers and norm are
    deep copies, so training or merging deltas never touches the target.

    Returns:
        A causal LM of the target's class whose ``lm_head`` maps ``[.., H] -> [.., N]``.
    """
    embed, layers, norm = target_parts(target_model)
    if spec.num_layers > len(layers):
        raise ConfigError(
            f"num_layers={spec.num_layers} but the target has only {len(layers)} layers"
        )
    vocab = int(embed.weight.shape[0])
    if vocab != spec.target_vocab:
        raise ModelLoadError(
            f"the drafter was trained for a {spec.target_vocab}-token vocabulary but the "
            f"target has {vocab} tokens: retrain it with `agentspec train-drafter`"
        )
    cfg = copy.deepcopy(target_model.config)
    cfg.num_hidden_layers = spec.num_layers
    cfg.tie_word_embeddings = False
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[: spec.num_layers])
    with torch.device("meta"):  # no allocation: every part is replaced below
        draft = type(target_model)(cfg)
    draft.model.embed_tokens = embed
    draft.model.layers = torch.nn.ModuleList(
        copy.deepcopy(layers[i]) for i in range(spec.num_layers)
    )
    draft.model.norm = copy.deepcopy(norm)
    draft.model.rotary_emb = copy.deepcopy(target_model.model.rotary_emb)
    device = embed.weight.device
    ids = torch.tensor(spec.draft_vocab, dtype=torch.long, device=device)  # [N]
    head = torch.nn.Linear(cfg.hidden_size, len(ids), bias=False, device=device,
                           dtype=embed.weight.dtype)
    with torch.no_grad():  # [N, H]: the target's head rows (its embedding when tied)
        head.weight.copy_(target_model.get_output_embeddings().weight[ids])
    draft.lm_head = head
    return draft.eval()


def apply_deltas(draft: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Merge trained LoRA pairs and norm gains into ``draft`` in place.

    ``tensors`` holds ``layers.{i}.{proj}.A/B``, ``layers.{i}.{norm}``, ``norm``,
    ``head.A/B`` (any subset). ``W += B @ A``: ``[out, r] @ [r, in] -> [out, in]``.
    """
    with torch.no_grad():
        for i, layer in enumerate(draft.model.layers):
            for proj in PROJECTIONS:
                a, b = tensors.get(f"layers.{i}.{proj}.A"), tensors.get(f"layers.{i}.{proj}.B")
                if a is not None and b is not None:
                    w = layer.get_submodule(proj).weight
                    w.add_(b.to(w) @ a.to(w))
            for name in NORMS:
                gain = tensors.get(f"layers.{i}.{name}")
                if gain is not None:
                    getattr(layer, name).weight.copy_(gain)
        if "norm" in tensors:
            draft.model.norm.weight.copy_(tensors["norm"])
        a, b = tensors.get("head.A"), tensors.get("head.B")
        if a is not None and b is not None:
            w = draft.lm_head.weight
            w.add_(b.to(w) @ a.to(w))  # [N, r] @ [r, H] -> [N, H]


class DistilledDrafter(ModelDrafter):
    """A :class:`ModelDrafter` over a reduced-vocabulary draft model.

    Args:
        model: The draft model; ``lm_head`` outputs ``N`` draft-vocabulary logits.
        draft_vocab: Full-vocabulary id of each draft logit ``[N]``.
        vocab_size: The target's vocabulary size ``V``.
        config: Draft length and sampling.
        name: Source name recorded in each :class:`Draft`.
        stop_below: Stop a greedy draft early once the drafter's own probability of its
            next token falls below this (0 drafts the full length).
    """

    def __init__(
        self,
        model: Any,
        draft_vocab: torch.Tensor,
        vocab_size: int,
        config: ModelDrafterConfig | None = None,
        name: str = "distilled",
        stop_below: float = 0.0,
    ) -> None:
        super().__init__(model, config, vocab_size=None, name=name)
        if not 0.0 <= stop_below < 1.0:
            raise ConfigError(f"stop_below must be in [0, 1), got {stop_below!r}")
        # [N], on the CPU: the scatter below acts on ModelDrafter._feed's CPU logits.
        self.draft_vocab = draft_vocab.cpu()
        self.full_vocab = vocab_size
        self.stop_below = stop_below

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens; ``score`` is the expected accepted length.

        Under the drafter's own probabilities p_i of its tokens, the expected number of
        accepted tokens is sum_i prod_{j<=i} p_j (a token counts only if all before it do).
        Greedy drafts stop early when p_i < ``stop_below``.
        """
        # Sampled drafts, and seeded sampled requests (keyed, coupled drafts), are the
        # model drafter's.
        if not self.config.sampling().greedy or request_key(ctx.sampling) is not None:
            return super().propose(ctx, max_tokens)
        k = self._draft_len(ctx, max_tokens)
        if k == 0:
            return Draft(source=self.name)
        logits = self._sync(ctx.tokens)  # [V]
        tokens: list[int] = []
        run, expected = 1.0, 0.0
        for i in range(k):
            p = torch.softmax(logits, dim=-1)  # [V] (zero outside the draft vocabulary)
            conf, tok = (float(v) for v in p.max(dim=-1))
            if tokens and conf < self.stop_below:
                break
            tokens.append(int(tok))
            run *= conf
            expected += run
            if i < k - 1:
                logits = self._feed([[int(tok)]])[0]
                self._cached.append(int(tok))
        return Draft(tokens=tokens, score=expected, source=self.name)

    def _feed(self, rows: list[list[int]]) -> torch.Tensor:
        """Run the draft model; scatter its ``[B, N]`` logits into ``[B, V]`` (-inf off-vocab)."""
        small = super()._feed(rows)  # [B, N]
        full = small.new_full((small.shape[0], self.full_vocab), float("-inf"))  # [B, V]
        full[:, self.draft_vocab] = small
        return full


def find_artifact(filename: str) -> Path | None:
    """A drafter artifact by file name: ``$AGENTSPEC_HOME/drafters`` (what training writes)
    first, then the copies shipped in ``agentspec/data/drafters``."""
    from agentspec.models import agentspec_home

    for folder in (agentspec_home() / "drafters", PACKAGED_DIR):
        path = folder / filename
        if path.is_file():
            return path
    return None


def default_drafter_path(target_name: str) -> Path | None:
    """The artifact :func:`load_default_drafter` would use for ``target_name``, if any."""
    return find_artifact(f"{target_name}.safetensors")


def read_artifact(path: Path) -> tuple[DraftSpec, dict[str, torch.Tensor]]:
    """Read a drafter artifact: its spec and trained tensors.

    Raises:
        ModelLoadError: not a drafter artifact, or damaged.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as exc:  # safetensors raises several types on a bad file
        raise ModelLoadError(
            f"could not read the drafter artifact {path} ({type(exc).__name__}: {exc}); "
            "retrain it with `agentspec train-drafter`"
        ) from exc
    if meta.get("format") != ARTIFACT_FORMAT or "draft_vocab" not in tensors:
        raise ModelLoadError(
            f"{path} is not an agentspec drafter (format {meta.get('format')!r}, expected "
            f"{ARTIFACT_FORMAT!r}); retrain it with `agentspec train-drafter`"
        )
    spec = DraftSpec(
        num_layers=int(meta["num_layers"]),
        draft_vocab=tuple(int(t) for t in tensors.pop("draft_vocab").tolist()),
        rank=int(meta["rank"]), target_name=meta["target_name"],
        target_vocab=int(meta["target_vocab"]), checksum=float(meta["checksum"]),
    )
    return spec, tensors


def load_distilled_drafter(
    target: Target, path: str | Path, config: ModelDrafterConfig | None = None,
    stop_below: float = 0.0,
) -> DistilledDrafter:
    """Build the drafter of artifact ``path`` from the in-process ``target``.

    Args:
        target: A :class:`~agentspec.interfaces.ModelTarget` (e.g. an
            :class:`~agentspec.targets.hf.HFTarget`).
        path: The ``.safetensors`` artifact written by ``agentspec train-drafter``.
        config: Draft length and sampling.
        stop_below: See :class:`DistilledDrafter`.

    Raises:
        ModelLoadError: missing or damaged file, or trained for a different target.
        ConfigError: the target holds no in-process transformers model.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"drafter artifact {path} does not exist; "
                             "train one with `agentspec train-drafter`")
    if not isinstance(target, ModelTarget) or target.model is None:
        raise ConfigError(f"{type(target).__name__} holds no in-process transformers model; "
                          "the distilled drafter is built from the target's own weights")
    model = target.model
    spec, tensors = read_artifact(path)
    checksum = embedding_checksum(model)
    if not checksum_matches(model, spec.checksum):
        raise ModelLoadError(
            f"{path} was distilled from {spec.target_name!r}, not from this target "
            f"{target.name!r} (embedding checksum {checksum:.4f} != "
            f"{spec.checksum:.4f}); train a drafter for it with `agentspec train-drafter`"
        )
    draft = build_draft_model(model, spec)
    apply_deltas(draft, tensors)
    ids = torch.tensor(spec.draft_vocab, dtype=torch.long)
    return DistilledDrafter(draft, ids, spec.target_vocab, config,
                            name="distilled", stop_below=stop_below)


def load_default_drafter(
    target: Target, config: ModelDrafterConfig | None = None, stop_below: float = 0.0
) -> DistilledDrafter:
    """The trained default drafter for ``target`` (the embedded model ships one).

    Raises:
        ModelLoadError: no artifact for this target; the message says how to build one.
    """
    name = target.name
    path = default_drafter_path(name)
    if path is None:
        from agentspec.models import agentspec_home

        raise ModelLoadError(
            f"no trained drafter for target {name!r} (looked in "
            f"{agentspec_home() / 'drafters'} and {PACKAGED_DIR}). Build it with "
            "`agentspec train-drafter` (or `make drafter`)."
        )
    return load_distilled_drafter(target, path, config, stop_below)


def describe(path: str | Path) -> dict[str, Any]:
    """The metadata of an artifact, JSON-ready (for ``agentspec train-drafter --info``)."""
    spec, tensors = read_artifact(Path(path))
    info: dict[str, Any] = json.loads(json.dumps(spec.metadata()))
    info["draft_vocab_size"] = len(spec.draft_vocab)
    info["trained_parameters"] = sum(t.numel() for t in tensors.values())
    return info
