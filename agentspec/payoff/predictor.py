"""The payoff predictor g_θ: a small MLP from φ_t to the cache draft's accepted length ŷ_t.

Two hidden layers of 16 ReLU units over standardised features (~600 weights): enough to
combine "long match" with "inside a JSON object" style interactions, small enough to ship
as a few-KB JSON file and to evaluate per decode step in a few microseconds with plain
Python lists (no torch call on the hot path: a torch op costs more than this whole MLP).

By default the MLP is *residual*: ŷ = score + MLP(φ), where score is the suffix tree's own
expected accepted length (a feature). The tree's estimate is a strong start (on held-out
sessions nearly as accurate as an MLP trained from scratch) but is blind to context such
as "the model is re-emitting a document"; the network learns the correction, and an early-stopped
correction can only move away from the tree's estimate where that helps on held-out
sessions.

Training (:meth:`PayoffPredictor.fit`) is torch, full-batch Adam on MSE with the best
validation epoch kept; every random draw comes from seeded generators.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentspec.errors import AgentSpecError
from agentspec.payoff.features import FEATURE_NAMES, NUM_FEATURES

FORMAT = "agentspec-payoff/1"


_SCORE = FEATURE_NAMES.index("log_score")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary (``"none"`` without a tokenizer).

    Two tokenizers with the same token -> id map produce the same ids for the same text,
    which is all a predictor (and trace replay) needs to agree on.
    """
    if tokenizer is None:
        return "none"
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def _score(phi: Sequence[float]) -> float:
    """The suffix tree's score of the draft (φ holds it as log1p)."""
    return math.expm1(phi[_SCORE])


class PredictorError(AgentSpecError, ValueError):
    """A predictor file is missing, malformed, or made for other features or vocabulary."""


@dataclass
class PayoffPredictor:
    """MLP weights, feature standardisation and the decision threshold τ.

    Attributes:
        mean: Per-feature mean of the training set.
        std: Per-feature standard deviation (floored, so constant features stay finite).
        layers: ``[(W, b), ...]`` with ``W`` as ``[out][in]`` nested lists.
        tau: Verify the cache draft when ŷ ≥ τ (chosen on validation sessions).
        meta: Provenance and held-out quality numbers (free-form JSON).
        residual: ŷ = suffix score + network output (else the network output alone).
    """

    mean: list[float]
    std: list[float]
    layers: list[tuple[list[list[float]], list[float]]]
    tau: float = 6.0
    meta: dict[str, Any] = field(default_factory=dict)
    residual: bool = False

    def __post_init__(self) -> None:
        if len(self.mean) != NUM_FEATURES or len(self.std) != NUM_FEATURES:
            raise PredictorError(
                f"predictor has {len(self.mean)} feature means, expected {NUM_FEATURES}"
            )

    # -- inference ----------------------------------------------------------------------

    def predict(self, phi: Sequence[float]) -> float:
        """ŷ for one feature vector ``[NUM_FEATURES]``, clamped at 0."""
        h = [(x - m) / s for x, m, s in zip(phi, self.mean, self.std, strict=True)]
        last = len(self.layers) - 1
        for i, (w, b) in enumerate(self.layers):
            # h' = W h + b ; ReLU on hidden layers only
            h = [sum(wi * hi for wi, hi in zip(row, h, strict=True)) + bi
                 for row, bi in zip(w, b, strict=True)]
            if i < last:
                h = [v if v > 0.0 else 0.0 for v in h]
        return max(0.0, h[0] + (_score(phi) if self.residual else 0.0))

    def predict_many(self, rows: Sequence[Sequence[float]]) -> list[float]:
        """ŷ for many feature vectors (torch, batched: replay and evaluation)."""
        import torch

        net = self._torch_net()
        x = self._standardise(torch.tensor(rows, dtype=torch.float32))  # [N, F]
        with torch.no_grad():
            out = net(x).squeeze(-1)  # [N]
        if self.residual:
            out = out + torch.tensor([_score(r) for r in rows], dtype=torch.float32)
        return [float(v) for v in out.clamp_min(0.0)]

    # -- training -----------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        x_train: Sequence[Sequence[float]],
        y_train: Sequence[float],
        x_val: Sequence[Sequence[float]],
        y_val: Sequence[float],
        hidden: int = 16,
        epochs: int = 400,
        lr: float = 1e-2,
        weight_decay: float = 1e-4,
        seed: int = 0,
        residual: bool = True,
    ) -> PayoffPredictor:
        """Fit by full-batch Adam on MSE; keep the epoch with the lowest validation MSE.

        Targets are standardised too (y' = (y − ȳ) / s_y), and the scale is folded back into
        the output layer (W ← s_y W, b ← s_y b + ȳ): accepted lengths reach the draft cap
        (e.g. 32 on copying workloads), which an output starting near 0 cannot reach in a
        few hundred Adam steps of size lr.

        Raises:
            PredictorError: no training rows, or rows of the wrong width.
        """
        import torch

        if not x_train:
            raise PredictorError("no training rows: the traces produced no replay positions")
        if any(len(r) != NUM_FEATURES for r in x_train):
            raise PredictorError(f"training rows must have {NUM_FEATURES} features")
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        xt = torch.tensor(x_train, dtype=torch.float32)  # [N, F]
        yt = torch.tensor(y_train, dtype=torch.float32)  # [N]
        if residual:  # learn y − score
            yt = yt - torch.tensor([_score(r) for r in x_train], dtype=torch.float32)
            y_val = [y - _score(r) for r, y in zip(x_val, y_val, strict=True)]
        mean = xt.mean(0)
        std = xt.std(0, unbiased=False).clamp_min(1e-3)
        y_mean = float(yt.mean())
        y_std = max(float(yt.std(unbiased=False)), 1e-3)
        yt = (yt - y_mean) / y_std
        net = torch.nn.Sequential(
            torch.nn.Linear(NUM_FEATURES, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, 1),
        )
        with torch.no_grad():  # seeded init independent of global RNG state
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[-1])))
        xs = (xt - mean) / std
        xv = (torch.tensor(x_val, dtype=torch.float32) - mean) / std if x_val else xs
        yv = (torch.tensor(y_val, dtype=torch.float32) - y_mean) / y_std if x_val else yt
        opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
        best, best_state = math.inf, [p.detach().clone() for p in net.parameters()]
        for _ in range(epochs):
            opt.zero_grad()
            loss = torch.mean((net(xs).squeeze(-1) - yt) ** 2)
            loss.backward()
            opt.step()
            with torch.no_grad():
                val = float(torch.mean((net(xv).squeeze(-1) - yv) ** 2))
            if val < best:
                best, best_state = val, [p.detach().clone() for p in net.parameters()]
        params = best_state
        params[-2], params[-1] = params[-2] * y_std, params[-1] * y_std + y_mean
        layers = [(params[i].tolist(), params[i + 1].tolist()) for i in range(0, len(params), 2)]
        return cls(mean.tolist(), std.tolist(), layers, residual=residual)

    # -- persistence --------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write the predictor as JSON (weights rounded to 6 significant digits)."""

        def r(v: float) -> float:
            return float(f"{v:.6g}")

        data = {
            "format": FORMAT,
            "features": list(FEATURE_NAMES),
            "tau": r(self.tau),
            "mean": [r(v) for v in self.mean],
            "std": [r(v) for v in self.std],
            "layers": [{"w": [[r(v) for v in row] for row in w], "b": [r(v) for v in b]}
                       for w, b in self.layers],
            "meta": self.meta,
            "residual": self.residual,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, separators=(",", ":")))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> PayoffPredictor:
        """Read a predictor written by :meth:`save`.

        Raises:
            PredictorError: missing or malformed file, or a different feature list.
        """
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PredictorError(f"cannot read payoff predictor {str(path)!r}: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PredictorError(f"{str(path)!r} is not a payoff predictor ({FORMAT})")
        if data.get("features") != list(FEATURE_NAMES):
            raise PredictorError(
                f"predictor {str(path)!r} was trained on features {data.get('features')!r}, "
                f"this build computes {list(FEATURE_NAMES)!r}"
            )
        try:
            layers = [([list(map(float, row)) for row in layer["w"]], list(map(float, layer["b"])))
                      for layer in data["layers"]]
            return cls(list(map(float, data["mean"])), list(map(float, data["std"])), layers,
                       float(data["tau"]), dict(data.get("meta", {})),
                       bool(data.get("residual", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise PredictorError(f"payoff predictor {str(path)!r} is malformed: {exc}") from None

    # -- internals ----------------------------------------------------------------------

    def _standardise(self, x: Any) -> Any:
        import torch

        return (x - torch.tensor(self.mean)) / torch.tensor(self.std)

    def _torch_net(self) -> Any:
        import torch

        mods: list[torch.nn.Module] = []
        for i, (w, b) in enumerate(self.layers):
            lin = torch.nn.Linear(len(w[0]), len(w))
            with torch.no_grad():
                lin.weight.copy_(torch.tensor(w))
                lin.bias.copy_(torch.tensor(b))
            mods.append(lin)
            if i < len(self.layers) - 1:
                mods.append(torch.nn.ReLU())
        return torch.nn.Sequential(*mods)
