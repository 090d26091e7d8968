"""A finished benchmark in MLflow: one run with its parameters, each row's metrics (``<row>/<metric>``), the replay
check's metrics (:func:`check_metrics`, also logged by ``python -m pipelines.replay_check``) and the folder's
files; the check run alone in the benchmark's experiment (:func:`log_check`)."""
from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmark.check_inputs import BenchFolder
from benchmark.check_report import PLOT
from benchmark.config import BenchmarkConfig
from predictors.tracking import mlflow_run


def metric_key(row: str) -> str:
    """A row name as an MLflow metric prefix."""
    return re.sub(r"[^A-Za-z0-9_.\-/ ]", "_", row)


ROW_METRICS = ("tokens_per_s", "speedup", "speedup_lo", "speedup_hi", "vs_best_entropy", "vs_best_thresholded",
               "vs_best_thresholded_lo", "vs_best_thresholded_hi", "mean_accepted", "mean_drafted",
               "target_calls_per_token", "wasted_per_token", "stop_overhead", "rouge_l")


def log_to_mlflow(cfg: BenchmarkConfig, rows: list[dict[str, Any]], out_dir: Path,
                  check: dict[str, Any] | None = None) -> None:
    """Parameters, per-row metrics (and the replay check's) and the artefacts of a finished benchmark in one MLflow
    run."""
    with mlflow_run(cfg.tracking_uri, cfg.experiment, "benchmark") as mlflow:
        mlflow.log_params({k: str(v)[:250] for k, v in asdict(cfg).items()})
        for r in rows:
            for m in ROW_METRICS:
                if isinstance(r.get(m), (int, float)) and not isinstance(r.get(m), bool):
                    mlflow.log_metric(f"{metric_key(r['row'])}/{m}", float(r[m]))
        if check is not None:
            mlflow.log_metrics(check_metrics(check))
        mlflow.log_artifacts(str(out_dir))


def check_metrics(result: dict[str, Any]) -> dict[str, float]:
    """MLflow metrics of the check: per row the ratio and the predicted tokens/s, and the worst error."""
    out: dict[str, float] = {}
    for r in result["rows"]:
        if r["ratio"] is not None:
            out[f"{metric_key(r['row'])}/replay_ratio"] = float(r["ratio"])
            out[f"{metric_key(r['row'])}/replay_predicted_tokens_per_s"] = float(r["predicted_tokens_per_s"])
        if r.get("curve_vs_best_entropy") is not None:
            out[f"{metric_key(r['row'])}/curve_vs_best_entropy"] = float(r["curve_vs_best_entropy"])
    if result["summary"]["worst_error"] is not None:
        out["replay_check/worst_error"] = float(result["summary"]["worst_error"])
    return out


def log_check(result: dict[str, Any], folder: BenchFolder, bench_cfg: BenchmarkConfig,
              tracking_uri: str | None) -> None:
    """One MLflow run in the benchmark's experiment (its config's, as its tracking URI unless ``tracking_uri`` is
    given): the check's metrics, benchmark.json / .md and the plot."""
    with mlflow_run(tracking_uri or bench_cfg.tracking_uri, bench_cfg.experiment, "replay-check") as mlflow:
        mlflow.log_params({"bench_dir": str(folder.path), "mode": result["mode"], "rollout_len": result["rollout_len"]})
        mlflow.log_metrics(check_metrics(result))
        for name in ("benchmark.json", "benchmark.md", PLOT):
            mlflow.log_artifact(str(folder.path / name))
