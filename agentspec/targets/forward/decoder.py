"""A decode step without transformers' per-module Python: the same operations, called directly.

A CPU decode step of a small model is partly host work. transformers' forward wraps each
of a Llama-style model's layers in decorators, keyword plumbing, output capture, a mask
builder and a generic cache interface, a fixed cost per forward that is a large share of a
small model's step (``docs/cpu_step.md`` has the measurements).

:class:`DirectDecoder` runs the shape-stable decode forward of such a model as one plain
loop over its layers that calls the model's own modules (norms, the projections whatever
their kind: fp32, bf16, int8, w8a8 or w8a16, the rotary embedding, the MLP's activation, the
final norm and the output layer) and :func:`~agentspec.targets.forward.attention.stable_attention`
(what the registered attention function runs for these forwards anyway), in transformers'
order and dtypes, so its logits are meant to be transformers' bits; its keys and values
go through the cache's own ``update``. Where q, k and v are int8 layers they run as one
product (:meth:`~agentspec.targets.kernels.int8.Int8Linear.concat`,
:meth:`~agentspec.targets.kernels.w8a8.W8A8Linear.concat`: each column is computed on its own, so
each part keeps its bits), and so do the MLP's gate and up projections; queries and keys
are rotated together (elementwise, the same bits).

That is not taken on trust: the first step a target runs with it is also run through
transformers, and unless logits, keys and values are the same bits the decoder is dropped
for the life of the target, with a warning (the output is the same either way, only
slower). Models outside the family (other layer layouts, sliding windows, query/key norms,
attention sinks) are never given one: :meth:`DirectDecoder.build` returns ``None``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from agentspec.targets.forward.attention import ATTENTION_NAME, stable_attention
from agentspec.targets.kernels.int8 import Int8Linear
from agentspec.targets.kernels.w8a8 import W8A8Linear

log = logging.getLogger(__name__)

#: Architectures whose decoder layers are exactly: RMSNorm, q/k/v projections, rotary
#: embedding, attention, o projection, residual, RMSNorm, gated MLP, residual.
FAMILY = ("llama", "qwen2")

_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, op for op: statistics in fp32, the weight
    applied after rounding back. ``[1, rows, H]`` -> ``[1, rows, H]``."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' ``apply_rotary_pos_emb``):
    ``x`` ``[1, heads, rows, d]``, ``cos``/``sin`` ``[1, 1, rows, d]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def fused(owner: torch.nn.Module, names: tuple[str, ...]) -> Int8Linear | W8A8Linear | None:
    """One layer computing ``owner``'s int8 layers ``names`` side by side (``None`` unless
    they are all of one int8 kind), made once per ``owner``.

    Each output column of the stacked product is its own exact sum, so each part keeps its
    bits. The parts' buffers then become row slices of the stacked ones (contiguous views),
    so the weights are held once: transformers' forward, which calls the parts, reads the
    same bytes. Kept on ``owner`` outside its submodules (``state_dict`` and ``modules()``
    see only the parts), and a second decoder built on the model reuses it.
    """
    key = "_agentspec_fused_" + "_".join(names)
    made = owner.__dict__.get(key)
    if made is not None:
        return made
    parts = [getattr(owner, n) for n in names]
    kind = type(parts[0])
    if kind not in (Int8Linear, W8A8Linear) or any(type(p) is not kind for p in parts):
        return None
    layer = kind.concat(parts)
    start = 0
    for part in parts:  # [out_i, in] views of the stacked [Σ out_i, in]
        end = start + part.out_features
        part.qweight = layer.qweight[start:end]
        part.scales = layer.scales[start:end]
        if layer.bias is not None:
            part.bias = layer.bias[start:end]
        start = end
    object.__setattr__(owner, key, layer)  # not a submodule
    return layer


class DirectDecoder:
    """The shape-stable decode forward of a Llama-family model, without the wrappers.

    Args:
        model: The causal LM (its modules are read, never copied).

    Attributes:
        checked: Whether the first step's comparison with transformers has passed.
        failed: Why the decoder was dropped (``None`` while it is used).
        steps: Forwards it has run.
    """

    def __init__(self, model: Any) -> None:
        body = model.model
        cfg = model.config
        heads = int(cfg.num_attention_heads)
        self.heads = heads
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.norm = body.norm
        self.head = model.lm_head
        self.layers = list(body.layers)
        # int8 q/k/v projections (any of the int8 precisions) as one product per layer, and
        # gate and up as another: one kernel call instead of three and of two, the same
        # bits per column.
        self.qkv = [fused(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
                    for layer in self.layers]
        self.gate_up = [fused(layer.mlp, ("gate_proj", "up_proj")) for layer in self.layers]
        self.checked = False
        self.failed: str | None = None
        self.steps = 0

    @classmethod
    def build(cls, model: Any, device: str) -> DirectDecoder | None:
        """A decoder for ``model``, or ``None`` where its layers are not the family's (the
        target then keeps transformers' forward). CPU only: on CUDA a captured graph
        already removes the host's work."""
        cfg = getattr(model, "config", None)
        body = getattr(model, "model", None)
        if (not str(device).startswith("cpu") or cfg is None or body is None
                or getattr(cfg, "model_type", None) not in FAMILY):
            return None
        if getattr(cfg, "_attn_implementation", None) != ATTENTION_NAME:
            return None  # transformers' forward would not run stable_attention either
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
            return None  # sliding-window layers read other masks
        if int(getattr(cfg, "pretraining_tp", 1) or 1) != 1:
            return None
        parts = ("embed_tokens", "rotary_emb", "norm", "layers")
        if not all(hasattr(body, p) for p in parts) or not hasattr(model, "lm_head"):
            return None
        for layer in body.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if (not all(hasattr(layer, p) for p in _LAYER_PARTS)
                    or not all(hasattr(attn, p) for p in _ATTN_PARTS)
                    or not all(hasattr(mlp, p) for p in _MLP_PARTS)
                    or hasattr(attn, "q_norm") or hasattr(attn, "sinks")
                    or getattr(attn, "sliding_window", None)):
                return None
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if not hasattr(norm, "variance_epsilon") or not hasattr(norm, "weight"):
                    return None
        if not hasattr(body.norm, "variance_epsilon"):
            return None
        return cls(model)

    @property
    def usable(self) -> bool:
        """Whether steps go through it (not dropped)."""
        return self.failed is None

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                cache: Any) -> torch.Tensor:
        """The model over ``ids`` ``[1, rows]`` at positions ``pos`` ``[1, rows]`` under the
        additive ``mask`` ``[1, 1, rows, attend]``, appending keys and values to ``cache``
        (steered by its plan, as transformers' forward would be); the logits ``[rows, V]``.
        Call it inside ``inference_mode`` with :data:`~agentspec.targets.forward.attention.
        STABLE_STEP` set, as the target's stable step does."""
        self.steps += 1
        rows, d = int(ids.shape[1]), self.head_dim
        x = self.embed(ids)  # [1, rows, H]
        cos, sin = self.rotary(x, pos)  # [1, rows, d] each, x's dtype
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, rows, d]
        qk_heads = self.heads + self.kv_heads
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = _rms_norm(layer.input_layernorm, x)
            qkv = self.qkv[i]
            if qkv is not None:  # [1, heads + 2 kv, rows, d]
                y = qkv(h).view(1, rows, -1, d).transpose(1, 2)
                qk, v = y[:, :qk_heads], y[:, qk_heads:]
            else:
                q = attn.q_proj(h).view(1, rows, -1, d).transpose(1, 2)  # [1, heads, rows, d]
                k = attn.k_proj(h).view(1, rows, -1, d).transpose(1, 2)  # [1, kv, rows, d]
                v = attn.v_proj(h).view(1, rows, -1, d).transpose(1, 2)
                qk = torch.cat((q, k), dim=1)
            # Queries and keys rotated together: elementwise, so each gets its own bits.
            qk = _rotate(qk, cos, sin)  # [1, heads + kv, rows, d]
            keys, values = cache.update(qk[:, self.heads :], v, i)  # [1, kv, attend, d]
            o = stable_attention(qk[:, : self.heads], keys, values, mask, attn.scaling)
            x = x + attn.o_proj(o.reshape(1, rows, -1))  # o: [1, rows, heads, d]
            mlp = layer.mlp
            h = _rms_norm(layer.post_attention_layernorm, x)
            gate_up = self.gate_up[i]
            if gate_up is not None:  # [1, rows, 2 · inner]
                gate, up = gate_up(h).chunk(2, dim=-1)
            else:
                gate, up = mlp.gate_proj(h), mlp.up_proj(h)
            x = x + mlp.down_proj(mlp.act_fn(gate) * up)
        # The module call, not _rms_norm: hooks on the final norm (the target keeps its
        # output as the drafters' features) must run.
        return self.head(self.norm(x))[0]  # [rows, V]

    def drop(self, why: str) -> None:
        """Stop using the decoder (steps go through transformers), saying why once."""
        if self.failed is None:
            self.failed = why
            log.warning("direct decode step dropped (%s); steps run through transformers' "
                        "forward: same output, slower", why)
