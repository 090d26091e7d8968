"""The cost-aware rule for a batch that shares its draft forwards and one verification pass (vLLM's draft loop).

A step of B requests pays one draft forward per drafted position for the whole batch (``d_B``) and one target pass
verifying each request's sent tokens + 1 (``T_B(L)``, L new tokens a request; a batch sending n tokens in all costs
``T_B(1 + n / B)``). Where the runtime runs the draft's first forward whatever is drafted (vLLM keeps the draft's cache
in step with it), that forward is paid by a step that drafts nothing too, so the first drafted token of each request
costs only its verification (``BatchCost.first_forward_paid``).

After each drafted position, with every request's calibrated acceptances so far:

- :func:`send_lengths`: what each request sends (the drafting done is paid): greedily the token with the largest
  expected gain while the batch's expected tokens/s improves (``predictors.goodput.batch_lengths``);
- :func:`worth_drafting`: a request drafts on while its next token, forecast at its last acceptance, adds more
  expected tokens per second of verification than the batch's rate now;
- :func:`batch_keep_drafting`: the batch runs another draft forward while some m more forwards over the requests
  still drafting promise a higher batch rate than stopping now (the not-yet-drafted acceptances forecast by each
  request's last, as the one-request rule does);
- :func:`after_position`: both decisions after a drafted position, as vLLM's proposer and the trace simulation
  (``benchmarks/simulate_batch_rule.py``) take them;
- :class:`RecentShare`: a request's acceptance before its round drafts (the forecast whether a step drafts at all).

Usage::

    cost = BatchCost.from_cost_model(curve_at_batch_4, batch=4)
    batch_keep_drafting([[0.9, 0.8], [0.4], [], [0.95]], [True, False, False, True], cost, cap=8)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from compute.timing import SKIP_STEP
from predictors.goodput import batch_lengths, check_cost_model

__all__ = ["BatchCost", "send_lengths", "batch_rate", "worth_drafting", "batch_keep_drafting", "after_position",
           "expected_batch_tokens", "RecentShare"]


@dataclass
class BatchCost:
    """Seconds of one batched step: ``draft_s`` per draft forward, ``target_time(L)`` per target pass of L new tokens
    a request, at ``batch`` requests."""

    draft_s: float
    target_time: Callable[[float], float]
    batch: int
    first_forward_paid: bool = True
    """The runtime runs the draft's first forward even when nothing is drafted (vLLM); False where a step that drafts
    nothing skips it."""
    skip_s: float | None = None
    """A step that drafts nothing and skips the draft's forward, timed in the speculative engine itself (the curve's
    ``extra["skip_s"]``); None: priced as ``target_time(1)``."""

    @classmethod
    def from_cost_model(cls, cm: Any, batch: int, first_forward_paid: bool = True) -> BatchCost:
        """From the ``compute.timing.CostModel`` measured at ``batch`` requests (its skipped step, where it holds one
        and the step skips the draft)."""
        check_cost_model(cm)
        skip = None if first_forward_paid else (getattr(cm, "extra", None) or {}).get(SKIP_STEP)
        return cls(float(cm.draft_s_per_token), cm.target_time, max(1, int(batch)), first_forward_paid,
                   None if skip is None else float(skip))

    def scaled(self, draft: float, verify: float, extra_draft_s: float = 0.0) -> BatchCost:
        """This step with its draft forwards ``draft`` times and its verifications ``verify`` times as dear, plus
        ``extra_draft_s`` a forward (what scoring a position adds); a skipped step scales with the verifications."""
        target_time = self.target_time
        return replace(self, draft_s=self.draft_s * draft + extra_draft_s,
                       target_time=lambda n: verify * target_time(n),
                       skip_s=None if self.skip_s is None else verify * self.skip_s)

    def verify_s(self, sent: float) -> float:
        """One target pass verifying ``sent`` drafted tokens over the batch (each request's + 1)."""
        return float(self.target_time(1.0 + sent / self.batch))

    def step_s(self, forwards: int, sent: float) -> float:
        """One step that ran ``forwards`` draft forwards and verifies ``sent`` tokens."""
        if forwards == 0 and not sent and not self.first_forward_paid and self.skip_s is not None:
            return self.skip_s
        paid = max(forwards, 1) if self.first_forward_paid else forwards
        return paid * self.draft_s + self.verify_s(sent)


@dataclass
class RecentShare:
    """A request's recent acceptance: its rounds' accepted and tried tokens (up to the first rejection), older rounds
    weighing 0.9 each round; before a round drafts, its forecast adds two pseudo-tokens at ``prior``."""

    accepted: float = 0.0
    tried: float = 0.0

    def seen(self, accepted: int, sent: int) -> None:
        """A verified round: ``sent`` tokens, the first ``accepted`` of them accepted."""
        self.accepted = 0.9 * self.accepted + accepted
        self.tried = 0.9 * self.tried + min(accepted + 1, sent)

    def forecast(self, prior: float) -> float:
        return (self.accepted + 2.0 * prior) / (self.tried + 2.0)


def expected_batch_tokens(acc: Sequence[Sequence[float]], lengths: Sequence[int]) -> float:
    """Expected tokens the step emits: per request 1 + P_1 + ... + P_n for its ``n`` sent tokens."""
    total = 0.0
    for a, n in zip(acc, lengths):
        surv, total = 1.0, total + 1.0
        for x in a[:n]:
            surv *= min(max(float(x), 0.0), 1.0)
            total += surv
    return total


def _survival(a: Sequence[float]) -> float:
    surv = 1.0
    for x in a:
        surv *= min(max(float(x), 0.0), 1.0)
    return surv


def send_lengths(acc: Sequence[Sequence[float]], cost: BatchCost, forwards: int) -> list[int]:
    """Per request, how many of its drafted tokens to send, the ``forwards`` already run being paid."""
    return batch_lengths([list(a) for a in acc], lambda n: cost.step_s(forwards, n))


def batch_rate(acc: Sequence[Sequence[float]], cost: BatchCost, forwards: int) -> tuple[float, list[int]]:
    """(expected tokens/s of stopping now, what each request then sends): the rate both decisions compare with."""
    lengths = send_lengths(acc, cost, forwards)
    return expected_batch_tokens(acc, lengths) / cost.step_s(forwards, sum(lengths)), lengths


def worth_drafting(acc: Sequence[Sequence[float]], cost: BatchCost, forwards: int,
                   now: tuple[float, list[int]] | None = None) -> list[bool]:
    """Per request: does its next token, forecast at its last acceptance, add more expected tokens per second of its
    verification than the batch's rate now (``now``: :func:`batch_rate`'s answer, when the caller has it)? The shared
    draft forward is priced by :func:`batch_keep_drafting`."""
    rate, lengths = now or batch_rate(acc, cost, forwards)
    sent = sum(lengths)
    per_token = max(cost.verify_s(sent + 1) - cost.verify_s(sent), 1e-12)
    out = []
    for a in acc:
        gain = _survival(a) * (min(max(float(a[-1]), 0.0), 1.0) if a else 1.0)
        out.append(gain / per_token > rate)
    return out


def batch_keep_drafting(acc: Sequence[Sequence[float]], drafting: Sequence[bool], cost: BatchCost, cap: int,
                        forecast: Sequence[float] | None = None, now: tuple[float, list[int]] | None = None) -> bool:
    """Run another draft forward for the batch? ``acc``: per request, its drafted tokens' calibrated acceptances;
    ``drafting``: the requests that would draft in it (their own rule says go on); ``cap``: most positions a round;
    ``forecast``: per request, the acceptance its tokens are forecast at before it has drafted any (default 1).
    Compares the best rate of m = 1..cap - j more forwards (those requests sending all they draft, the others their
    best prefix) with the rate of stopping now. Before the first forward (every ``acc`` empty) this is whether the
    step should draft at all, where a step that drafts nothing skips the draft's forward. ``now``: as for
    :func:`worth_drafting`."""
    forwards = max((len(a) for a in acc), default=0)
    if forwards >= cap or not any(drafting):
        return False
    now, lengths = now or batch_rate(acc, cost, forwards)
    base_tokens, base_sent, lead, ratios = 0.0, 0, [], []
    for i, (a, go, n) in enumerate(zip(acc, drafting, lengths)):
        if go:
            base_tokens += expected_batch_tokens([a], [len(a)])
            base_sent += len(a)
            lead.append(_survival(a))
            ratios.append(min(max(float(a[-1] if a else (forecast[i] if forecast else 1.0)), 0.0), 1.0))
        else:
            base_tokens += expected_batch_tokens([a], [n])
            base_sent += n
    ahead = [0.0] * len(lead)
    for m in range(1, cap - forwards + 1):
        gain = 0.0
        for i, r in enumerate(ratios):
            ahead[i] += r ** m
            gain += lead[i] * ahead[i]
        if (base_tokens + gain) / cost.step_s(forwards + m, base_sent + m * len(lead)) > now:
            return True
    return False


def after_position(acc: Sequence[Sequence[float]], drafting: Sequence[bool], cost: BatchCost, cap: int,
                   cost_aware: bool) -> tuple[list[bool], bool]:
    """After a drafted position: which requests draft on (``drafting``: those whose own rule goes on; for a goodput
    policy, ``cost_aware``, only those whose next token pays its verification, :func:`worth_drafting`) and whether the
    batch runs another draft forward for them (:func:`batch_keep_drafting`)."""
    drafting = list(drafting)
    if not any(drafting):
        return drafting, False
    forwards = max((len(a) for a in acc), default=0)
    now = batch_rate(acc, cost, forwards)
    if cost_aware:
        drafting = [d and w for d, w in zip(drafting, worth_drafting(acc, cost, forwards, now))]
    return drafting, any(drafting) and batch_keep_drafting(acc, drafting, cost, cap, now=now)
