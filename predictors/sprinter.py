"""SPRINTER verifier: one linear layer + sigmoid on the draft's last hidden state (inputs standardised by buffers).

Labels q(x)/p(x) <= lambda (``predictors.labels.derive_label(cols, "ratio", lam)``, lambda in {1, 1.2, 1.5}); BCE with
class weights, Adam, early stopping (see ``predictors.training``). Decoding with it is approximate (the target checks
only the last token), so the policy has ``exact = False``; threshold tau = 0.5 by default.

Usage::

    policy = SprinterPolicy(SprinterNet(hidden_size=896), FeatureSpec.for_sprinter(896), threshold=0.5)
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from predictors.base import SEQUENTIAL
from predictors.disco import PriorLogit, Standardise
from predictors.inputs import FeatureSpec, LearnedPolicy

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
    verification = SEQUENTIAL
    output = "logit"

    def __init__(self, net: SprinterNet, spec: FeatureSpec, threshold: float = 0.5, max_draft_len: int = 40) -> None:
        if spec.kind != "sprinter" or spec.width != net.hidden_size:
            raise ValueError(
                f"SprinterPolicy needs a sprinter FeatureSpec of width {net.hidden_size}, "
                f"got {spec.kind} width {spec.width}"
            )
        super().__init__(net, spec, threshold, max_draft_len)
