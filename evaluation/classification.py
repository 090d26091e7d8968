"""How well each policy's score separates accepted from rejected draft tokens, per label family.

For every scorer (the training-free scores and any policy passed in) and label (greedy match, q/p <= lambda, min(1,
p/q)): ROC AUC, PR-AUC, F1 at the policy's own and its F1-optimal threshold, bootstrap intervals over prompts, a
breakdown per origin and domain, the best static length's F1 (DISCO's comparison) and SPRINTER's theorems on the data.
Soft labels and the formulas: docs/methods.md.

Usage: ``table = score_table(columns, {"disco": policy}, n_boot=200)``
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import auc as sk_auc
from sklearn.metrics import average_precision_score, f1_score, precision_recall_curve, roc_auc_score, roc_curve
from torch import Tensor

from evaluation.replay.scores import policy_scores
from evaluation.replay.sequences import ReplayConfig, ReplayData, prepare_replay_data
from predictors.base import StopPolicy, as_tensor_dict
from predictors.baselines import SVIP, AdaEDL, DraftProb, MaxConfidence
from predictors.labels import derive_label, label_name

__all__ = [
    "DEFAULT_LABEL_SPECS",
    "FREE_SCORES",
    "NegEntropy",
    "DraftProb",
    "builtin_scorers",
    "weighted_auc",
    "weighted_ap",
    "label_auc",
    "f1_at",
    "f1_optimal",
    "score_table",
    "static_f1",
    "sprinter_table",
    "sprinter_expected_tokens",
    "roc_points",
]

DEFAULT_LABEL_SPECS: tuple[tuple[str, float], ...] = (
    ("greedy", 1.0),
    ("ratio", 1.0),
    ("ratio", 1.2),
    ("ratio", 1.5),
    ("soft", 1.0),
)


FREE_SCORES = {"max-prob": "draft_max_prob", "draft-prob": "q", "neg-entropy": "draft_entropy"}
"""The training-free scores a learned predictor is compared with, by name, and the record column each reads."""


class NegEntropy(StopPolicy):
    """Score -H(q): the plain entropy signal; it has no threshold of its own (NaN)."""

    kind = "neg_entropy"
    required_columns = ("draft_entropy",)

    def __init__(self, threshold: float = float("nan"), max_draft_len: int = 40) -> None:
        super().__init__(threshold, max_draft_len)

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return -features["draft_entropy"].float()


def builtin_scorers() -> dict[str, StopPolicy]:
    """The training-free score columns, as policies at their published thresholds."""
    return {
        "neg-entropy": NegEntropy(),
        "svip": SVIP(h=0.3, gamma=0.15),
        "adaedl-bound": AdaEDL(lam=0.6, gamma=0.2, online=False),
        "max-prob": MaxConfidence(threshold=0.4),
        "draft-prob": DraftProb(threshold=0.4),
    }


# ----------------------------------------------------------------------------------------- weighted metrics (fast)


def score_levels(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ascending unique score levels, level index of each row)."""
    return np.unique(scores, return_inverse=True)


def _auc_from_levels(P: np.ndarray, N: np.ndarray) -> float:
    tp, tn = P.sum(), N.sum()
    if tp <= 0 or tn <= 0:
        return float("nan")
    below = np.cumsum(N) - N
    return float((P * (below + 0.5 * N)).sum() / (tp * tn))


def _ap_from_levels(P: np.ndarray, N: np.ndarray) -> float:
    P, N = P[::-1], N[::-1]
    tp, fp = np.cumsum(P), np.cumsum(N)
    if not len(tp) or tp[-1] <= 0:
        return float("nan")
    denom = tp + fp
    prec = np.divide(tp, denom, out=np.zeros_like(tp), where=denom > 0)
    return float((P / tp[-1] * prec).sum())


def weighted_auc(inv: np.ndarray, n_levels: int, wp: np.ndarray, wn: np.ndarray) -> float:
    """ROC AUC with positive weights ``wp`` and negative weights ``wn`` per row, ties counting one half; ``inv`` is each
    row's ascending score level. NaN when a class has no weight."""
    return _auc_from_levels(np.bincount(inv, wp, n_levels), np.bincount(inv, wn, n_levels))


def weighted_ap(inv: np.ndarray, n_levels: int, wp: np.ndarray, wn: np.ndarray) -> float:
    """Average precision (recall gain x precision over descending thresholds), as sklearn; NaN without positives."""
    return _ap_from_levels(np.bincount(inv, wp, n_levels), np.bincount(inv, wn, n_levels))


def f1_at(pred: np.ndarray, wp: np.ndarray, wn: np.ndarray) -> float:
    """Weighted F1 of boolean predictions; NaN without positives."""
    tp = float((wp * pred).sum())
    fp = float((wn * pred).sum())
    fn = float((wp * ~pred).sum())
    if tp + fn <= 0:
        return float("nan")
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn > 0 else float("nan")


def f1_optimal(levels: np.ndarray, inv: np.ndarray, wp: np.ndarray, wn: np.ndarray) -> tuple[float, float]:
    """(best F1 over thresholds "score >= level", that level); NaN without positives."""
    n = len(levels)
    P = np.bincount(inv, wp, n)[::-1]
    N = np.bincount(inv, wn, n)[::-1]
    tp, fp = np.cumsum(P), np.cumsum(N)
    total = tp[-1] if n else 0.0
    if total <= 0:
        return float("nan"), float("nan")
    f1 = 2 * tp / (tp + fp + total)
    i = int(np.argmax(f1))
    return float(f1[i]), float(levels[::-1][i])


def _weighted_rows(scores: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scores, 0/1 labels, weights) with a soft-labelled row counted as a positive (weight y) and a negative (1 - y),
    rows of weight 0 left out."""
    s2 = np.concatenate([scores, scores])
    y2 = np.concatenate([np.ones_like(y), np.zeros_like(y)])
    w2 = np.concatenate([y, 1.0 - y])
    keep = w2 > 0
    return s2[keep], y2[keep], w2[keep]


def label_auc(scores: np.ndarray, y: np.ndarray) -> float:
    """ROC AUC of ``scores`` against labels ``y`` in [0, 1] (soft ones weighted), by scikit-learn: the headline AUC of
    :func:`score_table`, which a stored main job's test AUCs are recomputed with; NaN with one class."""
    s2, y2, w2 = _weighted_rows(scores, y)
    if not ((y2 == 1).any() and (y2 == 0).any()):
        return float("nan")
    return float(roc_auc_score(y2, s2, sample_weight=w2))


def _sk_metrics(scores: np.ndarray, y: np.ndarray, threshold: float) -> dict[str, float]:
    """Point estimates with scikit-learn, a soft-labelled row counted as a positive (weight a) and a negative (1 - a).
    """
    s2, y2, w2 = _weighted_rows(scores, y)
    out = {k: float("nan") for k in ("auc", "pr_auc", "f1_own", "f1_opt", "thr_f1_opt")}
    has_pos = (y2 == 1).any()
    out["auc"] = label_auc(scores, y)
    if has_pos:
        out["pr_auc"] = float(average_precision_score(y2, s2, sample_weight=w2))
        prec, rec, thr = precision_recall_curve(y2, s2, sample_weight=w2)
        with np.errstate(invalid="ignore", divide="ignore"):
            f1 = np.where(prec + rec > 0, 2 * prec * rec / (prec + rec), 0.0)[:-1]
        i = int(np.nanargmax(f1))
        out["f1_opt"], out["thr_f1_opt"] = float(f1[i]), float(thr[i])
        if np.isfinite(threshold):
            out["f1_own"] = float(f1_score(y2, s2 >= threshold, sample_weight=w2, zero_division=0.0))
    return out


def _class_reason(y: np.ndarray) -> str:
    pos, neg = float(y.sum()), float((1 - y).sum())
    if pos <= 0 and neg <= 0:
        return "no tokens"
    if pos <= 0:
        return f"one class only: no accepted tokens among {len(y)} (AUC undefined)"
    if neg <= 0:
        return f"one class only: every one of {len(y)} tokens accepted (AUC undefined)"
    return ""


# ------------------------------------------------------------------------------------------------------------ scores


def _policy_scores(policy: StopPolicy, feats: Mapping[str, Tensor], chunk: int = 16384) -> np.ndarray:
    n = next(iter(feats.values())).shape[0]
    parts = []
    with torch.no_grad():
        for a in range(0, n, chunk):
            scores = policy.score({k: v[a : a + chunk] for k, v in feats.items()})
            parts.append(scores.detach().float().reshape(-1).numpy())
    return np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)


def _group_codes(columns: Mapping[str, Any], n: int) -> np.ndarray:
    for key in ("sample_id", "seq_id"):
        if key in columns:
            return np.unique(np.asarray(columns[key]).astype(str), return_inverse=True)[1]
    return np.arange(n)


def static_f1(
    columns: Mapping[str, Any], family: str, lam: float = 1.0, max_k: int = 40
) -> tuple[int, float, np.ndarray]:
    """DISCO's static-length F1 (length k predicts accept where ``position < k``): (best k, its F1, [max_k] F1 per k);
    (0, NaN, ...) without positions or positives."""
    if "position" not in columns:
        return 0, float("nan"), np.full(max_k, np.nan)
    y = derive_label(columns, family, lam).astype(np.float64)
    pos = np.asarray(columns["position"], dtype=np.int64)
    f1s = np.array([f1_at(pos < k, y, 1.0 - y) for k in range(1, max_k + 1)])
    if np.all(np.isnan(f1s)):
        return 0, float("nan"), f1s
    i = int(np.nanargmax(f1s))
    return i + 1, float(f1s[i]), f1s


def score_table(
    columns: Mapping[str, np.ndarray],
    policies: Mapping[str, StopPolicy | None],
    label_specs: Sequence[tuple[str, float]] = DEFAULT_LABEL_SPECS,
    n_boot: int = 200,
    seed: int = 0,
    *,
    builtins: bool = True,
    breakdown: Sequence[str] = ("origin", "domain"),
    ci: float = 0.95,
    scores_into: dict[str, np.ndarray] | None = None,
) -> pd.DataFrame:
    """Classification metrics of every scorer against every label family, on ``columns`` already cut to one split.

    Args:
        policies: name -> policy scored with ``policy.score`` (None: a row saying it was not loaded).
        label_specs: (family, lambda) pairs for ``predictors.labels.derive_label``.
        n_boot, seed, ci: bootstrap resamples of prompts (0: no intervals), their seed and confidence level.
        builtins: add the training-free scorers first.
        breakdown: columns to break the metrics down by (rows with ``group_by`` set to that column, no intervals).
        scores_into: filled with each scorer's per-row scores, those it has (the records a stored main job's test
            AUCs are recomputed from).
    Returns:
        a long frame, one row per (group_by, group, policy, label), columns :data:`SCORE_TABLE_COLUMNS`
        (``reason`` says why a metric is NaN); ``group_by == "all"`` holds the headline rows.
    """
    n = len(np.asarray(next(iter(columns.values()))))
    scorers: dict[str, StopPolicy | None] = {}
    if builtins:
        scorers.update(builtin_scorers())
    scorers.update(policies)
    feats = as_tensor_dict(columns) if n else {}
    data = _TableData.of(columns, n, label_specs, n_boot, seed, ci, breakdown)
    rows: list[dict[str, Any]] = []
    for name, pol in scorers.items():
        base = {"policy": name, "kind": pol.kind if pol is not None else "",  # None: a policy that did not load
                "threshold": float(pol.threshold) if pol is not None else np.nan}
        scores, reason = _scores_or_reason(pol, columns, feats, n)
        if scores_into is not None and scores is not None:
            scores_into[name] = scores
        levels, inv = score_levels(scores) if scores is not None else (None, None)
        for spec in label_specs:
            fam, lam = spec
            lab = {"label": label_name(fam, lam), "family": fam, "lam": lam}
            row: dict[str, Any] = {"group_by": "all", "group": "all", **base, **lab, "n": n}
            if spec in data.label_reason or scores is None:
                rows.append({**row, "reason": data.label_reason.get(spec, reason)})
                continue
            rows.append(_headline_row(row, data, spec, scores, levels, inv))
            rows += _breakdown_rows(data, {**base, **lab}, data.labels[spec], scores, levels, inv)
    return _ordered(pd.DataFrame(rows))


SCORE_TABLE_COLUMNS = (
    "group_by", "group", "policy", "kind", "label", "family", "lam", "n", "pos_rate", "auc", "auc_lo", "auc_hi",
    "pr_auc", "pr_auc_lo", "pr_auc_hi", "threshold", "f1_own", "f1_own_lo", "f1_own_hi", "f1_opt", "thr_f1_opt",
    "static_best_k", "f1_static_best", "f1_gain_vs_static", "f1_own_vs_static", "reason",
)
"""The columns of :func:`score_table`, in order."""


@dataclass
class _TableData:
    """What every scorer of :func:`score_table` is measured against: labels, prompt groups and their paired bootstrap
    resamples, static-length baselines, breakdown columns."""

    columns: Mapping[str, np.ndarray]
    groups: np.ndarray
    """Prompt (``sample_id``) index of each row."""
    boot_counts: list[np.ndarray]
    """[n_boot] per-prompt multiplicities, shared by every scorer and label (paired resamples)."""
    labels: dict[tuple[str, float], np.ndarray]
    label_reason: dict[tuple[str, float], str]
    """Why a label could not be derived (its columns are missing)."""
    statics: dict[tuple[str, float], tuple[int, float, np.ndarray]]
    quantiles: tuple[float, float]
    """Percentiles of the interval's ends."""
    breakdown: Sequence[str]

    @classmethod
    def of(cls, columns: Mapping[str, np.ndarray], n: int, label_specs: Sequence[tuple[str, float]], n_boot: int,
           seed: int, ci: float, breakdown: Sequence[str]) -> _TableData:
        groups = _group_codes(columns, n)
        n_groups = int(groups.max()) + 1 if n else 0
        rng = np.random.default_rng(seed)
        boot_counts = [np.bincount(rng.integers(0, n_groups, n_groups), minlength=n_groups).astype(np.float64)
                       for _ in range(n_boot)] if n_groups else []
        labels: dict[tuple[str, float], np.ndarray] = {}
        label_reason: dict[tuple[str, float], str] = {}
        for fam, lam in label_specs:
            try:
                labels[(fam, lam)] = derive_label(columns, fam, lam).astype(np.float64)
            except KeyError as e:
                label_reason[(fam, lam)] = f"label columns missing: {e}"
        statics = {spec: static_f1(columns, *spec) for spec in labels}
        quantiles = (100 * (1 - ci) / 2, 100 * (1 + ci) / 2)
        return cls(columns, groups, boot_counts, labels, label_reason, statics, quantiles, breakdown)


def _scores_or_reason(pol: StopPolicy | None, columns: Mapping[str, Any], feats: Mapping[str, Tensor],
                      n: int) -> tuple[np.ndarray | None, str]:
    """(the policy's finite scores of every row, "") or (None, why it has none)."""
    if pol is None:
        return None, "policy not loaded"
    miss = [c for c in pol.required_columns if c not in columns]
    if miss:
        return None, f"missing columns {miss}"
    if n == 0:
        return None, "no tokens"
    scores, reason = None, ""
    try:
        scores = _policy_scores(pol, feats)
    except KeyError as e:
        reason = f"missing columns: {e}"
    if scores is not None and not np.all(np.isfinite(scores)):
        reason, scores = f"{int((~np.isfinite(scores)).sum())} non-finite scores", None
    return scores, reason


def _headline_row(row: dict[str, Any], data: _TableData, spec: tuple[str, float], scores: np.ndarray,
                  levels: np.ndarray, inv: np.ndarray) -> dict[str, Any]:
    """``row`` completed with the metrics of ``scores`` on label ``spec`` over all rows, the static comparison and
    intervals."""
    y = data.labels[spec]
    thr = row["threshold"]
    row.update(pos_rate=float(y.mean()), reason=_class_reason(y))
    row.update(_sk_metrics(scores, y, thr))
    k, f1s, _ = data.statics[spec]
    row.update(static_best_k=k, f1_static_best=f1s, f1_gain_vs_static=row["f1_opt"] - f1s,
               f1_own_vs_static=row["f1_own"] - f1s)
    if data.boot_counts:
        row.update(_bootstrap_intervals(data, y, scores, levels, inv, thr))
    return row


def _bootstrap_intervals(data: _TableData, y: np.ndarray, scores: np.ndarray, levels: np.ndarray, inv: np.ndarray,
                         thr: float) -> dict[str, float]:
    """``<metric>_lo`` / ``<metric>_hi`` of AUC, PR-AUC and F1 at the own threshold over the prompt resamples."""
    pred = scores >= thr if np.isfinite(thr) else None
    bs: dict[str, list[float]] = {"auc": [], "pr_auc": [], "f1_own": []}
    for counts in data.boot_counts:
        w = counts[data.groups]
        wp, wn = w * y, w - w * y
        P = np.bincount(inv, wp, len(levels))
        N = np.bincount(inv, wn, len(levels))
        bs["auc"].append(_auc_from_levels(P, N))
        bs["pr_auc"].append(_ap_from_levels(P, N))
        bs["f1_own"].append(f1_at(pred, wp, wn) if pred is not None else np.nan)
    out: dict[str, float] = {}
    lo_q, hi_q = data.quantiles
    for m, vals in bs.items():
        v = np.asarray(vals, dtype=np.float64)
        v = v[np.isfinite(v)]
        out[f"{m}_lo"] = float(np.percentile(v, lo_q)) if v.size else float("nan")
        out[f"{m}_hi"] = float(np.percentile(v, hi_q)) if v.size else float("nan")
    return out


def _breakdown_rows(data: _TableData, base: dict[str, Any], y: np.ndarray, scores: np.ndarray, levels: np.ndarray,
                    inv: np.ndarray) -> list[dict[str, Any]]:
    """One row per value of each breakdown column: n, positive rate, AUC, PR-AUC and F1 at the own threshold."""
    thr = base["threshold"]
    rows = []
    for col in data.breakdown:
        if col not in data.columns:
            continue
        vals = np.asarray(data.columns[col]).astype(str)
        for g in np.unique(vals):
            m = (vals == g).astype(np.float64)
            wp, wn = m * y, m * (1.0 - y)
            sub_y = y[m > 0]
            rows.append({
                "group_by": col, "group": g, **base, "n": int(m.sum()),
                "pos_rate": float(sub_y.mean()),
                "auc": weighted_auc(inv, len(levels), wp, wn),
                "pr_auc": weighted_ap(inv, len(levels), wp, wn),
                "f1_own": f1_at(scores >= thr, wp, wn) if np.isfinite(thr) else float("nan"),
                "reason": _class_reason(sub_y),
            })
    return rows


def _ordered(df: pd.DataFrame) -> pd.DataFrame:
    """The frame with every :data:`SCORE_TABLE_COLUMNS` column (missing ones empty), in that order, then any other."""
    order = list(SCORE_TABLE_COLUMNS)
    for c in order:
        if c not in df.columns:
            df[c] = np.nan if c != "reason" else ""
    df["reason"] = df["reason"].fillna("")
    return df[order + [c for c in df.columns if c not in order]]


def roc_points(
    columns: Mapping[str, np.ndarray],
    policies: Mapping[str, StopPolicy | None],
    family: str = "greedy",
    lam: float = 1.0,
    builtins: bool = True,
) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """name -> (fpr, tpr, auc) by sklearn's roc_curve (soft labels weighted as in :func:`score_table`); scorers without
    scores or with one-class labels left out."""
    y = derive_label(columns, family, lam).astype(np.float64)
    if _class_reason(y):
        return {}
    feats = as_tensor_dict(columns)
    scorers: dict[str, StopPolicy | None] = {**(builtin_scorers() if builtins else {}), **policies}
    out = {}
    for name, pol in scorers.items():
        if pol is None or any(c not in columns for c in pol.required_columns):
            continue
        s = _policy_scores(pol, feats)
        if not np.all(np.isfinite(s)):
            continue
        s2 = np.concatenate([s, s])
        y2 = np.concatenate([np.ones_like(y), np.zeros_like(y)])
        w2 = np.concatenate([y, 1 - y])
        keep = w2 > 0
        fpr, tpr, _ = roc_curve(y2[keep], s2[keep], sample_weight=w2[keep])
        out[name] = (fpr, tpr, float(sk_auc(fpr, tpr)))
    return out


# ---------------------------------------------------------------------------------------------------------- SPRINTER


def sprinter_expected_tokens(tpr: float, fpr: float, r: int | np.ndarray) -> np.ndarray:
    """SPRINTER's Theorem 2: expected tokens before a target call when the first r are acceptable, sum_{i=1..r} tpr^i +
    tpr^r * fpr / (1 - fpr)."""
    r = np.asarray(r, dtype=np.float64)
    if tpr >= 1.0:
        head = r
    else:
        head = (tpr - tpr ** (r + 1)) / (1.0 - tpr)
    tail = np.inf if fpr >= 1.0 else fpr / (1.0 - fpr)
    return head + tpr**r * tail


def _leading_run(mask: np.ndarray) -> int:
    stop = np.flatnonzero(~mask)
    return int(stop[0]) if stop.size else int(mask.size)


def sprinter_table(
    columns: Mapping[str, np.ndarray],
    policies: Mapping[str, StopPolicy | None],
    lams: Sequence[float] = (1.0, 1.2, 1.5),
    builtins: bool = True,
    max_draft_len: int = 40,
) -> pd.DataFrame:
    """SPRINTER's theory checked on the data, one row per (policy at its threshold, lambda): TPR, FPR, Theorem 1's TV
    bound and acceptance, Theorem 2's expected tokens against rounds replayed along the draft's rollouts (censored
    rounds left out)."""
    scorers: dict[str, StopPolicy | None] = {**(builtin_scorers() if builtins else {}), **policies}
    cols = dict(columns)
    if "rollout" in cols and np.asarray(cols["rollout"], dtype=bool).any():
        m = np.asarray(cols["rollout"], dtype=bool)
        cols = {k: np.asarray(v)[m] for k, v in cols.items()}
        seq_note = "draft rollouts"
    else:
        seq_note = "all sequences (no rollout column or no rollouts)"
    rows = []
    try:
        data = prepare_replay_data(cols, ReplayConfig(origins=None, teacher_forced_only=False))
    except (KeyError, ValueError) as e:
        return pd.DataFrame([{"policy": n, "reason": str(e)} for n in scorers])
    sorted_cols = {k: v.numpy() for k, v in data.features.items()}
    for name, pol in scorers.items():
        base = {"policy": name, "threshold": float(pol.threshold) if pol is not None else np.nan,
                "sequences": seq_note}
        if pol is None:
            rows += [{**base, "lam": lam, "reason": "policy not loaded"} for lam in lams]
            continue
        miss = [c for c in pol.required_columns if c not in data.features]
        if miss or not np.isfinite(base["threshold"]) or not pol.has_threshold:
            why = f"missing columns {miss}" if miss else "no score threshold"
            rows += [{**base, "lam": lam, "reason": why} for lam in lams]
            continue
        keep = policy_scores(pol, data.features) >= pol.threshold
        for lam in lams:
            y = derive_label(sorted_cols, "ratio", lam).astype(bool)
            rows.append({**base, "lam": lam, **_sprinter_row(data, sorted_cols, keep, y, max_draft_len)})
    return pd.DataFrame(rows)


def _sprinter_row(data: ReplayData, sorted_cols: Mapping[str, np.ndarray], keep: np.ndarray, y: np.ndarray,
                  max_draft_len: int) -> dict[str, Any]:
    """One policy's rates at one lambda, Theorem 1's bound and Theorem 2's expected tokens against the replayed rounds.
    """
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    tpr = float(keep[y].mean()) if n_pos else float("nan")
    fpr = float(keep[~y].mean()) if n_neg else float("nan")
    mean_tv = float(np.mean(sorted_cols["tv"])) if "tv" in sorted_cols else float("nan")
    row: dict[str, Any] = dict(
        tpr=tpr, fpr=fpr, mean_tv=mean_tv, tv_bound=fpr * mean_tv, accept_rate_thm1=1 - (1 - fpr) * mean_tv
    )
    ns, rs, cens, n_rounds = _replayed_rounds(data, keep, y, max_draft_len)
    row.update(rounds=n_rounds, censored_rounds=cens)
    if ns and np.isfinite(tpr) and np.isfinite(fpr):
        row.update(
            mean_r=float(np.mean(rs)),
            e_tokens_theorem2=float(np.mean(sprinter_expected_tokens(tpr, fpr, np.asarray(rs)))),
            e_tokens_replayed=float(np.mean(ns)),
            reason="",
        )
    else:
        row["reason"] = "one class only or every round censored"
    return row


def _replayed_rounds(data: ReplayData, keep: np.ndarray, y: np.ndarray,
                     max_draft_len: int) -> tuple[list[int], list[int], int, int]:
    """SPRINTER-style rounds along every sequence: (N of each uncensored round, its r, censored rounds, rounds)."""
    ns, rs, cens, n_rounds = [], [], 0, 0
    for a, b in zip(data.starts.tolist(), data.ends.tolist()):
        s = a
        while s < b:
            cap = min(max_draft_len, b - s)
            n_tok = _leading_run(keep[s : s + cap])
            r = _leading_run(y[s:b])
            n_rounds += 1
            if (n_tok == b - s) or (r == b - s):
                cens += 1
            else:
                ns.append(n_tok)
                rs.append(r)
            s += n_tok + 1
    return ns, rs, cens, n_rounds
