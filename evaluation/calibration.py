"""Calibration of every predictor and training-free score: maps fitted outside the test split, their ECE and reliability
on the test split, and the cost-aware (``goodput``) policies they make.

A map turns a score into the acceptance a decoding mode uses: greedy match on argmax draws for greedy decoding, min(1,
p/q) on sampled draws for speculative sampling. A learned predictor's maps are fitted on its out-of-fold scores
(:func:`cross_fitted_scores`), since it scores its own training rows too well.

Usage::

    res = calibrate_policies({"disco": disco, **calibrated_scores()}, val_columns, test_columns)
    res.maps["disco"]  # {"greedy": Calibrator, "sampling": Calibrator}
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from evaluation.replay.scores import missing_columns, policy_scores
from predictors.base import StopPolicy, as_tensor_dict
from predictors.baselines import SVIP, AdaEDL, DraftProb, MaxConfidence
from predictors.calibration import (
    MODES,
    Calibrator,
    calibration_label,
    calibration_rows,
    fit_calibrator,
    reliability_bins,
)
from predictors.goodput import GoodputPolicy
from predictors.labels import label_name
from predictors.training import fit_predictor, make_datamodule

log = logging.getLogger(__name__)

__all__ = ["CalibrationResult", "calibrated_scores", "fit_maps", "cross_fitted_scores", "calibrate_policies",
           "goodput_policies"]


def calibrated_scores() -> dict[str, StopPolicy]:
    """The training-free scores that get a calibration map and a ``goodput`` row: top-1 probability, q(x), SVIP's and
    AdaEDL's bounds."""
    return {"max-prob": MaxConfidence(threshold=0.4), "draft-prob": DraftProb(threshold=0.4),
            "svip": SVIP(h=0.3, gamma=0.15), "adaedl-bound": AdaEDL(lam=0.6, gamma=0.2, online=False)}


def _scores(policy: StopPolicy, columns: Mapping[str, Any]) -> np.ndarray:
    return policy_scores(policy, as_tensor_dict(columns))


def _rows(columns: Mapping[str, Any], mask: np.ndarray) -> dict[str, Any]:
    return {k: np.asarray(v)[mask] for k, v in columns.items()}


def fit_maps(policy: StopPolicy, columns: Mapping[str, Any], modes: Sequence[str] = MODES,
             method: str = "auto", scores: np.ndarray | None = None) -> dict[str, Calibrator]:
    """Mode -> map of ``policy``'s score (or the given ``scores``) to that mode's acceptance, fitted on ``columns``; a
    mode with too few tokens gets none."""
    maps: dict[str, Calibrator] = {}
    for mode in modes:
        if ("greedy_match" if mode == "greedy" else "accept_prob") not in columns:
            continue  # data without that label (serving traces of greedy decoding carry greedy_match only)
        mask, y = calibration_label(columns, mode)
        if mask.sum() < 2:
            continue
        label = label_name("greedy" if mode == "greedy" else "soft")
        s = _scores(policy, _rows(columns, mask)) if scores is None else np.asarray(scores, dtype=np.float64)[mask]
        maps[mode] = fit_calibrator(s, y, method, label=label)
    return maps


def cross_fitted_scores(kind: str, cfg: Any, data_dir: Any, out_dir: str | Path, columns: Mapping[str, Any],
                        folds: int = 5, within: Sequence[str] = ("train", "val")) -> np.ndarray:
    """[rows of ``columns``] each row's score by a copy of the predictor that never saw its prompt (NaN outside the
    folds).

    The ``within`` splits' prompts are dealt to ``folds`` grouped folds; fold i is scored by a predictor trained on the
    others, as ``CalibratedClassifierCV(ensemble=False)`` does, so a map sees all training tokens and never the test
    split. Cached in ``<out_dir>/<kind>/out-of-fold.npz`` under a digest of kind, config, folds and columns.
    """
    ids = np.asarray(columns["sample_id"]).astype(str)
    cache = Path(out_dir) / kind / "out-of-fold.npz"
    key = _digest(kind, cfg, folds, within, columns)
    if cache.is_file():
        with np.load(cache) as z:
            if str(z["key"]) == key and len(z["scores"]) == len(ids):
                return z["scores"]
    out = np.full(len(ids), np.nan)
    t0 = time.perf_counter()
    for i in range(folds):
        dm = make_datamodule(kind, cfg, data_dir, folds=(folds, i), fold_within=tuple(within),
                             extra_columns=("sample_id",))
        policy, _ = fit_predictor(kind, cfg, data_dir, Path(out_dir) / kind / f"fold-{i}", datamodule=dm)
        dm.setup("test")
        rows = np.isin(ids, np.unique(dm.raw["test"]["sample_id"].astype(str)))
        if rows.any():
            out[rows] = _scores(policy, _rows(columns, rows))
        log.info("cross-fitted calibration of %s: fold %d/%d, %d rows, %.0fs", kind, i + 1, folds, int(rows.sum()),
                 time.perf_counter() - t0)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache.with_suffix(".tmp.npz"), key=key, scores=out)
    cache.with_suffix(".tmp.npz").replace(cache)
    return out


def _digest(kind: str, cfg: Any, folds: int, within: Sequence[str], columns: Mapping[str, Any]) -> str:
    """sha256 of what out-of-fold scores depend on: the predictor kind and config, the folds and the rows' columns."""
    h = hashlib.sha256(json.dumps([kind, dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg),
                                   folds, list(within)], sort_keys=True, default=str).encode())
    for name in sorted(columns):
        v = np.asarray(columns[name])
        h.update(name.encode())
        h.update(v.astype(str).tobytes() if v.dtype == object or v.dtype.kind in "US" else
                 np.ascontiguousarray(v).tobytes())
    return h.hexdigest()


@dataclass
class CalibrationResult:
    """Maps per policy, their error table on the test split, and reliability curves for the plots."""

    maps: dict[str, dict[str, Calibrator]] = field(default_factory=dict)
    """policy name -> mode -> map (fitted outside the test split)."""
    table: pd.DataFrame = field(default_factory=pd.DataFrame)
    """policy, mode, label, method, n, n_fit, mean_label, ece_raw, ece, ece_floor (perfect calibration's ECE by chance),
    ece_lo / ece_hi (95% over test prompts)."""
    curves: dict[tuple[str, str], dict[str, np.ndarray]] = field(default_factory=dict)
    """(policy, mode) -> reliability bins of the calibrated acceptance on the test split."""
    notes: list[str] = field(default_factory=list)


def calibrate_policies(policies: Mapping[str, StopPolicy | None], fit_columns: Mapping[str, Any],
                       test_columns: Mapping[str, Any], method: str = "auto", n_bins: int = 15,
                       fit_scores: Mapping[str, np.ndarray] | None = None) -> CalibrationResult:
    """Fit each policy's maps on ``fit_columns`` (or on ``fit_scores``, NaN rows left out) and score them on
    ``test_columns``; policies that miss columns or do not score are skipped with a note."""
    res = CalibrationResult()
    rows = []
    for name, pol in policies.items():
        if pol is None or not pol.has_threshold or pol.needs_target:
            continue
        miss = missing_columns(pol, fit_columns) or missing_columns(pol, test_columns)
        if miss:
            res.notes.append(f"calibration of {name} skipped: missing columns {miss}")
            continue
        maps = fit_maps(pol, fit_columns, MODES, method, scores=(fit_scores or {}).get(name))
        if not maps:
            res.notes.append(f"calibration of {name} skipped: no validation rows")
            continue
        res.maps[name] = maps
        for mode, cal in maps.items():
            mask, y = calibration_label(test_columns, mode)
            if not mask.any():
                continue
            raw = _scores(pol, _rows(test_columns, mask))
            groups = np.asarray(test_columns["sample_id"])[mask] if "sample_id" in test_columns else None
            rows.append(calibration_rows(name, cal, raw, y, mode, n_bins, groups=groups))
            res.curves[(name, mode)] = reliability_bins(cal.apply(raw), y, n_bins)
    res.table = pd.DataFrame(rows)
    return res


def goodput_policies(policies: Mapping[str, StopPolicy | None], maps: Mapping[str, Mapping[str, Calibrator]]
                     ) -> dict[str, StopPolicy]:
    """``<name> (goodput)``: every calibrated policy under the cost-aware rule (SV, goodput already, as is)."""
    out: dict[str, StopPolicy] = {}
    for name, m in maps.items():
        pol = policies.get(name)
        if pol is not None and m:
            out[f"{name} (goodput)"] = GoodputPolicy(pol, m, name)
    return out
