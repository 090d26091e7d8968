"""The interface every stop policy implements, trained or training-free.

A policy answers, for a batch of draft-token features (columns of ``data_gen.schema`` as tensors, e.g. the dict returned
by ``data_gen.features.token_features`` plus ``position``), a continue score (higher means the token is more likely
accepted; for learned policies an estimated acceptance probability) and a decision at a threshold. Evaluation
(ROC, replay) and the decoding engine are written once against this interface.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor


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


class StopPolicy:
    """Base class: score draft tokens, continue drafting while ``score >= threshold``, up to ``draft_cap()`` tokens.

    Subclasses set ``kind`` and ``required_columns`` and implement :meth:`score`; online policies override
    :meth:`update` (called once per verification round) and :meth:`reset` (called at the start of each sequence).
    """

    kind: ClassVar[str] = "base"
    required_columns: ClassVar[tuple[str, ...]] = ()
    exact: ClassVar[bool] = True
    """False for policies whose decoding is approximate (SPRINTER's sequential verification)."""

    def __init__(self, threshold: float = 0.5, max_draft_len: int = 40) -> None:
        self.threshold = float(threshold)
        self.max_draft_len = int(max_draft_len)

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        """[N] continue score for N draft tokens."""
        raise NotImplementedError

    def keep_drafting(self, features: Mapping[str, Tensor]) -> Tensor:
        """[N] bool: draft another token after this one."""
        return self.score(features) >= self.threshold

    def draft_cap(self) -> int:
        """Most draft tokens in the next round (static and heuristic policies override)."""
        return self.max_draft_len

    def update(self, feedback: RoundFeedback) -> None:
        """Online adaptation after a verification round; training-free and stateless policies ignore it."""

    def reset(self) -> None:
        """Restore the initial state (a new sequence starts)."""

    def check_columns(self, features: Mapping[str, Tensor]) -> None:
        """Raise KeyError naming the missing columns this policy needs."""
        missing = [c for c in self.required_columns if c not in features]
        if missing:
            raise KeyError(f"{self.kind} needs the columns {missing}; they are missing from the data")


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
