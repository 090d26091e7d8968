"""Cross-validated comparison of learned predictors with the training-free scores (``evaluation.crossval``).

Every prompt is tested once (grouped k-fold over prompts, stratified by domain); the table gives each predictor's AUC
on its own label and draw beside the best training-free score's, overall and per domain, with a paired bootstrap
interval of the difference over prompts, the chance the learned one wins and the folds it wins. It also calibrates
out of fold: each fold's learned and training-free scores mapped to acceptance on the fold's validation prompts and
scored on its test prompts, so the expected calibration error is measured on every prompt once (``calibration.csv``;
a single test split of a few hundred tokens cannot resolve an ECE of 0.03: its noise floor is about that).

Usage:
    python -m pipelines.crossval --config configs/crossval.yaml
    python -m pipelines.crossval --config configs/crossval.yaml --folds 10 --n_boot 500
    python -m pipelines.crossval --config configs/crossval.yaml --train_fractions '[0.25,0.5,1.0]'   # learning curve

The work is ``evaluation.crossval`` (the main job runs it with ``crossval_folds`` > 0). Writes ``crossval.md``,
``crossval.csv``, ``calibration.csv``, the out-of-fold scores (``oof.parquet``), ``crossval.png`` (the differences
with their intervals) and, with several ``train_fractions``, ``learning_curve.png`` to ``out_dir``, and logs them to
the active MLflow run (or a new ``crossval`` run with ``tracking``).
"""
from __future__ import annotations

import sys
from typing import Any

from evaluation.crossval import CrossValConfig, run_crossval
from pipelines.cli import parse_config, setup_logging, user_errors


def main(argv: list[str] | None = None) -> dict[str, Any]:
    setup_logging()
    with user_errors("python -m pipelines.crossval"):
        cfg = parse_config(CrossValConfig, argv, __doc__)
        result = run_crossval(cfg)
    print(result["markdown"])
    print(f"\nfiles: {', '.join(result['files'])}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
