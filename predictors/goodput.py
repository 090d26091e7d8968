"""Speculative Verification's verification length: maximise expected goodput from per-token acceptance estimates.

P(N >= n) = prod_{j <= n} a_j; E[accepted | L] = sum_{n <= L} P(N >= n); each round also emits one target token (the
correction or the bonus), so tokens per round = E[accepted | L] + 1 and goodput(L) = tokens / latency(L).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def expected_accepted(accept_probs: Sequence[float]) -> np.ndarray:
    """[L+1] E[accepted | L] for L = 0..len(accept_probs) under independent per-token acceptance."""
    surv = np.cumprod(np.asarray(accept_probs, dtype=np.float64))
    return np.concatenate([[0.0], np.cumsum(surv)])


def goodput_length(accept_probs: Sequence[float], latency: Callable[[int], float]) -> tuple[int, float]:
    """Verification length L in 0..len(accept_probs) maximising (E[accepted | L] + 1) / latency(L).

    Args:
        accept_probs: estimated acceptance of each drafted token, in draft order.
        latency: seconds of one round that drafts and verifies L tokens (draft steps + one target pass).
    Returns:
        (best L, its goodput in tokens per second).
    """
    exp_acc = expected_accepted(accept_probs)
    goodput = [(exp_acc[n] + 1.0) / max(latency(n), 1e-12) for n in range(len(exp_acc))]
    best = int(np.argmax(goodput))
    return best, float(goodput[best])
