"""The EAGLE-style draft head: one decoder layer that drafts from the target's features.

EAGLE (Li et al., 2024) observes that the target's final hidden state ``f_i`` (the vector
its LM head turns into the logits of token ``i+1``) is far easier to extrapolate than
tokens. The head reads the pair ``(f_i, x_{i+1})`` — the feature at position ``i`` and the
token that was actually committed after it — and predicts ``f̂_{i+1}``; the target's own
(tied) LM head, cut to a draft vocabulary, turns ``f̂_{i+1}`` into the draft of
``x_{i+2}``. Deeper drafts feed the head its own prediction: ``(f̂_{i+1}, d_1) -> f̂_{i+2}``.

Shapes (``H`` hidden, ``N`` draft vocabulary, ``h``/``g`` query/key-value heads, ``d``
head size)::

    u = fc([norm_f(f) ; norm_e(E[x])])          # [B, T, 2H] -> [B, T, H]
    u = u + attn(norm_a(u))                     # causal, RoPE, GQA, own KV cache
    f̂ = u + mlp(norm_m(u))                      # SwiGLU; regressed onto the next feature
    logits = f̂ @ W[draft_vocab]^T               # [B, T, N]

The layer has the shape of one target decoder layer (:meth:`EagleHead.init_identity`
explains its start); the embedding ``E`` and the head rows ``W[draft_vocab]`` are the
target's, shared and frozen, so the artifact stores only ``fc``, the norms and the layer.
For SmolLM2-135M one drafted token costs ~1/30 of a target forward plus an 8,192-row head.

Training (``agentspec.training.eagle``) and drafting (``agentspec.drafters.model.eagle``) share
this module; drafting calls :meth:`EagleHead.forward` with a :class:`HeadCache`.

Devices: the target owns them. The head lives where the target's embedding lives (its
parameters are moved there when it is built, :attr:`EagleHead.device`), its
:class:`HeadCache` too, and :meth:`EagleHead.forward` moves its inputs (feature rows,
tokens, positions) there: a no-op when they already are, one small copy when a caller
built them on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from agentspec.errors import ConfigError

__all__ = ["EagleHead", "HeadCache", "HeadSpec"]

ARTIFACT_FORMAT = "agentspec-eagle-head/1"


@dataclass(frozen=True)
class HeadSpec:
    """The shape of an EAGLE head (everything but its trained tensors).

    Attributes:
        hidden: The target's hidden size ``H``.
        heads: Query heads of the head's attention.
        kv_heads: Key/value heads (grouped-query attention, as the target).
        intermediate: Width of the SwiGLU MLP.
        rope_theta: RoPE base (the target's).
        eps: RMSNorm epsilon (the target's).
        draft_vocab: Full-vocabulary ids the head can draft, most frequent first.
        target_name: Name of the target it was trained for.
        target_vocab: The target's vocabulary size ``V``.
        checksum: Fingerprint of the target's embedding (catches a wrong target).
    """

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float
    eps: float
    draft_vocab: tuple[int, ...]
    target_name: str
    target_vocab: int
    checksum: float

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(
                f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}: the "
                "hidden size must split into heads and heads into key/value groups"
            )
        if not self.draft_vocab:
            raise ConfigError("the draft vocabulary is empty")
        bad = [t for t in self.draft_vocab if not 0 <= t < self.target_vocab]
        if bad:
            raise ConfigError(f"draft vocabulary id {bad[0]} is outside [0, {self.target_vocab})")

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden // self.heads

    @classmethod
    def for_target(cls, model: Any, draft_vocab: tuple[int, ...], target_name: str,
                   checksum: float, intermediate: int | None = None) -> HeadSpec:
        """The spec matching a Llama-style target ``model`` (its last layer's shape).

        ``intermediate`` narrows the MLP (default: the target's width). The head starts
        from random weights (:meth:`EagleHead.init_identity`), so its MLP need not match a
        target layer; a narrower one trains faster on a CPU and stores smaller.
        """
        cfg = model.config
        width = int(cfg.intermediate_size) if intermediate is None else int(intermediate)
        if width < 1:
            raise ConfigError(f"intermediate={intermediate}: the MLP needs a width >= 1")
        return cls(
            hidden=int(cfg.hidden_size), heads=int(cfg.num_attention_heads),
            kv_heads=int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)),
            intermediate=width,
            rope_theta=float(_rope_theta(cfg)), eps=float(getattr(cfg, "rms_norm_eps", 1e-5)),
            draft_vocab=draft_vocab, target_name=target_name,
            target_vocab=int(model.get_output_embeddings().weight.shape[0]), checksum=checksum,
        )

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata block (string to string; the vocabulary is a tensor)."""
        return {
            "format": ARTIFACT_FORMAT, "hidden": str(self.hidden), "heads": str(self.heads),
            "kv_heads": str(self.kv_heads), "intermediate": str(self.intermediate),
            "rope_theta": repr(self.rope_theta), "eps": repr(self.eps),
            "target_name": self.target_name, "target_vocab": str(self.target_vocab),
            "checksum": repr(self.checksum),
        }

    @classmethod
    def from_metadata(cls, meta: dict[str, str], draft_vocab: tuple[int, ...]) -> HeadSpec:
        """Inverse of :meth:`metadata`.

        Raises:
            ConfigError: not an EAGLE head artifact, or a field is missing/malformed.
        """
        if meta.get("format") != ARTIFACT_FORMAT:
            raise ConfigError(f"not an EAGLE head artifact (format {meta.get('format')!r})")
        try:
            return cls(
                hidden=int(meta["hidden"]), heads=int(meta["heads"]),
                kv_heads=int(meta["kv_heads"]), intermediate=int(meta["intermediate"]),
                rope_theta=float(meta["rope_theta"]), eps=float(meta["eps"]),
                draft_vocab=draft_vocab, target_name=meta["target_name"],
                target_vocab=int(meta["target_vocab"]), checksum=float(meta["checksum"]),
            )
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"EAGLE head metadata is damaged: {exc!r}") from None


def _rope_theta(cfg: Any) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:  # transformers 5.x keeps it in rope_parameters
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


class _RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class HeadCache:
    """Keys and values of the head's one layer, ``[1, g, n, d]``, grown in place
    (capacity doubles) so appending a drafted token copies nothing old.

    It lives on ``device`` (the head's: :attr:`EagleHead.device`); keys appended from
    another device or dtype move the cache to theirs (the head's keys decide).
    """

    def __init__(self, kv_heads: int, head_dim: int, capacity: int = 256,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.k = torch.empty(1, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.n = 0

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values ``[1, g, n, d]``."""
        return self.k[:, :, : self.n], self.v[:, :, : self.n]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``[1, g, m, d]`` keys and values."""
        m = k.shape[2]
        if self.k.device != k.device or self.k.dtype != k.dtype:  # follow the head
            self.k = self.k.to(device=k.device, dtype=k.dtype)
            self.v = self.v.to(device=k.device, dtype=k.dtype)
        if self.n + m > self.k.shape[2]:
            cap = max(2 * self.k.shape[2], self.n + m)
            grown_k = self.k.new_empty(1, self.k.shape[1], cap, self.k.shape[3])
            grown_v = torch.empty_like(grown_k)
            grown_k[:, :, : self.n] = self.k[:, :, : self.n]
            grown_v[:, :, : self.n] = self.v[:, :, : self.n]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, self.n : self.n + m] = k
        self.v[:, :, self.n : self.n + m] = v
        self.n += m

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions."""
        self.n = min(self.n, n)


class EagleHead(torch.nn.Module):
    """One decoder layer from ``(feature, next token)`` pairs to the next feature.

    Args:
        spec: The head's shape.
        embed: The target's token embedding ``[V, H]`` (shared, frozen). Its device is
            the head's: the layer's parameters are made there.
        out: The target's LM-head rows of the draft vocabulary ``[N, H]`` (frozen).
    """

    def __init__(self, spec: HeadSpec, embed: torch.Tensor, out: torch.Tensor) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_dim
        self.spec = spec
        self.embed: torch.Tensor
        self.out: torch.Tensor
        self.inv_freq: torch.Tensor
        self.register_buffer("embed", embed.detach(), persistent=False)  # [V, H]
        self.register_buffer("out", out.detach(), persistent=False)  # [N, H]
        self.norm_f = _RMSNorm(h, spec.eps)
        self.norm_e = _RMSNorm(h, spec.eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.norm_a = _RMSNorm(h, spec.eps)
        self.q_proj = torch.nn.Linear(h, spec.heads * d, bias=False)
        self.k_proj = torch.nn.Linear(h, spec.kv_heads * d, bias=False)
        self.v_proj = torch.nn.Linear(h, spec.kv_heads * d, bias=False)
        self.o_proj = torch.nn.Linear(spec.heads * d, h, bias=False)
        self.norm_m = _RMSNorm(h, spec.eps)
        self.gate_proj = torch.nn.Linear(h, spec.intermediate, bias=False)
        self.up_proj = torch.nn.Linear(h, spec.intermediate, bias=False)
        self.down_proj = torch.nn.Linear(spec.intermediate, h, bias=False)
        inv = 1.0 / spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.register_buffer("inv_freq", inv, persistent=False)  # [d/2]
        self.to(embed.device)  # the target's device owns the head (the buffers are there)

    @property
    def device(self) -> torch.device:
        """Where the head runs: the target's embedding's device."""
        return self.embed.device

    def new_cache(self, capacity: int = 256) -> HeadCache:
        """An empty :class:`HeadCache` on the head's device."""
        return HeadCache(self.spec.kv_heads, self.spec.head_dim, capacity,
                         device=self.device, dtype=self.fc.weight.dtype)

    def init_identity(self, seed: int = 0) -> None:
        """Start as "the next feature is this feature plus this token": ``fc = [I | I]``
        and zero output projections (``o_proj``, ``down_proj``), so the layer's residual
        branches start silent and the first loss is sane; the other weights are small
        random (std 0.02). It learns faster than a copy of a target layer, whose residual
        branches add large, unrelated updates."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for lin in (self.q_proj, self.k_proj, self.v_proj, self.gate_proj, self.up_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.02)
            self.o_proj.weight.zero_()
            self.down_proj.weight.zero_()
            eye = torch.eye(self.spec.hidden)
            self.fc.weight.copy_(torch.cat([eye, eye], dim=1))  # [H, 2H]

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The tensors an artifact stores (not the shared embedding/head)."""
        return {k: v.detach() for k, v in self.state_dict().items()}

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [B, heads, T, d]; rotate pairs (i, i + d/2) by angle position * inv_freq.
        ang = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], dim=-1)  # [T, d]
        sin = torch.cat([ang.sin(), ang.sin()], dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(
        self,
        feats: torch.Tensor,  # [B, T, H]: f_i (true or predicted)
        tokens: torch.Tensor,  # [B, T]: x_{i+1}
        positions: torch.Tensor,  # [T]: i
        cache: HeadCache | None = None,
    ) -> torch.Tensor:
        """Predict ``f̂_{i+1}`` for every pair; returns ``[B, T, H]``.

        Without ``cache`` the T pairs attend causally among themselves (training). With a
        cache (``B == 1``) they attend to the cached pairs too, and their keys/values are
        appended to it. Inputs are moved to the head's device (:attr:`device`) and its
        dtype (a no-op when already there).
        """
        s = self.spec
        dev = self.device
        feats = feats.to(device=dev, dtype=self.fc.weight.dtype)
        tokens = tokens.to(dev)
        positions = positions.to(dev)
        b, t, _ = feats.shape
        x = self.fc(torch.cat([self.norm_f(feats), self.norm_e(self.embed[tokens])], dim=-1))
        a = self.norm_a(x)
        q = self.q_proj(a).view(b, t, s.heads, s.head_dim).transpose(1, 2)  # [B, h, T, d]
        k = self.k_proj(a).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)  # [B, g, T, d]
        v = self.v_proj(a).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = self._rope(q, positions), self._rope(k, positions)
        mask: torch.Tensor | None = None
        causal = cache is None and t > 1
        if cache is not None:
            past = cache.n
            cache.append(k, v)
            k, v = cache.view()  # [1, g, past + T, d]
            if t > 1:  # new pair r sees the past and new pairs <= r
                cols = torch.arange(past + t, device=dev)
                mask = cols[None, :] <= (past + torch.arange(t, device=dev))[:, None]
        group = s.heads // s.kv_heads
        k = k.repeat_interleave(group, dim=1)  # [B, h, n, d]
        v = v.repeat_interleave(group, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             scale=1.0 / math.sqrt(s.head_dim))
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))
        m = self.norm_m(x)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[.., N]`` of predicted features ``[.., H]`` (on the
        head's device)."""
        return feats.to(self.out.device) @ self.out.T
