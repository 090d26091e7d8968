"""Fit the calibration maps of an existing predictor export (or a training-free score) so ``goodput:`` can use it.

The maps are fitted on the validation split of the data (of a folder of serving traces: its train and val requests,
unless the predictor learned from them; greedy match on the argmax draws for greedy decoding, min(1,
p/q) on the sampled draws for sampling; ``predictors.calibration``), their expected calibration error is printed for the
test split, and they are written into ``predictor.json`` (``calibration``). A local export folder is updated in place
unless ``--out_dir`` is given; a ``models:/`` reference or a score name (``max_confidence``, ``draft_prob``, ``svip``,
``adaedl``) is written to ``--out_dir``.

Usage:
    python -m pipelines.calibrate --data_dir outputs/default/data --predictor outputs/default/train/disco/export
    python -m pipelines.calibrate --data_dir outputs/default/data --predictor svip --out_dir calibrated/svip
    python -m pipelines.calibrate --data_dir outputs/traces --predictor EXPORT --out_dir EXPORT-vllm   # vLLM traces
    # then: build_policy("goodput:calibrated/svip") / benchmark policy goodput:calibrated/svip
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from decoding.policies import build_policy
from evaluation.calibration import calibrate_policies
from evaluation.data import draft_fingerprint, load_columns, subset
from evaluation.report import markdown_table
from pipelines.cli import parse_config, setup_logging, user_errors
from predictors.export import METADATA_FILE, export_predictor, load_predictor, update_metadata
from predictors.tracking import TrackingURI
from runtimes.vllm.traces import first_acceptance_field, fit_splits, is_trace_folder


@dataclass
class CalibrateConfig(TrackingURI):
    """Arguments of ``python -m pipelines.calibrate``."""

    data_dir: str
    """Shard folder the predictor's data came from (its val split fits the maps)."""
    predictor: str
    """Export folder, ``models:/name@alias``, or a training-free score name (max_confidence, draft_prob, svip,
    adaedl)."""
    extra_data_dirs: list[str] = field(default_factory=list)
    """More shard folders read with data_dir as one data set."""
    out_dir: str | None = None
    """Where to write the calibrated export (default: the export folder itself; required for names and models:/)."""
    method: str = "auto"
    """auto (isotonic or Platt by cross-validated Brier score), isotonic or platt."""
    fit_split: str = "auto"
    """Split the maps are fitted on; auto: ``val``, or for a folder of serving traces ``train`` and ``val`` (only
    ``val`` where the predictor learned from that folder)."""
    test_split: str = "test"
    """Split the expected calibration error is reported on."""
    force: bool = False
    """Load a predictor trained for another draft model anyway."""

    def __post_init__(self) -> None:
        if self.method not in ("isotonic", "platt", "auto"):
            raise ValueError(f"--method {self.method!r}: use auto, isotonic or platt")


def calibrate_export(cfg: CalibrateConfig) -> dict[str, Any]:
    """Fit, report and store the maps; returns {"folder", "table" (ECE rows), "maps"}."""
    ref = cfg.predictor
    for folder in [cfg.data_dir, *cfg.extra_data_dirs]:
        if not list(Path(folder).glob("shard-*.parquet")):
            raise ValueError(f"--data_dir {folder}: no labelled draft tokens (no shard-*.parquet) to fit on")
    local = Path(ref).expanduser().is_dir() and (Path(ref) / METADATA_FILE).is_file()
    if not local and cfg.out_dir is None:
        raise ValueError(f"--predictor {ref} is not a local export folder: give --out_dir for the calibrated export")
    pol = build_policy(ref, max_draft_len=40, force=cfg.force, tracking_uri=cfg.tracking_uri)
    fp = draft_fingerprint(cfg.data_dir)
    if fp is not None and local:
        load_predictor(ref, draft_fingerprint=fp, force=cfg.force)  # refuses a predictor made for another draft
    extra = tuple(c for c in pol.required_columns if c == "draft_hidden")
    fit = [cfg.fit_split] if cfg.fit_split != "auto" else (
        fit_splits(ref if local else None, cfg.data_dir) if is_trace_folder(cfg.data_dir) else ["val"])
    cols = load_columns([cfg.data_dir, *cfg.extra_data_dirs], [*fit, cfg.test_split], extra)
    split = np.asarray(cols["split"]).astype(str)
    res = calibrate_policies({ref: pol}, subset(cols, np.isin(split, fit)), subset(cols, split == cfg.test_split),
                             cfg.method)
    if ref not in res.maps:
        raise ValueError(f"no map fitted for {ref}: {'; '.join(res.notes) or 'no scored rows'}")
    stored = {m: c.to_dict() for m, c in res.maps[ref].items()}
    if local:
        folder = Path(ref)
        if cfg.out_dir is not None:
            folder = Path(cfg.out_dir)
            shutil.copytree(ref, folder, dirs_exist_ok=True)
    elif ref.startswith(("models:/", "runs:/")):
        from predictors.registry import download_model  # imports mlflow: only for registry references

        folder = Path(cfg.out_dir)
        shutil.copytree(download_model(ref, tracking_uri=cfg.tracking_uri), folder, dirs_exist_ok=True)
    else:
        folder = export_predictor(pol, cfg.out_dir, {})
    traced = subset(cols, np.isin(split, fit)) if is_trace_folder(cfg.data_dir) else None
    update_metadata(folder, calibration=stored, **first_acceptance_field(folder, traced))
    return {"folder": folder, "table": res.table, "maps": res.maps[ref]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    setup_logging()
    with user_errors("python -m pipelines.calibrate"):
        cfg = parse_config(CalibrateConfig, argv, __doc__)
        out = calibrate_export(cfg)
    cols = ["policy", "mode", "label", "method", "n", "n_fit", "ece_raw", "ece", "ece_floor", "ece_lo", "ece_hi"]
    print(markdown_table(out["table"], cols, digits=4))
    print(f"calibrated export: {out['folder']} (use it as goodput:{out['folder']})")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
