"""The cost-aware stopping rule, in one place: calibrated acceptance + the measured verification curve choose the draft
length. The engine (``decoding.engine``), the offline replay (``evaluation.replay``) and transformers' assisted
generation (``runtimes.transformers.assisted``) all call it; Speculative Verification is this rule with its bin table
as the calibrated predictor.

**Rule.** A round has drafted k tokens whose calibrated acceptances are a_1..a_k. P(first n all accepted) =
P_n = a_1 ... a_n; verifying n of them emits E_n = 1 + P_1 + ... + P_n tokens in expectation (the accepted ones plus
the correction or bonus token). A round that drafts k and verifies n <= k takes k * d + t(n + 1) seconds (d: one draft
step, plus the companion's when the predictor reads it; t(L): one target pass over L new tokens,
``compute.timing.CostModel.target_time``).

- Verify the best prefix: n* = argmax_{n <= k} E_n / (k d + t(n + 1)) (the drafting already done is sunk).
- Keep drafting while the best expected tokens/s over the lengths still reachable, n = k+1 .. cap, beats that of
  stopping now: max_n E^_n / (n d + t(n + 1)) > E_{n*} / (k d + t(n* + 1)), where the acceptances of the tokens not yet
  drafted are forecast by the last one's (a_j = a_k for j > k). A confident draft thus runs to the end of a flat step
  of the curve, an unconfident one stops before a jump.

:func:`keep_drafting` and :func:`best_prefix` are the two decisions; :func:`window_round` runs them over a window of
known acceptances (the replay); :func:`batch_lengths` prices a batch's verification pass (engine, B > 1).

**Policy.** :class:`GoodputPolicy` wraps any stop policy (learned or training-free) and its calibration maps, one per
decoding mode (``predictors.calibration``); its score is the calibrated acceptance for the mode set by
:meth:`GoodputPolicy.use_mode`. :func:`goodput_policy` builds it from an exported predictor and refuses one without a
map, naming the command that fits one.

Usage::

    cost = RoundCost.from_cost_model(cm, companion=False)
    keep_drafting([0.9, 0.8], cost, cap=8)        # draft another?
    best_prefix([0.9, 0.8, 0.2], cost)            # (tokens to verify, expected tokens/s)
    policy = goodput_policy(load_predictor("runs/disco/export"), "runs/disco/export")
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor

from predictors.base import RoundFeedback, StopPolicy
from predictors.calibration import FIT_COMMAND, MODES, Calibrator
from predictors.round_rules import GOODPUT

log = logging.getLogger(__name__)

__all__ = ["RoundCost", "expected_tokens", "best_prefix", "keep_drafting", "window_round", "batch_lengths",
           "GoodputPolicy", "goodput_policy", "calibrations_of", "MissingCalibration", "check_cost_model"]


class MissingCalibration(ValueError):
    """A policy under ``goodput:`` has no calibration map for the decoding mode in use."""


@dataclass
class RoundCost:
    """Seconds of one round: ``per_draft`` per drafted token plus one target pass over the verified tokens + 1."""

    per_draft: float
    """Seconds of one draft step (plus one companion step when the policy reads the companion)."""
    target_time: Callable[[float], float]
    """Seconds of one target forward over L new tokens (L = verified drafts + 1)."""
    _verify: list[float] = field(default_factory=list, repr=False)

    @classmethod
    def from_cost_model(cls, cm: Any, companion: bool = False) -> RoundCost:
        """From a ``compute.timing.CostModel`` (:func:`check_cost_model` first: at least two measured lengths)."""
        check_cost_model(cm)
        return cls(cm.draft_s_per_token + (cm.companion_s_per_token if companion else 0.0), cm.target_time)

    def verify_times(self, cap: int) -> np.ndarray:
        """[cap + 1] t(n + 1) for n = 0..cap verified drafts."""
        return np.asarray(self._verify_list(cap)[: cap + 1])

    def _verify_list(self, cap: int) -> list[float]:
        """The cached t(n + 1) list, at least cap + 1 long (the rule's loops read it without an array)."""
        while len(self._verify) <= cap:
            self._verify.append(float(self.target_time(len(self._verify) + 1)))
        return self._verify

    # The rule's decisions priced by this cost (``predictors.round_rules.RoundPrice``, what the goodput rule calls).
    def can_pay(self, cap: int, ceiling: float = 1.0) -> bool:
        return can_pay(self, cap, ceiling)

    def keep_drafting(self, acc: Sequence[float], cap: int) -> bool:
        return keep_drafting(acc, self, cap)

    def best_length(self, acc: Sequence[float]) -> int:
        return best_prefix(acc, self)[0]

    def window_round(self, acc: Sequence[float], cap: int, ceiling: float = 1.0) -> tuple[int, int]:
        return window_round(acc, self, cap, ceiling)

    def batch_lengths(self, acc: list[list[float]]) -> list[int]:
        """:func:`batch_lengths` with this round's latency: ``m`` drafts' steps plus one pass over m + 1 tokens."""
        return batch_lengths(acc, lambda m: m * self.per_draft + self.target_time(m + 1))


def check_cost_model(cm: Any, draft_name: str = "", target_name: str = "", compute_path: str | None = None,
                     machine: dict | None = None) -> list[str]:
    """Refuse a curve with fewer than two lengths (ValueError); warn (and return) what differs from the run at hand."""
    if len(cm.target_s) < 2:
        raise ValueError(f"the cost model measures the verification curve at L = {sorted(cm.target_s)} only: the "
                         "goodput rule needs at least two lengths (measure it with python -m pipelines.measure_costs)")
    diffs = []
    if draft_name or target_name or machine:
        diffs = cm.mismatch(draft_name, target_name, compute_path, machine)
    for d in diffs:
        log.warning("cost model measured for another run (%s): the goodput rule prices rounds with a foreign curve", d)
    return diffs


def expected_tokens(acc: Sequence[float]) -> np.ndarray:
    """[k + 1] E_n = 1 + sum_{i <= n} prod_{j <= i} a_j for n = 0..k: expected tokens of a round verifying n."""
    surv = np.cumprod(np.clip(np.asarray(acc, dtype=np.float64), 0.0, 1.0))
    return 1.0 + np.concatenate([[0.0], np.cumsum(surv)])


def best_prefix(acc: Sequence[float], cost: RoundCost, drafted: int | None = None) -> tuple[int, float]:
    """(n*, its expected tokens/s): the verification length n <= k maximising E_n / (drafted * d + t(n + 1)) (the
    first of equal rates).

    Args:
        acc: calibrated acceptance of each drafted token, in draft order (k = len(acc)).
        cost: the round's cost.
        drafted: drafting steps paid this round (default k).
    """
    best_n, best, _, _ = _scan(acc, cost, len(acc) if drafted is None else drafted)
    return best_n, best


def _scan(acc: Sequence[float], cost: RoundCost, drafted: int) -> tuple[int, float, float, float]:
    """(n*, its expected tokens/s, E_k, P_k = a_1 ... a_k) of a round that drafted ``acc``, in one pass.

    A loop over Python floats, not arrays: the engine calls the rule once per drafted token right after a draft
    forward, where each numpy call costs tens of microseconds; the values are those of :func:`expected_tokens`
    (the same sequential products and sums).
    """
    k = len(acc)
    verify, paid = cost._verify_list(k), drafted * cost.per_draft
    surv = cum = 0.0
    best_n, best = 0, 1.0 / (paid + verify[0])
    for n in range(1, k + 1):
        a = min(max(float(acc[n - 1]), 0.0), 1.0)
        surv = a if n == 1 else surv * a
        cum += surv
        rate = (1.0 + cum) / (paid + verify[n])
        if rate > best:
            best_n, best = n, rate
    return best_n, best, 1.0 + cum, surv


def can_pay(cost: RoundCost, cap: int, ceiling: float = 1.0) -> bool:
    """Whether any round of at most ``cap`` drafts could beat a target-only step in expectation even if every draft
    scored the highest acceptance the calibration gives (``ceiling``; 1: every draft accepted): some n in 1..cap with
    (1 + c + ... + c^n) / (n d + t(n + 1)) > 1 / t(1). When none can (a draft step dear against a curve that rises
    steeply, as llama.cpp's on a CPU), the rule drafts nothing: not even the first token, whose step would be paid
    before its acceptance is known. The ceiling matters where a round pays only if nearly every draft is accepted."""
    verify, d = cost._verify_list(cap), cost.per_draft
    c = min(max(float(ceiling), 0.0), 1.0)
    expected = 1.0
    for n in range(1, cap + 1):
        expected += c ** n
        if expected / (n * d + verify[n]) > 1.0 / verify[0]:
            return True
    return False


def keep_drafting(acc: Sequence[float], cost: RoundCost, cap: int) -> bool:
    """Draft another token after these k (see the module docstring): a reachable length n in k+1..cap, with the
    not-yet-drafted acceptances forecast by the last one, promises more expected tokens/s than stopping now."""
    k = len(acc)
    if k >= cap:
        return False
    if k == 0:
        return True
    _, now, tokens_k, p_k = _scan(acc, cost, k)
    r = min(max(float(acc[-1]), 0.0), 1.0)
    verify, d = cost._verify_list(cap), cost.per_draft
    ahead = 0.0
    for n in range(k + 1, cap + 1):
        ahead += r ** (n - k)
        if (tokens_k + p_k * ahead) / (n * d + verify[n]) > now:
            return True
    return False


def window_round(acc: Sequence[float], cost: RoundCost, cap: int, ceiling: float = 1.0) -> tuple[int, int]:
    """(drafted, verified) of a round whose tokens' acceptances are known in advance (the replay): draft token by token
    while :func:`keep_drafting`, then verify :func:`best_prefix`. ``acc`` holds at least ``cap`` values (or all
    left); ``ceiling``: the calibration's highest acceptance (:func:`can_pay`)."""
    cap = min(cap, len(acc))
    if not can_pay(cost, cap, ceiling):
        return 0, 0
    n = 0
    while n < cap:
        n += 1
        if not keep_drafting(acc[:n], cost, cap):
            break
    return n, best_prefix(acc[:n], cost)[0] if n else 0


def batch_lengths(acc: list[list[float]], latency: Callable[[int], float]) -> list[int]:
    """Verification lengths across a batch sharing one target pass: the drafted tokens taken in the order of their
    gain in expected accepted length (largest first), the prefix of that order with the best expected tokens /
    latency(total verified). Every prefix is priced, not only up to the first that does not improve: a runtime's pass
    can cost less over more tokens (vLLM's CPU GEMM at 2 rows against 4), so sending more can be the cheaper step.

    Args:
        acc: per sequence, the calibrated acceptance of each drafted token, in order.
        latency: seconds of the round verifying n tokens in all (drafting included).
    Returns:
        per sequence, how many of its drafted tokens to verify.
    """
    n_seq = len(acc)
    lengths = [0] * n_seq
    surv = [1.0] * n_seq  # P(all verified tokens so far accepted), per sequence
    expected = float(n_seq)  # each sequence emits one target token
    best, best_lengths = expected / max(latency(0), 1e-12), list(lengths)
    while True:
        gains = [(surv[b] * acc[b][lengths[b]], b) for b in range(n_seq) if lengths[b] < len(acc[b])]
        if not gains:
            return best_lengths
        gain, b = max(gains)
        expected += gain
        surv[b] *= acc[b][lengths[b]]
        lengths[b] += 1
        rate = expected / max(latency(sum(lengths)), 1e-12)
        if rate > best:
            best, best_lengths = rate, list(lengths)


FORGET = 0.9
"""The weight a round's acceptance counts keep at the next round (:attr:`GoodputPolicy.acceptance_ceiling`): the
estimate follows about the last ten rounds, and drifts back to the prior while rounds draft nothing."""


class GoodputPolicy(StopPolicy):
    """Any stop policy made cost-aware: its score through the calibration map of the decoding mode is the acceptance
    the goodput rule prices (``round_rule`` :data:`predictors.round_rules.GOODPUT`).

    Args:
        inner: the wrapped policy (learned or training-free); its ``score`` is the raw score.
        calibrations: decoding mode -> map (at least one of ``predictors.calibration.MODES``).
        source: where it came from (export folder, registry URI or score name), for messages and labels.
    """

    kind = "goodput"
    round_rule = GOODPUT
    has_threshold = False

    def __init__(self, inner: StopPolicy, calibrations: Mapping[str, Calibrator], source: str = "") -> None:
        super().__init__(threshold=0.0, max_draft_len=inner.max_draft_len)
        if not calibrations:
            raise MissingCalibration(_missing_message(source or inner.kind, "any mode"))
        bad = [m for m in calibrations if m not in MODES]
        if bad:
            raise ValueError(f"calibration modes {bad}: use {MODES}")
        self.inner, self.calibrations, self.source = inner, dict(calibrations), source or inner.kind
        self.kind = f"goodput-{inner.kind}"  # type: ignore[misc]  # instance-level, per wrapped policy
        self.required_columns = tuple(inner.required_columns)  # type: ignore[misc]
        self.mode = "greedy" if "greedy" in self.calibrations else next(iter(self.calibrations))
        self._accepted, self._tried = 0, 0

    @property
    def calibrator(self) -> Calibrator:
        return self.calibrations[self.mode]

    def use_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"decoding mode {mode!r}: use one of {MODES}")
        if mode not in self.calibrations:
            raise MissingCalibration(_missing_message(self.source, mode))
        self.mode = mode

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return self.calibrator(self.inner.score(features))

    @property
    def acceptance_ceiling(self) -> float:
        """What :func:`can_pay` prices a round's drafts with, before the first one is drafted and scored: the
        acceptance a draft has shown in this sequence's recent rounds (accepted over tried, a token tried until the
        first rejection, each round's counts weighing :data:`FORGET` of the next one's), under a uniform prior (one
        accepted and one rejected: 1/2 before any round), at most the calibration's highest value. The first draft
        step of a round is paid before its acceptance is known: where a round pays only when nearly every draft is
        accepted, it would be paid every round and lost; where rounds pay, they pay at this acceptance too. Rounds
        that draft nothing add no evidence and let the estimate return towards the prior, so a run of rejections does
        not stop drafting for the rest of the sequence."""
        seen = (self._accepted + 1.0) / (self._tried + 2.0)
        return min(self.calibrator.ceiling, seen)

    def update(self, feedback: RoundFeedback) -> None:
        """Count the round's drafts tried (up to the first rejection) and accepted, the earlier rounds' counts
        weighed down by :data:`FORGET`."""
        self._accepted = FORGET * self._accepted + feedback.n_accepted
        self._tried = FORGET * self._tried + min(feedback.n_accepted + 1, feedback.n_drafted)

    def score_list(self, features: Mapping[str, Tensor]) -> list[float]:
        cal = self.calibrator
        return [cal.apply_one(v) for v in self.inner.score(features).tolist()]

    def reset(self) -> None:
        self.inner.reset()
        self._accepted, self._tried = 0, 0


def _missing_message(source: str, mode: str) -> str:
    return (f"goodput:{source} has no calibration map for {mode} decoding (the cost-aware rule needs calibrated "
            f"acceptance); fit one on the validation split with: {FIT_COMMAND.format(ref=source)}")


def calibrations_of(meta: Mapping[str, Any] | None) -> dict[str, Calibrator]:
    """The maps stored in an export's ``predictor.json`` (``calibration``: mode -> map)."""
    stored = (meta or {}).get("calibration") or {}
    return {mode: Calibrator.from_dict(d) for mode, d in stored.items() if d}


def goodput_policy(policy: StopPolicy, source: str) -> GoodputPolicy:
    """``policy`` (loaded from an export: its ``metadata`` holds the maps) under the goodput rule; MissingCalibration
    naming ``source`` and the fitting command when the export has no map."""
    return GoodputPolicy(policy, calibrations_of(policy.metadata), source)
