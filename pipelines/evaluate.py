"""Evaluate stop policies on held-out labelled draft tokens: classification tables, offline replay, report.

The evaluation itself is ``evaluation.evaluate`` (the main job runs it too); this entry point parses its config
and runs it inside an MLflow run.

Usage:
    python -m pipelines.evaluate --data_dir data/smoke --out_dir runs/eval
    python -m pipelines.evaluate --data_dir data/default --predictors '[runs/disco/export,
    "models:/specstop-sv@champion"]' \\
        --out_dir runs/eval --tune_thresholds true
    python -m pipelines.evaluate --config configs/evaluate.yaml
"""
from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

from evaluation.evaluate import EvaluateConfig, run_evaluation
from pipelines.cli import parse_config, setup_logging, user_errors
from predictors.tracking import mlflow_api, mlflow_run


def run_tracked(cfg: EvaluateConfig) -> dict[str, Any]:
    """:func:`run_evaluation`, inside an MLflow run when ``cfg.tracking`` (and none is active)."""
    if not cfg.tracking:
        return run_evaluation(cfg)
    if mlflow_api().active_run() is not None:
        return run_evaluation(cfg)
    with mlflow_run(cfg.tracking_uri, cfg.experiment, "evaluate") as mlflow:
        mlflow.log_params({k: str(v)[:250] for k, v in asdict(cfg).items()})
        return run_evaluation(cfg)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    setup_logging()
    with user_errors("python -m pipelines.evaluate"):
        cfg = parse_config(EvaluateConfig, argv, __doc__)
        result = run_tracked(cfg)
    print(f"report: {result['report']}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
