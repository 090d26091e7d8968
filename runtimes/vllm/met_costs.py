"""What vLLM's steps cost as the stopper meets them, against vLLM's curve: per batch size, one factor on the draft's
forwards and one on the target's verifications, each a running average of the steps seen (the latest ten weighing
most).

The curve is timed apart from serving. On a shared host a step's price moves by a
third within minutes, and not by one factor for the draft and the target (with a second engine loaded beside it, the
target's steps slowed more than the draft's). The batch rule weighs a draft forward against verification, so a curve
off by different factors on the two drafts too much or too little; the stopper prices steps at the factors it meets
(``runtimes.vllm.stopper``: a forward is timed from the round's start to its proposals, a verification from the
proposals to the next round's start).

Usage::

    met = MetCosts()
    met.draft(4, seconds_a_forward / curve.draft_s_per_token)
    met.verify(4, step_seconds / curve.target_time(mean_length))
    cost = batch_cost.scaled(*met.levels(4))
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MetCosts", "WINDOW", "CLAMP"]

WINDOW = 10
"""Steps a factor averages over: the first ten equally, then each new one weighing 1/10."""
CLAMP = (0.25, 4.0)
"""The range a step's factor is kept in (a step stalled by something else than its forward counts as 4x at most)."""


@dataclass
class MetCosts:
    """Per batch size, the factors met on the draft's forwards and on the verifications (:meth:`levels`)."""

    factors: dict[int, list[float]] = field(default_factory=dict)
    """Batch size -> [draft factor, verification factor]."""
    seen: dict[int, list[int]] = field(default_factory=dict)
    """Batch size -> [draft steps, verification steps] averaged."""

    def draft(self, batch: int, factor: float) -> None:
        """One round's draft forwards ran ``factor`` times the curve's price at ``batch`` requests."""
        self._add(batch, 0, factor)

    def verify(self, batch: int, factor: float) -> None:
        """One verification step ran ``factor`` times the curve's price at ``batch`` requests."""
        self._add(batch, 1, factor)

    def _add(self, batch: int, i: int, factor: float) -> None:
        cell = self.factors.setdefault(batch, [1.0, 1.0])
        seen = self.seen.setdefault(batch, [0, 0])
        seen[i] += 1
        weight = max(1.0 / seen[i], 1.0 / WINDOW)
        cell[i] += weight * (min(max(float(factor), CLAMP[0]), CLAMP[1]) - cell[i])

    def levels(self, batch: int) -> tuple[float, float]:
        """(draft, verification) factors at ``batch`` requests; (1, 1), the curve as measured, until both were met."""
        if min(self.seen.get(batch, [0, 0])) == 0:
            return 1.0, 1.0
        draft, verify = self.factors[batch]
        return draft, verify
