"""Evaluation of stop policies on held-out labelled draft tokens.

- ``evaluation.classification``: ROC / PR / F1 per label family with bootstrap CIs over prompts, per-origin and
per-domain
  breakdowns, DISCO's static-length F1, SPRINTER's Theorems 1-2 against the data (``score_table``, ``sprinter_table``).
- ``evaluation.replay``: offline replay of policies over stored sequences without models; predicted speedup under a
  ``CostModel``; latency-optimal threshold tuning (``replay_table``, ``tune_threshold``).
- ``evaluation.cost_model``: re-exports ``data_gen.timing`` (``CostModel``, ``measure_cost_model``), the one timing
  model.
- ``evaluation.report`` / ``evaluation.plots``: report.md, PNG plots, CSVs, MLflow artifacts (``write_report``).

Entry point: ``python -m pipelines.evaluate --data_dir DIR --predictors '[REF, ...]' --out_dir DIR``.
"""
