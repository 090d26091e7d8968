"""Rows decoding one prompt together, a step at a time (the benchmark's ``interleave``): each row is a :class:`Lane`
(target-only a token a step, an engine row a round a step), and :func:`interleave` always steps the lane with the
fewest new tokens so far, timing each step alone. The rows so move through their outputs side by side, and a slow
phase of a shared host (seconds long, where a step is a tenth of one) falls on every row's tokens alike instead of on
whichever row ran then: their ratios keep the host's noise out.

Usage::

    rows = interleave([target_only_lane(view), engine_lane(view, "adaedl:0.6")], view.target.device)
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from compute.timing import clock

__all__ = ["Lane", "interleave"]

R = TypeVar("R")


@dataclass
class Lane(Generic[R]):
    """One row's decode of a prompt: ``steps`` yields its new tokens so far after each step and returns its result;
    ``finish(result, seconds)`` makes the row (the benchmark's ``Row``, a vLLM unit's run) from the result and the
    steps' summed seconds."""

    name: str
    steps: Generator[int, None, Any]
    finish: Callable[[Any, float], R]


def interleave(lanes: list[Lane[R]], device: torch.device | str) -> dict[str, R]:
    """Every lane to its end, always stepping the one with the fewest new tokens so far (the first in ``lanes`` on a
    tie); each step timed alone, each row's seconds its own steps' sum."""
    seconds = {lane.name: 0.0 for lane in lanes}
    tokens = {lane.name: -1 for lane in lanes}
    rows: dict[str, R] = {}
    live = list(lanes)
    while live:
        lane = min(live, key=lambda x: tokens[x.name])
        t0 = clock(device)
        try:
            tokens[lane.name] = next(lane.steps)
        except StopIteration as end:
            seconds[lane.name] += clock(device) - t0
            rows[lane.name] = lane.finish(end.value, seconds[lane.name])
            live.remove(lane)
            continue
        seconds[lane.name] += clock(device) - t0
    return rows
