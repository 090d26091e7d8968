"""How a round's drafted tokens become the tokens the target verifies: one rule object per kind of verification.

A policy supplies its rule (``StopPolicy.round_rule``); the engine (``decoding.engine``), the offline replay
(``evaluation.replay``) and the runtimes' hooks (``decoding.draft_steps``, transformers, llama.cpp, vLLM) ask it,
so no caller tests a policy's kind. After each drafted candidate :meth:`RoundRule.decide` says whether to draft
another (and keeps the candidate's score where the rule reads it later); :meth:`RoundRule.takes` whether the
candidate joins the round; when drafting ends :meth:`RoundRule.sent` how many drafted tokens go to the target.
:meth:`RoundRule.replay_round` runs the same rule over a window of known scores (the replay).

The rules (``name`` is what rows and records store):

- ``threshold`` (:data:`THRESHOLD`): draft while ``score >= threshold``; every drafted token is verified exactly.
- ``sequential`` (:data:`SEQUENTIAL`, SPRINTER): drafted as ``threshold``; the tokens before the last are taken
  unverified and the target checks the last one (approximate).
- ``goodput`` (:data:`GOODPUT`, SV, ``goodput:<spec>``): the score is a calibrated acceptance; draft while the
  expected tokens/s of the lengths still reachable improves and verify the best prefix, priced by a measured curve
  (the :class:`RoundPrice` of ``predictors.goodput.RoundCost``).
- ``prefix`` (:class:`PrefixRule`, llama.cpp's draft-simple): a candidate scoring below the threshold ends the round
  and is dropped (its draft step is paid); a round of fewer than ``minimum`` tokens sends nothing.
- ``hindsight`` (:data:`HINDSIGHT`, the oracles): the length is read from the target's answer; analysis only.

Usage::

    rule = policy.round_rule
    keep, scores = rule.decide(policy, feats, kept_scores, caps, active, cost)   # per drafted position, [B] rows
    n_sent = rule.sent(policy, scores, n_drafted, cost)                           # at the round's end
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
from torch import Tensor

__all__ = ["RoundRule", "RoundPrice", "ThresholdRule", "SequentialRule", "GoodputRule", "PrefixRule",
           "HindsightRule", "THRESHOLD", "SEQUENTIAL", "GOODPUT", "HINDSIGHT", "PREFIX", "rule_named",
           "drafted_length"]


class RoundPrice(Protocol):
    """The goodput rule's prices for one round (``predictors.goodput.RoundCost``): its two decisions and their uses."""

    def can_pay(self, cap: int, ceiling: float) -> bool: ...

    def keep_drafting(self, acc: Sequence[float], cap: int) -> bool: ...

    def best_length(self, acc: Sequence[float]) -> int: ...

    def window_round(self, acc: Sequence[float], cap: int, ceiling: float) -> tuple[int, int]: ...

    def batch_lengths(self, acc: list[list[float]]) -> list[int]: ...


def drafted_length(keep: Sequence[bool]) -> int:
    """Tokens a round drafts given the stop decision after each candidate token (``keep[j]``: draft another after
    token j): up to and including the first False, else all of them."""
    for j, k in enumerate(keep):
        if not k:
            return j + 1
    return len(keep)


Features = Mapping[str, Tensor]


@dataclass(frozen=True)
class RoundRule:
    """The ``threshold`` rule, and the questions every rule answers (subclasses change the answers)."""

    name: ClassVar[str] = "threshold"
    exact: ClassVar[bool] = True
    """Every sent token is verified exactly (False: sequential verification takes all but the last unverified)."""
    cost_aware: ClassVar[bool] = False
    """Scores are calibrated acceptances priced by a measured verification curve (the rule needs a cost model)."""
    hindsight: ClassVar[bool] = False
    """Reads the target's answer for each drafted token (the oracles): analysis only."""
    sends_all: ClassVar[bool] = True
    """Every drafted token goes to the target (False: a prefix of them, chosen at the round's end)."""
    drops_candidate: ClassVar[bool] = False
    """The candidate that ends the round is not taken (its draft step is paid)."""

    @property
    def sequential(self) -> bool:
        """The drafts before the last are taken unverified (SPRINTER)."""
        return not self.exact

    @property
    def needs_cost_model(self) -> bool:
        """A run must hand it a measured verification curve (its :class:`RoundPrice`)."""
        return self.cost_aware

    @property
    def runs_in_hook(self) -> bool:
        """A runtime hook can run it: the runtime verifies every sent token exactly and has no target look-ahead."""
        return self.exact and not self.hindsight

    def tunable(self, policy: Any) -> bool:
        """A threshold sweep can tune the policy's decisions (a thresholded, not cost-aware, not hindsight rule)."""
        return bool(policy.has_threshold) and not self.cost_aware and not self.hindsight

    def affordable(self, policy: Any, cap: int, cost: RoundPrice | None) -> int:
        """The round's cap, or 0 when no round of at most ``cap`` drafts could pay (cost-aware rules only)."""
        return cap

    def decide(self, policy: Any, feats: Features, kept: Sequence[Sequence[float]], caps: Sequence[int],
               active: Sequence[bool], cost: RoundPrice | None, scored: list[float] | None = None
               ) -> tuple[list[bool], list[float] | None]:
        """After one drafted position of B rows: [B] draft another, and [B] the candidates' scores where the rule
        keeps them for its end of round (else None). ``kept``: each row's scores kept so far this round;
        ``scored``: the candidates' scores when the caller has them already (else the policy is asked)."""
        if scored is not None:
            return [s >= policy.threshold for s in scored], None
        return policy.keep_drafting(feats).tolist(), None

    def takes(self, keep: bool) -> bool:
        """Whether the candidate whose decision was ``keep`` joins the round."""
        return keep or not self.drops_candidate

    def sent(self, policy: Any, scores: Sequence[float], drafted: int, cost: RoundPrice | None) -> int:
        """How many of one sequence's ``drafted`` tokens (kept ``scores``) the target verifies."""
        return drafted

    def sent_batch(self, policy: Any, scores: Sequence[Sequence[float]], drafted: Sequence[int],
                   live: Sequence[bool], cost: RoundPrice | None) -> list[int]:
        """:meth:`sent` for every sequence of a batch that shares one target pass (``live``: still decoding)."""
        return [self.sent(policy, s, n, cost) for s, n in zip(scores, drafted)]

    def replay_round(self, policy: Any, scores: np.ndarray | None, features: Callable[[], Features],
                     cost: RoundPrice | None) -> tuple[int, int]:
        """(drafted, sent) of a round over a window of candidates known in advance (the replay): ``scores`` their
        scores in draft order, or None to ask the policy on ``features()``; at least one candidate."""
        keep = policy.keep_drafting(features()).cpu().numpy().astype(bool) if scores is None else \
            scores >= policy.threshold
        n = drafted_length(keep)
        return n, n


ThresholdRule = RoundRule


@dataclass(frozen=True)
class SequentialRule(RoundRule):
    """SPRINTER's sequential verification: drafted as ``threshold``, verified approximately."""

    name: ClassVar[str] = "sequential"
    exact: ClassVar[bool] = False


@dataclass(frozen=True)
class HindsightRule(RoundRule):
    """The oracles: the round's length comes from the target's answer (``greedy_match``), analysis only."""

    name: ClassVar[str] = "hindsight"
    hindsight: ClassVar[bool] = True


@dataclass(frozen=True)
class GoodputRule(RoundRule):
    """The cost-aware rule (``predictors.goodput``): calibrated acceptance priced by the measured curve."""

    name: ClassVar[str] = "goodput"
    cost_aware: ClassVar[bool] = True
    sends_all: ClassVar[bool] = False

    def affordable(self, policy: Any, cap: int, cost: RoundPrice | None) -> int:
        assert cost is not None
        return cap if cost.can_pay(cap, policy.acceptance_ceiling) else 0

    def decide(self, policy: Any, feats: Features, kept: Sequence[Sequence[float]], caps: Sequence[int],
               active: Sequence[bool], cost: RoundPrice | None, scored: list[float] | None = None
               ) -> tuple[list[bool], list[float] | None]:
        assert cost is not None
        sc = policy.score_list(feats) if scored is None else scored
        keep = [bool(active[b]) and cost.keep_drafting([*kept[b], float(sc[b])], caps[b]) for b in range(len(sc))]
        return keep, sc

    def sent(self, policy: Any, scores: Sequence[float], drafted: int, cost: RoundPrice | None) -> int:
        assert cost is not None
        return cost.best_length(scores) if drafted else 0

    def sent_batch(self, policy: Any, scores: Sequence[Sequence[float]], drafted: Sequence[int],
                   live: Sequence[bool], cost: RoundPrice | None) -> list[int]:
        assert cost is not None
        if len(scores) == 1:
            return [cost.best_length(scores[0])]
        return cost.batch_lengths([list(s) if ok else [] for s, ok in zip(scores, live)])

    def replay_round(self, policy: Any, scores: np.ndarray | None, features: Callable[[], Features],
                     cost: RoundPrice | None) -> tuple[int, int]:
        assert cost is not None
        est = scores if scores is not None else policy.score(features()).numpy()
        acc = np.clip(np.asarray(est, dtype=np.float64), 0.0, 1.0)
        return cost.window_round(acc, len(acc), policy.acceptance_ceiling)


@dataclass(frozen=True)
class PrefixRule(RoundRule):
    """llama.cpp's draft-simple rule: tokens are sent while their own score is ``>= threshold``; the step that scored
    the first one below it is paid and its token dropped; a round of fewer than ``minimum`` sends nothing."""

    name: ClassVar[str] = "prefix"
    sends_all: ClassVar[bool] = False
    drops_candidate: ClassVar[bool] = True
    minimum: int = 0
    """Fewest tokens a round sends (llama.cpp's ``--spec-draft-n-min``)."""

    def steps_and_sent(self, threshold: float, scores: Sequence[float]) -> tuple[int, int]:
        """(draft steps paid, tokens sent) of a round whose candidates score ``scores`` in draft order (capped)."""
        steps, sent = len(scores), len(scores)
        for j, s in enumerate(scores):
            if s < threshold:
                steps, sent = j + 1, j
                break
        return steps, sent if sent >= self.minimum else 0

    def decide(self, policy: Any, feats: Features, kept: Sequence[Sequence[float]], caps: Sequence[int],
               active: Sequence[bool], cost: RoundPrice | None, scored: list[float] | None = None
               ) -> tuple[list[bool], list[float] | None]:
        sc = policy.score_list(feats) if scored is None else scored
        return [s >= policy.threshold for s in sc], sc

    def sent(self, policy: Any, scores: Sequence[float], drafted: int, cost: RoundPrice | None) -> int:
        return self.steps_and_sent(policy.threshold, scores[:drafted])[1]

    def replay_round(self, policy: Any, scores: np.ndarray | None, features: Callable[[], Features],
                     cost: RoundPrice | None) -> tuple[int, int]:
        sc = scores if scores is not None else policy.score(features()).numpy()
        return self.steps_and_sent(policy.threshold, np.asarray(sc, dtype=np.float64).tolist())


THRESHOLD = RoundRule()
SEQUENTIAL = SequentialRule()
GOODPUT = GoodputRule()
HINDSIGHT = HindsightRule()
PREFIX = PrefixRule()
_BY_NAME: dict[str, RoundRule] = {r.name: r for r in (THRESHOLD, SEQUENTIAL, GOODPUT, HINDSIGHT, PREFIX)}


def rule_named(name: str | None) -> RoundRule:
    """The rule a stored row's ``verification`` names; a row naming none (a runtime's own verification) verifies every
    sent token exactly, as ``threshold``. ValueError naming the known names for any other name."""
    if not name:
        return THRESHOLD
    if name not in _BY_NAME:
        raise ValueError(f"verification {name!r}: use one of {', '.join(_BY_NAME)}")
    return _BY_NAME[name]
