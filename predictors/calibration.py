"""Calibrated acceptance: a monotone map from a policy's score to the probability that the drafted token is accepted, in
the decoding mode's sense (``greedy``: greedy match on argmax draws; ``sampling``: min(1, p/q) on sampled draws).

Maps are isotonic or Platt, ``auto`` picking the lower cross-validated Brier score (isotonic overfits a few hundred
tokens, Platt underfits a curved score), and stored as plain JSON in ``predictor.json`` so an export loads them with
numpy alone. The goodput rule reads them; the evaluation reports their ECE.

Usage::

    cal = fit_calibrator(val_scores, val_labels)               # method="auto": isotonic or Platt by CV
    expected_calibration_error(cal(test_scores), test_labels)  # 0.012
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["MODES", "METHODS", "FIT_METHODS", "Calibrator", "fit_calibrator", "expected_calibration_error",
           "ece_noise_floor", "reliability_bins", "calibration_rows", "calibration_label", "mode_of", "FIT_COMMAND"]

MODES = ("greedy", "sampling")
"""Decoding modes: greedy decoding (temperature 0) and exact speculative sampling."""
METHODS = ("isotonic", "platt")
"""Stored map kinds; ``fit_calibrator`` also takes ``auto`` (chosen by cross-validation)."""
FIT_METHODS = (*METHODS, "auto")
FIT_COMMAND = "python -m pipelines.calibrate --data_dir DATA_DIR --predictor {ref}"
"""The command that fits the maps of an existing export (or a named training-free score) and stores them."""


def mode_of(temperature: float) -> str:
    """The decoding mode of a sampling temperature (0: greedy)."""
    return "greedy" if temperature == 0 else "sampling"


@dataclass
class Calibrator:
    """A monotone map score -> acceptance in [0, 1]: ``isotonic`` piecewise linear through its breakpoints (clipped
    outside), or ``platt`` sigmoid(a * score + b)."""

    method: str
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    a: float = 1.0
    b: float = 0.0
    n_fit: int = 0
    """Tokens the map was fitted on."""
    label: str = ""
    """What it calibrates (greedy match, min(1,p/q))."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"calibration method {self.method!r}: use one of {METHODS}")
        if self.method == "isotonic" and (len(self.x) < 1 or len(self.x) != len(self.y)):
            raise ValueError("an isotonic calibration needs matching, non-empty breakpoints x and y")
        self._x = np.asarray(self.x, dtype=np.float64)
        self._y = np.asarray(self.y, dtype=np.float64)

    def apply(self, scores: np.ndarray) -> np.ndarray:
        """[N] calibrated acceptance of [N] raw scores (float64)."""
        s = np.asarray(scores, dtype=np.float64)
        if self.method == "platt":
            return 1.0 / (1.0 + np.exp(-(self.a * s + self.b)))
        return np.clip(np.interp(s, self._x, self._y), 0.0, 1.0)

    @property
    def ceiling(self) -> float:
        """The highest acceptance the map gives any score: an isotonic map's top breakpoint; a sigmoid's supremum, 1."""
        return 1.0 if self.method == "platt" else min(max(float(self._y.max()), 0.0), 1.0)

    def apply_one(self, score: float) -> float:
        """:meth:`apply` of one score in Python floats, np.interp's rule, so a per-token decision makes no numpy call.
        """
        if self.method == "platt":
            return 1.0 / (1.0 + math.exp(-(self.a * score + self.b)))
        xs, ys = self.x, self.y
        if score != score:  # NaN: np.interp gives NaN, or the one breakpoint's value
            return min(max(float(ys[0]), 0.0), 1.0) if len(xs) == 1 else score
        if score >= xs[-1]:
            y = float(ys[-1])
        elif score < xs[0]:
            y = float(ys[0])
        else:
            j = bisect.bisect_right(xs, score) - 1
            slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
            y = slope * (score - xs[j]) + ys[j]
        return min(max(y, 0.0), 1.0)

    def __call__(self, scores: Tensor | np.ndarray) -> Tensor | np.ndarray:
        if isinstance(scores, Tensor):  # numpy does the conversions: no torch op per stop decision on the CPU
            out = torch.from_numpy(self.apply(scores.detach().cpu().numpy()).astype(np.float32))
            return out if scores.device.type == "cpu" else out.to(scores.device)
        return self.apply(scores)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"method": self.method, "n_fit": int(self.n_fit), "label": self.label}
        if self.method == "platt":
            d.update(a=float(self.a), b=float(self.b))
        else:
            d.update(x=[float(v) for v in self.x], y=[float(v) for v in self.y])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibrator:
        return cls(**{k: d[k] for k in ("method", "x", "y", "a", "b", "n_fit", "label") if k in d})


def fit_calibrator(scores: np.ndarray, labels: np.ndarray, method: str = "auto", label: str = "",
                   cv_folds: int = 5) -> Calibrator:
    """Fit a map from [N] scores (non-finite rows dropped) to [N] acceptance labels (0/1 or soft) with scikit-learn.
    ``method``: ``isotonic``, ``platt`` (soft labels as weighted positive and negative copies) or ``auto``: the lower
    Brier score over ``cv_folds`` contiguous folds (which keep most prompts whole), refitted on all rows."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    if s.shape != y.shape:
        raise ValueError(f"fit_calibrator: {s.size} scores but {y.size} labels")
    ok = np.isfinite(s) & np.isfinite(y)
    s, y = s[ok], np.clip(y[ok], 0.0, 1.0)
    if s.size < 2:
        raise ValueError(f"fit_calibrator needs at least 2 scored tokens, got {s.size}")
    if method == "auto":
        method = _cross_validated_method(s, y, cv_folds)
    if method == "isotonic":
        from sklearn.isotonic import IsotonicRegression  # heavy; fitting only, not the goodput rule

        iso = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(s, y)
        xs, ys = np.asarray(iso.X_thresholds_, dtype=np.float64), np.asarray(iso.y_thresholds_, dtype=np.float64)
        return Calibrator("isotonic", xs.tolist(), ys.tolist(), n_fit=int(s.size), label=label)
    if method == "platt":
        from sklearn.linear_model import LogisticRegression  # heavy; fitting only, not the goodput rule

        x2 = np.concatenate([s, s])[:, None]
        y2 = np.concatenate([np.ones_like(y), np.zeros_like(y)])
        w2 = np.concatenate([y, 1.0 - y])
        if w2[y2 == 1].sum() <= 0 or w2[y2 == 0].sum() <= 0:
            raise ValueError("fit_calibrator (platt): the labels hold one class only")
        lr = LogisticRegression(C=1e6, max_iter=1000).fit(x2, y2, sample_weight=w2)
        return Calibrator("platt", a=float(lr.coef_[0, 0]), b=float(lr.intercept_[0]), n_fit=int(s.size), label=label)
    raise ValueError(f"calibration method {method!r}: use one of {FIT_METHODS}")


def _cross_validated_method(s: np.ndarray, y: np.ndarray, folds: int) -> str:
    """'isotonic' or 'platt', whichever predicts held-out rows with the lower mean squared error (Brier score)."""
    n = s.size
    if n < 4 * folds:
        return "platt"  # too few rows to hold any out: the two-parameter map
    loss = {}
    edges = np.linspace(0, n, folds + 1).astype(int)
    for m in METHODS:
        err = 0.0
        for lo, hi in zip(edges[:-1], edges[1:]):
            train = np.ones(n, dtype=bool)
            train[lo:hi] = False
            try:
                cal = fit_calibrator(s[train], y[train], m)
            except ValueError:  # one class in the training rows
                err = float("inf")
                break
            err += float(((cal.apply(s[~train]) - y[~train]) ** 2).sum())
        loss[m] = err
    return min(METHODS, key=lambda m: loss[m])


def ece_noise_floor(probs: np.ndarray, n_bins: int = 15, draws: int = 200, seed: int = 0) -> float:
    """The ECE a perfectly calibrated predictor scores on ``probs`` by chance (labels drawn as Bernoulli(probs)); about
    0.03 on a few hundred tokens."""
    p = np.clip(np.asarray(probs, dtype=np.float64).reshape(-1), 0.0, 1.0)
    if p.size == 0:
        return float("nan")
    rng = np.random.default_rng(seed)
    return float(np.mean([expected_calibration_error(p, (rng.random(p.size) < p).astype(np.float64), n_bins)
                          for _ in range(draws)]))


def ece_interval(probs: np.ndarray, labels: np.ndarray, groups: np.ndarray, n_bins: int = 15, n_boot: int = 200,
                 seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the ECE over resamples of whole prompts (``groups``): tokens of a prompt move together, so
    it is wider than the noise floor says; (nan, nan) under two prompts."""
    p = np.clip(np.asarray(probs, dtype=np.float64).reshape(-1), 0.0, 1.0)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    codes = np.unique(np.asarray(groups).astype(str).reshape(-1), return_inverse=True)[1]
    n_groups = int(codes.max()) + 1 if codes.size else 0
    if n_groups < 2 or p.size != y.size or p.size != codes.size:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    # each resample as prompt multiplicities weighting the tokens, as the AUC intervals do (evaluation.classification)
    values = [expected_calibration_error(
        p, y, n_bins, np.bincount(rng.integers(0, n_groups, n_groups), minlength=n_groups).astype(np.float64)[codes])
        for _ in range(n_boot)]
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def reliability_bins(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15,
                     weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Equal-width bins of predicted acceptance: per bin the token count, mean prediction and mean label (``weights``:
    token multiplicities)."""
    p = np.clip(np.asarray(probs, dtype=np.float64).reshape(-1), 0.0, 1.0)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    idx = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    if weights is None:
        count = np.bincount(idx, minlength=n_bins).astype(np.float64)
        sp = np.bincount(idx, weights=p, minlength=n_bins)
        sy = np.bincount(idx, weights=y, minlength=n_bins)
    else:
        w = np.asarray(weights, dtype=np.float64).reshape(-1)
        count = np.bincount(idx, weights=w, minlength=n_bins)
        sp = np.bincount(idx, weights=p * w, minlength=n_bins)
        sy = np.bincount(idx, weights=y * w, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"count": count, "mean_pred": sp / count, "mean_label": sy / count,
                "edges": np.linspace(0.0, 1.0, n_bins + 1)}


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15,
                               weights: np.ndarray | None = None) -> float:
    """ECE: sum over equal-width bins of (tokens in bin / N) * |mean prediction - mean label| (soft labels allowed,
    ``weights`` as in :func:`reliability_bins`)."""
    b = reliability_bins(probs, labels, n_bins, weights)
    n = b["count"].sum()
    if n <= 0:
        return float("nan")
    ok = b["count"] > 0
    return float((b["count"][ok] / n * np.abs(b["mean_pred"][ok] - b["mean_label"][ok])).sum())


def calibration_label(columns: Mapping[str, object], mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(row mask, acceptance label) a ``mode`` map is fitted and scored on: greedy match on argmax draws or min(1, p/q)
    on sampled ones."""
    if mode not in MODES:
        raise ValueError(f"decoding mode {mode!r}: use one of {MODES}")
    n = len(np.asarray(columns["q"]))
    mask = np.ones(n, dtype=bool)
    if "draw" in columns:
        d = np.asarray(columns["draw"]).astype(str)
        want = d == ("greedy" if mode == "greedy" else "sample")
        if want.any():
            mask = want
    col = "greedy_match" if mode == "greedy" else "accept_prob"
    return mask, np.asarray(columns[col], dtype=np.float64)[mask]


def calibration_rows(name: str, cal: Calibrator, scores: np.ndarray, labels: np.ndarray, mode: str,
                     n_bins: int = 15, groups: np.ndarray | None = None) -> dict[str, Any]:
    """One row of the calibration table: ECE of the raw score and of the map, the chance floor ``ece_floor`` and, given
    prompt ``groups``, the 95% interval ``ece_lo`` / ``ece_hi``."""
    raw = np.asarray(scores, dtype=np.float64)
    raw_is_prob = bool(raw.size and np.nanmin(raw) >= 0 and np.nanmax(raw) <= 1)
    cal_probs = cal.apply(raw)
    return {"policy": name, "mode": mode, "label": cal.label, "method": cal.method, "n": int(raw.size),
            "n_fit": cal.n_fit, "mean_label": float(np.mean(labels)) if raw.size else float("nan"),
            "ece_raw": expected_calibration_error(raw, labels, n_bins) if raw_is_prob else float("nan"),
            "ece": expected_calibration_error(cal_probs, labels, n_bins),
            "ece_floor": ece_noise_floor(cal_probs, n_bins),
            **dict(zip(("ece_lo", "ece_hi"), ece_interval(cal_probs, labels, groups, n_bins) if groups is not None
                       else (float("nan"), float("nan"))))}
