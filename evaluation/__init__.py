"""Evaluation of stop policies on held-out labelled draft tokens: classification tables, the offline replay and its
threshold tuning, calibration, cross-validation, and the report with its plots.

Usage: python -m pipelines.evaluate --data_dir DIR --predictors '[REF, ...]' --out_dir DIR
"""
