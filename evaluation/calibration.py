"""Calibration of every predictor and training-free score: maps fitted on the validation split, their expected
calibration error and reliability curves on the test split, and the cost-aware (``goodput``) policies they make.

Each map calibrates the acceptance a decoding mode uses (``predictors.calibration``): greedy match on the argmax draws
for greedy decoding, min(1, p/q) on the sampled draws for speculative sampling.

Usage::

    from evaluation.calibration import calibrate_policies, calibrated_scores
    res = calibrate_policies({"disco": disco, **calibrated_scores()}, val_columns, test_columns)
    res.table          # policy, mode, label, method, n, ece_raw, ece
    res.maps["disco"]  # {"greedy": Calibrator, "sampling": Calibrator}
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from predictors.base import StopPolicy, as_tensor_dict
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

__all__ = ["CalibrationResult", "calibrated_scores", "fit_maps", "calibrate_policies", "goodput_policies"]


def calibrated_scores() -> dict[str, StopPolicy]:
    """The training-free scores that get a calibration map (and a ``goodput`` row): top-1 probability, q(x) and the
    entropy through SVIP's and AdaEDL's bounds; each can be exported (``predictors.baselines``)."""
    from predictors.baselines import SVIP, AdaEDL, DraftProb, MaxConfidence

    return {"max-prob": MaxConfidence(threshold=0.4), "draft-prob": DraftProb(threshold=0.4),
            "svip": SVIP(h=0.3, gamma=0.15), "adaedl-bound": AdaEDL(lam=0.6, gamma=0.2, online=False)}


def _scores(policy: StopPolicy, columns: Mapping[str, Any]) -> np.ndarray:
    from evaluation.replay import policy_scores

    return policy_scores(policy, as_tensor_dict(columns))


def _rows(columns: Mapping[str, Any], mask: np.ndarray) -> dict[str, Any]:
    return {k: np.asarray(v)[mask] for k, v in columns.items()}


def fit_maps(policy: StopPolicy, columns: Mapping[str, Any], modes: Sequence[str] = MODES,
             method: str = "auto") -> dict[str, Calibrator]:
    """Mode -> map of ``policy``'s raw score to that mode's acceptance, fitted on ``columns`` (the validation split).

    A mode whose rows are missing or hold too few tokens gets no map."""
    maps: dict[str, Calibrator] = {}
    for mode in modes:
        mask, y = calibration_label(columns, mode)
        if mask.sum() < 2:
            continue
        label = label_name("greedy" if mode == "greedy" else "soft")
        maps[mode] = fit_calibrator(_scores(policy, _rows(columns, mask)), y, method, label=label)
    return maps


@dataclass
class CalibrationResult:
    """Maps per policy, their error table on the test split, and reliability curves for the plots."""

    maps: dict[str, dict[str, Calibrator]] = field(default_factory=dict)
    """policy name -> mode -> map (fitted on the validation split)."""
    table: pd.DataFrame = field(default_factory=pd.DataFrame)
    """policy, mode, label, method, n, n_fit, mean_label, ece_raw (raw score, when a probability), ece, ece_floor
    (the ECE of perfect calibration by chance on these tokens)."""
    curves: dict[tuple[str, str], dict[str, np.ndarray]] = field(default_factory=dict)
    """(policy, mode) -> reliability bins of the calibrated acceptance on the test split."""
    notes: list[str] = field(default_factory=list)


def calibrate_policies(policies: Mapping[str, StopPolicy | None], fit_columns: Mapping[str, Any],
                       test_columns: Mapping[str, Any], method: str = "auto", n_bins: int = 15
                       ) -> CalibrationResult:
    """Fit each policy's maps on ``fit_columns`` (validation) and score them on ``test_columns``.

    Policies that miss columns or do not score (oracles, static lengths) are skipped with a note."""
    from evaluation.replay import missing_columns

    res = CalibrationResult()
    rows = []
    for name, pol in policies.items():
        if pol is None or not pol.has_threshold or pol.needs_target:
            continue
        miss = missing_columns(pol, fit_columns) or missing_columns(pol, test_columns)
        if miss:
            res.notes.append(f"calibration of {name} skipped: missing columns {miss}")
            continue
        maps = fit_maps(pol, fit_columns, MODES, method)
        if not maps:
            res.notes.append(f"calibration of {name} skipped: no validation rows")
            continue
        res.maps[name] = maps
        for mode, cal in maps.items():
            mask, y = calibration_label(test_columns, mode)
            if not mask.any():
                continue
            raw = _scores(pol, _rows(test_columns, mask))
            rows.append(calibration_rows(name, cal, raw, y, mode, n_bins))
            res.curves[(name, mode)] = reliability_bins(cal.apply(raw), y, n_bins)
    res.table = pd.DataFrame(rows)
    return res


def goodput_policies(policies: Mapping[str, StopPolicy | None], maps: Mapping[str, Mapping[str, Calibrator]]
                     ) -> dict[str, StopPolicy]:
    """``<name> (goodput)``: every calibrated policy under the cost-aware rule (SV's own table included, since it is a
    goodput policy already it is listed as is)."""
    out: dict[str, StopPolicy] = {}
    for name, m in maps.items():
        pol = policies.get(name)
        if pol is not None and m:
            out[f"{name} (goodput)"] = GoodputPolicy(pol, m, name)
    return out
