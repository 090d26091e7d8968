"""SPRINTER verifier: one linear layer + sigmoid on the draft's last hidden state (inputs standardised by buffers).

Labels q(x)/p(x) <= lambda (``predictors.labels.derive_label(cols, "ratio", lam)``, lambda in {1, 1.2, 1.5}); BCE with
class weights, Adam, early stopping (see ``predictors.training``). Decoding with it is approximate (the target checks
only the last token), so the policy has ``exact = False``; threshold tau = 0.5 by default.

Usage::

    policy = SprinterPolicy(SprinterNet(hidden_size=896), FeatureSpec.for_sprinter(896), threshold=0.5)
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from compute.draft_stats import disco_score
from predictors.disco import PriorLogit, Standardise
from predictors.inputs import FeatureSpec, LearnedPolicy, disco_scalars
from predictors.round_rules import SEQUENTIAL

__all__ = ["SprinterNet", "SprinterPolicy"]


class SprinterNet(nn.Module):
    """Standardise -> Linear(hidden_size, 1); forward gives [N] logits (H + 1 trainable parameters).

    With ``prior_index`` >= 0 the raw input at that index (a probability) enters the logit as
    :class:`~predictors.disco.PriorLogit` and the linear layer starts at zero (a learned correction to the prior).
    """

    def __init__(self, hidden_size: int, prior_index: int = -1) -> None:
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"SprinterNet needs hidden_size > 0, got {hidden_size}")
        if prior_index >= hidden_size:
            raise ValueError(f"SprinterNet prior_index={prior_index} must be < hidden_size={hidden_size}")
        self.hidden_size, self.prior_index = hidden_size, prior_index
        self.norm = Standardise(hidden_size)
        self.linear = nn.Linear(hidden_size, 1)
        if prior_index >= 0:
            self.prior = PriorLogit(prior_index)
            nn.init.zeros_(self.linear.weight)
            nn.init.zeros_(self.linear.bias)

    def config(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "prior_index": self.prior_index}

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(self.norm(x)).squeeze(-1)  # [N]
        return out + self.prior(x) if self.prior_index >= 0 else out


class SprinterPolicy(LearnedPolicy):
    """SPRINTER: keep drafting while V(h) >= tau; approximate decoding (``exact = False``)."""

    kind = "sprinter"
    round_rule = SEQUENTIAL
    output = "logit"

    def __init__(self, net: SprinterNet, spec: FeatureSpec, threshold: float = 0.5, max_draft_len: int = 40) -> None:
        if spec.kind != "sprinter" or spec.width != net.hidden_size:
            raise ValueError(
                f"SprinterPolicy needs a sprinter FeatureSpec of width {net.hidden_size}, "
                f"got {spec.kind} width {spec.width}"
            )
        super().__init__(net, spec, threshold, max_draft_len)
        self._scalars, self._divisors, self._logs = disco_scalars(spec)
        prior_on_disco = net.prior_index < 0 or net.prior_index >= spec.hidden_size
        self._native = spec.parts == ("hidden", "disco") and prior_on_disco

    def folded(self) -> tuple[tuple[Tensor, Tensor, Tensor, float], Tensor, tuple[int, float, float]]:
        """The eval network as the native ``disco_score`` takes it: the standardisation folded into the linear layer
        (w' = w / std, b' = b - w' . mean), its DISCO part as a two-unit ReLU layer that passes z = b' + w'_disco . x
        through exactly (relu(z) - relu(-z)), its hidden-state part as the vector the hidden state is dotted with, and
        the prior on a DISCO input (index within the DISCO part)."""
        net, hd = self.net, self.spec.hidden_size
        params = (net.linear.weight, net.linear.bias, net.norm.mean, net.norm.std,
                  *((net.prior.scale, net.prior.bias) if net.prior_index >= 0 else ()))
        key = tuple((t.data_ptr(), t._version) for t in params)
        if self.__dict__.get("_fold_key") != key:
            with torch.no_grad():
                w = net.linear.weight[0] / net.norm.std
                b = float(net.linear.bias[0] - (w * net.norm.mean).sum())
                wd = w[hd:]
                layer = (torch.stack([wd, -wd]).contiguous(), torch.tensor([b, -b]), torch.tensor([1.0, -1.0]), 0.0)
                prior = ((net.prior_index - hd, float(net.prior.scale), float(net.prior.bias)) if net.prior_index >= 0
                         else (-1, 1.0, 0.0))
                self._fold = (layer, w[:hd].contiguous(), prior)
            self._fold_key = key
        return self._fold

    @torch.no_grad()
    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        """On the CPU one native call (``compute.draft_stats.disco_score`` with the hidden-state term: the inputs and
        the linear layer, equal to the torch path to float32 rounding, tested) instead of about twenty tensor
        operations, each several times its warm cost right after a draft forward; the torch path elsewhere."""
        if self._native and not self.net.training and self.net.linear.weight.device.type == "cpu":
            topk, hid = features.get("draft_topk"), features.get("draft_hidden")
            cols = [features.get(c) for c in self._scalars]
            if (isinstance(topk, Tensor) and topk.dim() == 2 and isinstance(hid, Tensor) and hid.dim() == 2
                    and all(isinstance(c, Tensor) for c in cols)):
                layer, wh, prior = self.folded()
                out = disco_score(topk, cols, self._divisors, self._logs, layer, prior, hidden=hid, hidden_w=wh)
                if out is not None:
                    return out
        return super().score(features)
