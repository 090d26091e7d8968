"""Cross-validated comparison of learned predictors with the training-free scores, as a library: the config and
:func:`run_crossval` (``python -m pipelines.crossval`` and the main job's ``crossval_folds`` run it; the entry point's
docstring says what it measures and writes)."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from evaluation.crossval import calibration_markdown, calibration_summary, crossvalidate, summarise, to_markdown
from evaluation.plots import plot_crossval, plot_learning_curve
from predictors.tracking import TrackingConfig, mlflow_api, mlflow_run
from predictors.training import DiscoConfig, SprinterConfig, TrainConfig

log = logging.getLogger("pipelines.crossval")

__all__ = ["CrossValRun", "CrossValConfig", "run_crossval"]


@dataclass
class CrossValRun:
    """One predictor of the comparison: a name, its kind and that kind's training config."""

    name: str
    """Row name in the table (e.g. disco, disco-ratio1.2)."""
    kind: str = "disco"
    """disco or sprinter."""
    disco: DiscoConfig = field(default_factory=DiscoConfig)
    """Training config when kind is disco (its label_family / lam give the label it is compared on)."""
    sprinter: SprinterConfig = field(default_factory=SprinterConfig)
    """Training config when kind is sprinter."""

    def __post_init__(self) -> None:
        if self.kind not in ("disco", "sprinter"):
            raise ValueError(f"run {self.name!r}: kind={self.kind!r}; cross-validation trains disco or sprinter")

    @property
    def config(self) -> TrainConfig:
        return self.disco if self.kind == "disco" else self.sprinter


@dataclass
class CrossValConfig(TrackingConfig):
    """Arguments of ``python -m pipelines.crossval`` (configs/crossval.yaml mirrors them)."""

    data_dir: str = "outputs/default/data"
    """Folder of the Parquet shards."""
    extra_data_dirs: list[str] = field(default_factory=list)
    """More shard folders read with data_dir as one data set (e.g. the code-domain run)."""
    out_dir: str = "outputs/default/crossval"
    """Tables, plot, out-of-fold scores, per-fold checkpoints and logs."""
    runs: list[CrossValRun] = field(default_factory=lambda: [CrossValRun("disco")])
    """The predictors compared."""
    folds: int = 5
    """Folds of prompts (>= 3: one tested, one for early stopping, the rest for training)."""
    train_fractions: list[float] = field(default_factory=lambda: [1.0])
    """Shares of each fold's training prompts to train on, e.g. [0.25, 0.5, 1.0]: a learning curve on the same test
    and val folds (does more data close the gap?)."""
    n_boot: int = 200
    """Bootstrap resamples of prompts for the intervals."""
    seed: int = 0
    """Bootstrap seed (the fold assignment uses each run's training seed)."""
    tracking: bool = field(default=False, kw_only=True)
    """Log to MLflow in a new ``crossval`` run when none is active (the field: ``predictors.tracking``)."""

    def __post_init__(self) -> None:
        if self.folds < 3:
            raise ValueError(f"folds={self.folds}: use at least 3 (one tested, one for early stopping, the rest train)")
        bad = [f for f in self.train_fractions if not 0 < f <= 1]
        if bad or not self.train_fractions:
            raise ValueError(f"train_fractions={self.train_fractions}: give shares in (0, 1]")
        names = [r.name for r in self.runs]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"runs need distinct names, got {names}")


def run_crossval(cfg: CrossValConfig) -> dict[str, Any]:
    """Train every run on every fold, summarise, write and log the results; returns {"table", "markdown", "files"}."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = [cfg.data_dir, *cfg.extra_data_dirs] if cfg.extra_data_dirs else cfg.data_dir
    runs = {r.name: (r.kind, r.config) for r in cfg.runs}
    oof = pd.concat([crossvalidate(runs, data, out, cfg.folds, f) for f in sorted(set(cfg.train_fractions))],
                    ignore_index=True)
    table = summarise(oof, cfg.n_boot, cfg.seed)
    markdown = to_markdown(table)
    calibration = calibration_summary(oof[oof["train_fraction"] == max(cfg.train_fractions)])
    files = [out / "oof.parquet", out / "crossval.csv", out / "crossval.md", out / "crossval_config.json",
             out / "calibration.csv"]
    oof.to_parquet(files[0])
    table.to_csv(files[1], index=False)
    calibration.to_csv(files[4], index=False)
    files[2].write_text(f"# Cross-validated AUC: learned against training-free ({cfg.folds} folds of prompts)\n\n"
                        f"{markdown}\n\n## Calibrated acceptance, out of fold\n\nEach fold's score (learned, and each "
                        f"training-free score) mapped to its decoding mode's acceptance by a map fitted on the fold's "
                        f"validation prompts, scored on its test prompts; pooled over the folds, every prompt once. "
                        f"ECE floor: what a perfectly calibrated map scores by chance on as many tokens.\n\n"
                        f"{calibration_markdown(calibration)}\n")
    if len(calibration):
        worst = calibration.loc[calibration["ece"].idxmax()]
        log.info("out-of-fold calibration: ECE %.4f to %.4f over %d tokens a mode (worst %s, %s; floor %.4f)",
                 calibration["ece"].min(), worst["ece"], int(calibration["n"].min()), worst["score"], worst["mode"],
                 worst["ece_floor"])
    files[3].write_text(json.dumps(asdict(cfg), indent=2, default=str))
    files.append(plot_crossval(table, out / "crossval.png"))
    if len(set(cfg.train_fractions)) > 1:
        files.append(plot_learning_curve(table, out / "learning_curve.png"))
    _log_mlflow(cfg, table, files)
    return {"table": table, "markdown": markdown, "files": [str(f) for f in files]}


def _log_mlflow(cfg: CrossValConfig, table: Any, files: list[Path]) -> None:
    """The table's metrics and the files, into the active MLflow run, else a new ``crossval`` run with ``tracking``."""
    mlflow = mlflow_api()

    def log_all() -> None:
        for r in table.to_dict("records"):
            for key in ("auc", "auc_best_free", "diff", "diff_lo", "diff_hi", "p_win"):
                v = r.get(key)
                if isinstance(v, float) and math.isfinite(v):
                    share = "" if r["train_fraction"] == 1 else f"_train{r['train_fraction']:g}"
                    mlflow.log_metric(f"cv_{r['predictor']}{share}_{r['group']}_{key}", v)
        for f in files:
            mlflow.log_artifact(str(f), artifact_path="crossval")

    if mlflow.active_run() is not None:
        log_all()
    elif cfg.tracking:
        with mlflow_run(cfg.tracking_uri, cfg.experiment, "crossval"):
            mlflow.log_params({"folds": cfg.folds, "n_boot": cfg.n_boot, "runs": ",".join(r.name for r in cfg.runs),
                               "train_fractions": ",".join(map(str, cfg.train_fractions))})
            log_all()
