"""DISCO: a 2-layer FFN on the top-k draft probabilities, their entropy and the position (optionally a training-free
prior and the draft's hidden state), trained with BCE on greedy-match labels and an optional TV regression term; the
policy drafts while sigmoid(score) >= threshold, up to ``max_draft_len``.

Usage::

    policy = DiscoPolicy(DiscoNet(in_dim=spec.width, hidden_size=64), spec, threshold=0.5, max_draft_len=40)
    keep = policy.keep_drafting(features)   # features: record columns as tensors
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from compute.draft_stats import disco_score
from predictors.inputs import FeatureSpec, LearnedPolicy, disco_scalars

__all__ = ["Standardise", "PriorLogit", "DiscoNet", "DiscoPolicy"]

PRIOR_COLUMNS = ("q", "draft_max_prob")
"""Training-free scores a learned predictor can start from (``prior``): probabilities, entered as their logit."""


class Standardise(nn.Module):
    """(x - mean) / std with mean and std fitted on the training split and kept as buffers."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    @torch.no_grad()
    def fit(self, x: Tensor) -> None:
        """Fit on [N, dim] training inputs (constant features keep std 1)."""
        if x.dim() != 2 or x.shape[1] != self.mean.numel():
            raise ValueError(f"Standardise.fit expects [N, {self.mean.numel()}], got {tuple(x.shape)}")
        x = x.double()
        self.mean.copy_(x.mean(0).float())
        std = x.std(0, unbiased=False).float()
        self.std.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std


class PriorLogit(nn.Module):
    """``scale * logit(x[:, index]) + bias``: a training-free probability as a logit, to which a predictor adds its
    learned output, so it starts ranking as that score does."""

    def __init__(self, index: int) -> None:
        super().__init__()
        if index < 0:
            raise ValueError(f"PriorLogit index={index} must be >= 0")
        self.index = index
        self.scale = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        """[N, D] raw (unstandardised) inputs -> [N] logits."""
        return torch.addcmul(self.bias, self.scale, torch.logit(x[:, self.index], eps=1e-6))  # logit clamps to eps


class DiscoNet(nn.Module):
    """Standardise -> Linear -> ReLU -> Linear (+ a TV head) giving [N] logits; optionally a hybrid head projecting the
    draft's hidden state (``hidden_dim``, ``hidden_rank``) and a :class:`PriorLogit` the FFN learns a correction to."""

    def __init__(
        self, in_dim: int, hidden_size: int = 64, dropout: float = 0.0, tv_head: bool = False,
        hidden_dim: int = 0, hidden_rank: int = 0, prior_index: int = -1,
    ) -> None:
        super().__init__()
        if in_dim <= 0 or hidden_size <= 0:
            raise ValueError(f"DiscoNet needs in_dim > 0 and hidden_size > 0, got {in_dim}, {hidden_size}")
        if hidden_dim and not (0 < hidden_dim < in_dim and hidden_rank > 0):
            raise ValueError(f"DiscoNet hybrid head needs 0 < hidden_dim < in_dim and hidden_rank > 0, got "
                             f"hidden_dim={hidden_dim}, in_dim={in_dim}, hidden_rank={hidden_rank}")
        self.in_dim, self.hidden_size, self.dropout, self.tv_head = in_dim, hidden_size, dropout, tv_head
        self.hidden_dim, self.hidden_rank = hidden_dim, hidden_rank if hidden_dim else 0
        self.norm = Standardise(in_dim)
        base = in_dim - hidden_dim
        if hidden_dim:
            self.proj = nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden_dim, hidden_rank))
            self.skip = nn.Linear(base, 1, bias=False)
        self.body = nn.Sequential(nn.Linear(base + self.hidden_rank, hidden_size), nn.ReLU(), nn.Dropout(dropout))
        self.head = nn.Linear(hidden_size, 2 if tv_head else 1)
        if prior_index >= in_dim:
            raise ValueError(f"DiscoNet prior_index={prior_index} must be < in_dim={in_dim}")
        self.prior_index = prior_index
        if prior_index >= 0:
            self.prior = PriorLogit(prior_index)
            with torch.no_grad():  # the correction starts at zero
                self.head.weight[0].zero_()
                self.head.bias[0].zero_()
                if hidden_dim:
                    self.skip.weight.zero_()

    def config(self) -> dict[str, Any]:
        return {"in_dim": self.in_dim, "hidden_size": self.hidden_size, "dropout": self.dropout,
                "tv_head": self.tv_head, "hidden_dim": self.hidden_dim, "hidden_rank": self.hidden_rank,
                "prior_index": self.prior_index}

    def forward_all(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """[N, in_dim] -> ([N] acceptance logits, [N] predicted TV distance in [0, 1] or None)."""
        z = self.norm(x)
        if self.hidden_dim:
            zd, zh = z[:, : -self.hidden_dim], z[:, -self.hidden_dim :]
            out = self.head(self.body(torch.cat([zd, self.proj(zh)], dim=1)))
            out = out + torch.nn.functional.pad(self.skip(zd), (0, out.shape[1] - 1))  # skip feeds the logit only
        else:
            out = self.head(self.body(z))  # [N, 1 or 2]
        if self.prior_index >= 0:
            prior = self.prior(x)[:, None]
            out = out + (prior if out.shape[1] == 1 else torch.nn.functional.pad(prior, (0, out.shape[1] - 1)))
        tv = torch.sigmoid(out[:, 1]) if self.tv_head else None
        return out[:, 0], tv

    def forward(self, x: Tensor) -> Tensor:
        """[N, in_dim] -> [N] acceptance logits (training, validation and every score off the native call)."""
        return self.forward_all(x)[0]

    @torch.no_grad()
    def folded(self) -> tuple[tuple[Tensor, Tensor, Tensor, float], tuple[int, float, float]]:
        """The plain head's weights as ``compute.draft_stats.disco_score`` takes them, standardisation folded into the
        first layer, and the prior (index -1 without one); equal to :meth:`forward` to float32 rounding (tested)."""
        if self.hidden_dim:
            raise ValueError("DiscoNet.folded: the hybrid head (hidden_dim > 0) has no folded form; use forward")
        first = self.body[0]
        w = first.weight / self.norm.std
        prior = ((self.prior_index, float(self.prior.scale), float(self.prior.bias)) if self.prior_index >= 0
                 else (-1, 1.0, 0.0))
        return ((w.contiguous(), (first.bias - w @ self.norm.mean).contiguous(), self.head.weight[0].contiguous(),
                 float(self.head.bias[0])), prior)


class DiscoPolicy(LearnedPolicy):
    """DISCO stop policy: keep drafting while sigmoid(FFN(features)) >= threshold, at most ``max_draft_len`` tokens.

    The plain head on the CPU scores in one native call (``disco_score``), faster right after a draft forward; elsewhere
    the net's forward does; both agree to float32 rounding. After changing the net's weights in place, call
    :meth:`prepare`.
    """

    kind = "disco"
    output = "logit"

    def __init__(self, net: DiscoNet, spec: FeatureSpec, threshold: float = 0.5, max_draft_len: int = 40) -> None:
        if spec.kind != "disco" or spec.width != net.in_dim:
            raise ValueError(
                f"DiscoPolicy needs a disco FeatureSpec of width {net.in_dim}, got {spec.kind} width {spec.width}"
            )
        super().__init__(net, spec, threshold, max_draft_len)
        # the scalar columns after the top-k and its entropy, as build_features orders them: position, then extras
        self._scalars, self._divisors, self._logs = disco_scalars(spec)
        self.native = True
        """Score through the native call where it applies (False: always through the net's forward)."""
        self._weights: tuple[Tensor, Tensor, Tensor, float] | None = None
        self._prior: tuple[int, float, float] = (-1, 1.0, 0.0)
        self.prepare()

    def prepare(self) -> None:
        """Take the native call's weights from the net, or none where the call does not apply (hybrid head, off the
        CPU)."""
        applies = self.spec.parts == ("disco",) and not self.net.hidden_dim and self.device().type == "cpu"
        self._weights, self._prior = self.net.folded() if applies else (None, (-1, 1.0, 0.0))

    def to(self, device: str | torch.device) -> DiscoPolicy:
        super().to(device)
        self.prepare()
        return self

    @torch.no_grad()
    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        if self.native and self._weights is not None and not self.net.training:
            topk = features.get("draft_topk")
            cols = [features.get(c) for c in self._scalars]
            if isinstance(topk, Tensor) and topk.dim() == 2 and all(isinstance(c, Tensor) for c in cols):
                out = disco_score(topk, cols, self._divisors, self._logs, self._weights, self._prior)
                if out is not None:
                    return out
        return super().score(features)
