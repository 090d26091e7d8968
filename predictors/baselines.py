"""Training-free stop policies: static length, HF heuristic, max-confidence, q(x), SVIP, AdaEDL, and the oracle.

Formulas: ../shared/PAPERS.md. Each is a :class:`predictors.base.StopPolicy`; the online ones adapt in :meth:`update`.
They are built by name through ``predictors.policy_names``.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from predictors.base import RoundFeedback, StopPolicy
from predictors.round_rules import HINDSIGHT


def entropy_bound(features: Mapping[str, Tensor], gamma: float) -> Tensor:
    """1 - sqrt(gamma * H(q)): the entropy lower bound on acceptance (SVIP, AdaEDL)."""
    return 1.0 - torch.sqrt(gamma * features["draft_entropy"].float().clamp_min(0.0))


class StaticLength(StopPolicy):
    """Always draft exactly ``k`` tokens (the SL-k baselines; ``k`` = 0: never draft, the target alone through a
    speculative engine)."""

    kind = "static"
    has_threshold = False
    fixed_length = True
    required_columns = ()

    def __init__(self, k: int = 5, max_draft_len: int = 40) -> None:
        super().__init__(threshold=0.0, max_draft_len=max_draft_len)
        self.k = int(k)

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        n = next(iter(features.values())).shape[0] if features else 1
        return torch.ones(n)

    def draft_cap(self) -> int:
        return min(self.k, self.max_draft_len)


class HFHeuristic(StopPolicy):
    """transformers' ``num_assistant_tokens_schedule='heuristic'`` / DISCO's dynHeur: +2 when all accepted, else -1."""

    kind = "heuristic"
    has_threshold = False

    def __init__(self, initial: int = 5, max_draft_len: int = 40) -> None:
        super().__init__(threshold=0.0, max_draft_len=max_draft_len)
        self.initial = int(initial)
        self.k = self.initial

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        n = next(iter(features.values())).shape[0] if features else 1
        return torch.ones(n)

    def draft_cap(self) -> int:
        return min(self.k, self.max_draft_len)

    def update(self, feedback: RoundFeedback) -> None:
        if feedback.n_drafted > 0 and feedback.n_accepted == feedback.n_drafted:
            self.k += 2
        else:
            self.k = max(1, self.k - 1)

    def reset(self) -> None:
        self.k = self.initial


class OnlineThreshold(StopPolicy):
    """A thresholded policy that moves its threshold during a sequence: every sequence starts again at ``initial``
    (``start_at`` sets it), forgetting what the updates learned (:meth:`_forget`)."""

    def __init__(self, threshold: float, max_draft_len: int) -> None:
        super().__init__(threshold, max_draft_len)
        self.initial = float(threshold)

    @property
    def start_threshold(self) -> float:
        return self.initial

    def start_at(self, threshold: float) -> None:
        self.threshold = self.initial = float(threshold)

    def reset(self) -> None:
        self.threshold = self.initial
        self._forget()

    def _forget(self) -> None:
        """Drop the online state beyond the threshold (a new sequence starts)."""


class MaxConfidence(OnlineThreshold):
    """Stop when the top-1 draft probability falls below the threshold (AdaEDL's Max-Confidence baseline,
    transformers' ``assistant_confidence_threshold``).

    With ``online_roc=True`` the threshold is re-tuned as transformers does
    (``AssistedCandidateGenerator.update_candidate_strategy``): over all (drafted-token probability, accepted) pairs
    seen,
    ``sklearn.metrics.roc_curve`` and the threshold minimising fpr + 3 * fnr.
    """

    kind = "max_confidence"
    required_columns = ("draft_max_prob",)

    def __init__(self, threshold: float = 0.4, max_draft_len: int = 40, online_roc: bool = False) -> None:
        super().__init__(threshold, max_draft_len)
        self.online_roc = online_roc
        self._probs: list[float] = []
        self._matches: list[bool] = []

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["draft_max_prob"].float()

    def update(self, feedback: RoundFeedback) -> None:
        if not self.online_roc or not feedback.draft_probs:
            return
        from sklearn.metrics import roc_curve  # heavy; only online ROC re-tuning needs it, not decoding

        self._probs.extend(feedback.draft_probs)
        self._matches.extend(feedback.accepted[: len(feedback.draft_probs)])
        if len(set(self._matches)) == 2:
            fpr, tpr, thresholds = roc_curve(np.array(self._matches), np.array(self._probs))
            cost = fpr + 3 * (1 - tpr)
            best = int(np.argmin(cost))
            self.threshold = float(min(thresholds[best], 1.0))

    def _forget(self) -> None:
        self._probs.clear()
        self._matches.clear()


class DraftProb(StopPolicy):
    """Score q(x), the drafted token's own probability: what transformers' ``assistant_confidence_threshold`` compares
    (the top-1 probability on greedy draws; on sampled draws it tells a likely token from an unlikely one)."""

    kind = "draft_prob"
    required_columns = ("q",)

    def __init__(self, threshold: float = 0.4, max_draft_len: int = 40) -> None:
        super().__init__(threshold, max_draft_len)

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["q"].float()


class SVIP(StopPolicy):
    """SVIP: stop once sqrt(gamma * H(q)) > h. Score 1 - sqrt(gamma H), threshold 1 - h (same decision).

    The reference code uses gamma = 0.15, h = 0.3; the paper tunes h in {0.2, 0.3, 0.4, 0.5}; max draft length 40.
    """

    kind = "svip"
    required_columns = ("draft_entropy",)

    def __init__(self, h: float = 0.3, gamma: float = 0.15, max_draft_len: int = 40) -> None:
        super().__init__(threshold=1.0 - h, max_draft_len=max_draft_len)
        self.gamma = gamma

    @property
    def h(self) -> float:
        return 1.0 - self.threshold

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return entropy_bound(features, self.gamma)


class AdaEDL(OnlineThreshold):
    """AdaEDL: stop when 1 - sqrt(gamma * H(q)) < lambda, lambda updated online by Algorithm 1 of the paper."""

    kind = "adaedl"
    required_columns = ("draft_entropy",)

    def __init__(
        self,
        lam: float = 0.6,
        gamma: float = 0.2,
        max_draft_len: int = 40,
        online: bool = True,
        beta1: float = 0.5,
        beta2: float = 0.9,
        eps: float = 0.01,
        alpha: float = 0.9,
    ) -> None:
        super().__init__(lam, max_draft_len)
        self.gamma, self.online = gamma, online
        self.beta1, self.beta2, self.eps, self.alpha = beta1, beta2, eps, alpha
        self.acceptance_rate: float | None = None

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return entropy_bound(features, self.gamma)

    def update(self, feedback: RoundFeedback) -> None:
        if not self.online or feedback.n_drafted == 0:
            return
        ar_i = feedback.n_accepted / feedback.n_drafted
        ar = ar_i if self.acceptance_rate is None else self.beta1 * self.acceptance_rate + (1 - self.beta1) * ar_i
        self.acceptance_rate = ar
        lam = self.threshold
        if ar < self.alpha:
            new = lam + self.eps
        elif feedback.n_accepted != self.max_draft_len:
            new = lam - self.eps
        else:
            new = lam
        self.threshold = self.beta2 * lam + (1 - self.beta2) * new

    def _forget(self) -> None:
        self.acceptance_rate = None


class Oracle(StopPolicy):
    """Draft exactly until the first target mismatch (known in hindsight): the upper bound, for analysis only.

    The offline replay drafts the acceptable run (DISCO's definition). The engine cannot stop before a token it has
    not drafted: it stops on the first mismatch, which it drafts and verifies like any policy's stopping token;
    ``drafts_failing_token`` makes the replay do the same (the replay check compares the two)."""

    kind = "oracle"
    round_rule = HINDSIGHT
    has_threshold = False
    required_columns = ("greedy_match",)
    drafts_failing_token: bool = False

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["greedy_match"].float()


ENTROPY_KINDS = ("svip", "adaedl")
"""Policies the learned ones must beat: the training-free entropy bounds (the benchmark's and the rendered tables'
``vs best entropy`` column)."""
