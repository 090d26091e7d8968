"""The hindsight bounds of the replay: the schedule oracle (``OracleSchedule``, a dynamic programme over each greedy
sequence for the fastest rounds under the cost model) and the sampling oracle's expected round (draft until the
first rejection)."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from torch import Tensor

from compute.timing import CostModel
from predictors.base import HINDSIGHT, StopPolicy

__all__ = ["OracleSchedule", "oracle_schedule", "sampling_oracle"]


class OracleSchedule(StopPolicy):
    """Cost-optimal hindsight schedule (greedy replay): the fastest way to emit each stored sequence under the cost
    model."""

    kind = "oracle_schedule"
    required_columns = ("greedy_match",)
    verification = HINDSIGHT
    has_threshold = False

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["greedy_match"].float()


def oracle_schedule(run: np.ndarray, a0: int, b0: int, cap: int, per_draft: float, cm: CostModel) -> dict[int, int]:
    """round start -> tokens to draft, minimising the time to emit rows [a0, b0) (greedy; draft only acceptable
    tokens)."""
    T = np.array([cm.target_time(k + 1) for k in range(cap + 1)])  # verification of k drafts + 1
    best = np.zeros(b0 - a0 + 1)
    choice = np.zeros(b0 - a0, dtype=np.int64)
    for s in range(b0 - 1, a0 - 1, -1):
        i = s - a0
        m = min(int(run[s]), cap, b0 - s)
        ns = np.arange(m + 1)
        nxt = np.minimum(i + ns + 1, b0 - a0)
        cost = ns * per_draft + T[ns] + best[nxt]
        j = int(np.argmin(cost))
        best[i], choice[i] = cost[j], j
    out, s = {}, a0
    while s < b0:
        out[s] = int(choice[s - a0])
        s += out[s] + 1
    return out


def sampling_oracle(acc: np.ndarray, cm: CostModel, companion: bool) -> tuple[float, float, float]:
    """Expected (accepted, drafted, seconds) of drafting exactly until the first rejection (capped at len(acc))."""
    surv = np.cumprod(acc)  # P(A >= k), k = 1..n
    n = len(acc)
    p_eq = np.append(1.0 - acc[0], surv[:-1] * (1.0 - acc[1:])) if n else np.zeros(0)  # P(A = k), k = 0..n-1
    probs = np.append(p_eq, surv[-1]) if n else np.array([1.0])  # k = 0..n
    ks = np.arange(n + 1)
    times = np.array([cm.round_time(int(k), companion=companion) for k in ks])
    return float(surv.sum()), float((probs * ks).sum()), float((probs * times).sum())
