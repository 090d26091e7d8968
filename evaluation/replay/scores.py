"""A policy's scores over the replay's rows: computed once for every row where the score reads one token, once per
in-round position where it also reads ``position``, or per round (``None``) where the policy decides from more than
the token; plus the columns a policy lacks and a copy of a policy at another threshold."""
from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import Tensor

from evaluation.replay.sequences import ReplayData
from predictors.base import StopPolicy

__all__ = ["missing_columns", "overrides", "policy_scores", "position_score_matrix", "scores_for", "window_features",
           "with_threshold"]


def missing_columns(policy: StopPolicy, available: Iterable[str]) -> list[str]:
    """Columns the policy needs that the data lacks."""
    have = set(available)
    return [c for c in policy.required_columns if c not in have]


def overrides(policy: StopPolicy, name: str) -> bool:
    """The policy's class defines its own ``name`` method (``keep_drafting``: decides from more than one score;
    ``update``: learns online from each round's outcome)."""
    return getattr(type(policy), name) is not getattr(StopPolicy, name)


def _needs_round_features(policy: StopPolicy) -> bool:
    """Scores depend on the in-round position or on earlier tokens of the round: score per round, not once."""
    return "position" in policy.required_columns or overrides(policy, "keep_drafting")


def _position_dependent(policy: StopPolicy) -> bool:
    """The score reads the in-round ``position`` but is otherwise per token: precompute one column per position."""
    return "position" in policy.required_columns and not overrides(policy, "keep_drafting")


def position_score_matrix(policy: StopPolicy, features: Mapping[str, Tensor], width: int) -> np.ndarray:
    """[N, width] ``policy.score`` of every row as if it were drafted at in-round position j = 0..width-1."""
    n = next(iter(features.values())).shape[0]
    out = np.empty((n, width), dtype=np.float64)
    for j in range(width):
        feats = dict(features)
        feats["position"] = torch.full((n,), j, dtype=torch.long)
        out[:, j] = policy_scores(policy, feats)
    return out


def scores_for(policy: StopPolicy, data: ReplayData, max_draft_len: int | None) -> np.ndarray | None:
    """Precomputed scores: [N] for per-token policies, [N, cap] for position-dependent ones, None for the rest."""
    if policy.round_rule.hindsight:
        return None
    if _position_dependent(policy):
        width = int(policy.max_draft_len) if max_draft_len is None else min(int(policy.max_draft_len), max_draft_len)
        return position_score_matrix(policy, data.features, max(width, 1))
    if _needs_round_features(policy):
        return None
    return policy_scores(policy, data.features)


def policy_scores(policy: StopPolicy, features: Mapping[str, Tensor], chunk: int = 16384) -> np.ndarray:
    """[N] ``policy.score`` over all rows, in chunks, as float64 numpy."""
    n = next(iter(features.values())).shape[0]
    out = []
    with torch.no_grad():
        for a in range(0, n, chunk):
            part = {k: v[a : a + chunk] for k, v in features.items()}
            out.append(policy.score(part).detach().float().reshape(-1).cpu().numpy())
    return np.concatenate(out).astype(np.float64) if out else np.zeros(0)


def window_features(features: Mapping[str, Tensor], rows: np.ndarray) -> dict[str, Tensor]:
    """The features of a round's rows (increasing), with ``position`` the in-round draft position."""
    if len(rows) and int(rows[-1]) - int(rows[0]) + 1 == len(rows):  # contiguous: views
        a, b = int(rows[0]), int(rows[-1]) + 1
        w = {k: v[a:b] for k, v in features.items()}
    else:
        idx = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        w = {k: v[idx] for k, v in features.items()}
    w["position"] = torch.arange(len(rows))  # the in-round draft position, as the decoder sees it
    return w


def with_threshold(policy: StopPolicy, threshold: float) -> StopPolicy:
    """A copy of ``policy`` starting at ``threshold`` (online policies restart from it on every reset)."""
    p = copy.deepcopy(policy)
    p.start_at(threshold)
    return p
