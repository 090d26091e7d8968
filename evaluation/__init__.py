"""Evaluation of stop policies on held-out labelled draft tokens.

- ``evaluation.classification``: ROC / PR / F1 per label family with bootstrap CIs over prompts, per-origin and
  per-domain breakdowns, DISCO's static-length F1, SPRINTER's Theorems 1-2 against the data (``score_table``,
  ``sprinter_table``).
- ``evaluation.replay``: offline replay of policies over stored sequences without models; predicted speedup under a
  ``CostModel``; latency-optimal threshold tuning (``replay_table``, ``tune_threshold``).
- ``evaluation.calibration``: calibration maps of every policy's acceptance per decoding mode, ECE, reliability.
- The timing model (``CostModel``) is ``compute.timing``.
- ``evaluation.report`` / ``evaluation.plots``: report.md, PNG plots, CSVs, MLflow artifacts (``write_report``).
- ``evaluation.evaluate``: the evaluation job (``EvaluateConfig``, ``run_evaluation``), which ``python -m
  pipelines.evaluate`` and the main job run; ``evaluation.crossval``: cross-validation over folds of prompts and its job
  (``CrossValConfig``, ``run_crossval``).

Entry points: ``python -m pipelines.evaluate --data_dir DIR --predictors '[REF, ...]' --out_dir DIR``, ``python -m
pipelines.crossval --config configs/crossval.yaml``.
"""
