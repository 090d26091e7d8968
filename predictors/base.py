"""The interface every stop policy implements, trained or training-free.

A policy answers, for a batch of draft-token features (columns of ``data_gen.schema`` as tensors, e.g. the dict returned
by ``data_gen.features.token_features`` plus ``position``), a continue score (higher means the token is more likely
accepted; for learned policies an estimated acceptance probability) and a decision at a threshold. Evaluation
(ROC, replay) and the decoding engine are written once against this interface.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor

from data_gen.features import COMPANION_COLUMNS, TARGET_COLUMNS
from predictors.round_rules import THRESHOLD, RoundRule


@dataclass
class RoundFeedback:
    """What the decoder learned after one verification round (used by online policies)."""

    n_drafted: int
    """Draft tokens sent to verification this round."""
    n_accepted: int
    """How many of them the target accepted."""
    draft_probs: list[float] = field(default_factory=list)
    """q(x) of each drafted token (for transformers' online ROC re-tuning)."""
    accepted: list[bool] = field(default_factory=list)
    """Per drafted token: accepted (or greedy match) or not; positions after the first rejection are False."""

    @classmethod
    def leading(cls, n_drafted: int, n_accepted: int, draft_probs: list[float]) -> RoundFeedback:
        """Feedback of a round whose first ``n_accepted`` drafted tokens were accepted (the replay's rounds)."""
        return cls(n_drafted, n_accepted, draft_probs, [j < n_accepted for j in range(n_drafted)])


class StopPolicy:
    """Base class: score draft tokens, continue drafting while ``score >= threshold``, up to ``draft_cap()`` tokens.

    Subclasses set ``kind`` and ``required_columns`` and implement :meth:`score`; online policies override
    :meth:`update` (called once per verification round) and :meth:`reset` (called at the start of each sequence).
    A policy says what it is, so that the engine, the replay and the evaluation never test its kind by name: its
    ``round_rule`` (``predictors.round_rules``: which drafted tokens go to verification), ``has_threshold``, and the
    properties :attr:`exact`, :attr:`needs_companion`, :attr:`needs_target` and :attr:`tunable`. The optional
    capabilities are declared here with their defaults (``fixed_length``, ``online_roc``, ``drafts_failing_token``,
    ``train_info``, ``metadata``, :attr:`vector_columns`, :attr:`start_threshold`), so callers read them directly.
    """

    kind: ClassVar[str] = "base"
    required_columns: ClassVar[tuple[str, ...]] = ()
    round_rule: ClassVar[RoundRule] = THRESHOLD
    """How a round is drafted and verified (``predictors.round_rules``)."""
    has_threshold: ClassVar[bool] = True
    """The decision is ``score >= threshold`` (False for static lengths, the +2/-1 heuristic and the oracles)."""
    threshold: float = math.nan
    """The decision's threshold (nan for a policy without one)."""
    fixed_length: ClassVar[bool] = False
    """A round's length is its cap alone (``static:K``, vLLM's K): a hook computes no feature for it."""
    online_roc: bool = False
    """The threshold is re-tuned online from the ROC of the rounds seen (transformers' rule): no sweep tunes it."""
    drafts_failing_token: bool = False
    """An oracle also drafts the first mismatching token, as the engine must (the replay check sets it)."""
    train_info: Mapping[str, Any] = MappingProxyType({})
    """A learned policy's training record (label, metrics, config, checkpoint); empty for the others."""
    metadata: Mapping[str, Any] = MappingProxyType({})
    """The export's ``predictor.json`` fields of a policy loaded from one (calibration maps included); else empty."""

    @property
    def verification(self) -> str:
        """The round rule's name, as rows and records store it."""
        return self.round_rule.name

    @property
    def exact(self) -> bool:
        """False when decoding with this policy is approximate (SPRINTER's sequential verification)."""
        return self.round_rule.exact

    @property
    def needs_companion(self) -> bool:
        """Reads the companion model's signals (SV, learned predictors given companion inputs)."""
        return any(c in COMPANION_COLUMNS for c in self.required_columns)

    @property
    def needs_target(self) -> bool:
        """Reads the target's answer for the drafted token (the oracles): analysis only."""
        return any(c in TARGET_COLUMNS for c in self.required_columns)

    @property
    def acceptance_ceiling(self) -> float:
        """The acceptance the goodput rule prices a round's drafts with before the first is drafted
        (``predictors.goodput.can_pay``): certainty here; a cost-aware policy's estimate in ``GoodputPolicy``."""
        return 1.0

    @property
    def tunable(self) -> bool:
        """A threshold a sweep can tune: thresholded, not SV's goodput rule, not re-tuned online by the policy
        itself."""
        return self.round_rule.tunable(self) and not self.online_roc

    @property
    def vector_columns(self) -> Mapping[str, int]:
        """Input column -> width of the vector-valued columns the policy reads (a learned policy's feature spec)."""
        return {}

    @property
    def start_threshold(self) -> float:
        """The threshold each sequence starts from (an online policy moves its threshold during a sequence)."""
        return self.threshold

    def start_at(self, threshold: float) -> None:
        """Set the threshold each sequence starts from (online policies restart from it on every reset)."""
        self.threshold = float(threshold)

    def __init__(self, threshold: float = 0.5, max_draft_len: int = 40) -> None:
        self.threshold = float(threshold)
        self.max_draft_len = int(max_draft_len)

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        """[N] continue score for N draft tokens."""
        raise NotImplementedError

    def score_list(self, features: Mapping[str, Tensor]) -> list[float]:
        """:meth:`score` as Python floats (the engine's per-token decisions; cost-aware policies override it to
        calibrate without array calls)."""
        return self.score(features).tolist()

    def keep_drafting(self, features: Mapping[str, Tensor]) -> Tensor:
        """[N] bool: draft another token after this one."""
        return self.score(features) >= self.threshold

    def draft_cap(self) -> int:
        """Most draft tokens in the next round (static and heuristic policies override)."""
        return self.max_draft_len

    def round_cap(self, *limits: int | None) -> int:
        """Most tokens the next round may draft: ``draft_cap()`` under the given limits (None: no limit), >= 0.
        The engine and the replay both cap their rounds with it."""
        return max(0, min([int(self.draft_cap()), *(int(x) for x in limits if x is not None)]))

    def use_mode(self, mode: str) -> None:
        """Decoding mode of the coming rounds, ``greedy`` or ``sampling`` (the engine, the replay and transformers'
        integration call it); cost-aware policies pick their calibration map, the others ignore it."""

    def update(self, feedback: RoundFeedback) -> None:
        """Online adaptation after a verification round; training-free and stateless policies ignore it."""

    def reset(self) -> None:
        """Restore the initial state (a new sequence starts)."""


def as_tensor_dict(columns: Mapping[str, object]) -> dict[str, Tensor]:
    """Convert a mapping of column -> list / numpy array into float or long tensors (what policies take)."""
    out: dict[str, Tensor] = {}
    for k, v in columns.items():
        if isinstance(v, Tensor):
            out[k] = v
            continue
        try:
            out[k] = torch.as_tensor(v)
        except (TypeError, ValueError):
            continue  # strings (sample ids, origins) are not policy inputs
    return out
