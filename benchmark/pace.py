"""Which benchmark runs a slow phase of the host hit: each run's model forwards timed against the verification curve,
so a row is run again only when it ran slower than the prompt's other rows (``benchmark.plan``,
``rerun_slower_than``).

A shared VM slows down for several seconds at a time, longer than a row's run on one prompt, so a slow phase covers a
few rows of a prompt. Running every row twice and keeping its faster run removes such spikes but
doubles the benchmark. Instead, while a row runs, :class:`PaceMeter` times every forward of the target and the draft
whose length the curve prices (a target pass of L new tokens, L up to the longest measured; a draft step of a few
tokens; prefills are left out) and adds the curve's time for it. A run's pace per model is its measured over its
predicted seconds. Within one prompt, the rows' median pace per model (over the prompt's first pass, where a slow
phase covers a minority of rows) is the prompt's normal pace; a run whose forwards took more than ``1 + tolerance``
times what the normal paces predict for them (:func:`excess`) was slowed down, and only such rows run again
(target-only too: every row is measured alike).

Trade-off: less time in the rows, but a row then keeps a typical run, not the faster of two, so on a noisy host its
time sits above a curve made of minimum times; the benchmark's default stays every row twice.

Usage (inside the benchmark)::

    with PaceMeter({"target": target, "draft": draft}, cost_model) as meter:
        row = runner(bench)
    pace = meter.pace            # Pace(actual={"target": s, "draft": s}, predicted={...})
    normal = normal_pace([pace, ...])
    slow = excess(pace, normal) > 0.05
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from compute.timing import CostModel

__all__ = ["Pace", "PaceMeter", "normal_pace", "excess", "DRAFT_STEP_MAX_TOKENS"]

DRAFT_STEP_MAX_TOKENS = 4
"""A draft forward of at most this many new tokens is priced as one draft step (catching up after a verification
feeds 1-2); longer ones are prefills."""


@dataclass
class Pace:
    """Seconds a run spent in forwards the curve prices, measured and predicted, per model name."""

    actual: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)

    def ratio(self, name: str) -> float | None:
        """Measured over predicted seconds of ``name``'s priced forwards (None when it ran none)."""
        p = self.predicted.get(name, 0.0)
        return self.actual.get(name, 0.0) / p if p > 0 else None


class PaceMeter:
    """Times the forwards of the given models (hooks on those objects only, removed on exit) and prices each with the
    curve: the target's pass of L new tokens at ``cost_model.target_time(L)`` for L up to its longest measured length,
    the draft's step at ``draft_s_per_token``.

    Args:
        models: name ("target" or "draft") -> model object; other names are timed but not priced.
        cost_model: the run's verification curve.
    """

    def __init__(self, models: Mapping[str, nn.Module], cost_model: CostModel) -> None:
        self.models, self.cm = dict(models), cost_model
        self.pace = Pace()
        self._max_len = max(cost_model.target_s)
        self._handles: list[Any] = []
        self._start: dict[str, tuple[float, float]] = {}

    def __enter__(self) -> PaceMeter:
        for name, model in self.models.items():
            self._handles.append(model.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _price(self, name: str, n_new: int) -> float:
        """Curve seconds of a forward of ``n_new`` new tokens (0: not priced)."""
        if name == "target" and 1 <= n_new <= self._max_len:
            return float(self.cm.target_time(n_new))
        if name == "draft" and 1 <= n_new <= DRAFT_STEP_MAX_TOKENS:
            return float(self.cm.draft_s_per_token)
        return 0.0

    def _pre(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            n_new = int(ids.shape[-1]) if ids is not None else 0
            self._start[name] = (time.perf_counter(), self._price(name, n_new))
        return hook

    def _post(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            t0, price = self._start.pop(name, (0.0, 0.0))
            if price > 0:
                self.pace.actual[name] = self.pace.actual.get(name, 0.0) + time.perf_counter() - t0
                self.pace.predicted[name] = self.pace.predicted.get(name, 0.0) + price
        return hook


def normal_pace(paces: Sequence[Pace]) -> dict[str, float]:
    """Per model, the median of the runs' paces (runs without that model's forwards left out)."""
    names = {n for p in paces for n in p.predicted}
    out = {}
    for n in sorted(names):
        ratios = [r for p in paces if (r := p.ratio(n)) is not None]
        if ratios:
            out[n] = statistics.median(ratios)
    return out


def excess(pace: Pace | None, normal: Mapping[str, float]) -> float | None:
    """How much slower a run's priced forwards ran than the normal paces predict for them: measured / (sum over models
    of normal pace x predicted) - 1. None when the run has no priced forward or a model has no normal pace (then it
    cannot be judged: run it again)."""
    if pace is None or not pace.predicted or any(n not in normal for n in pace.predicted):
        return None
    expected = sum(normal[n] * p for n, p in pace.predicted.items())
    return sum(pace.actual.get(n, 0.0) for n in pace.predicted) / expected - 1 if expected > 0 else None
