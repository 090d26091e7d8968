"""Data generation: models, prompts, prefixes, rollouts, one-pass labelling and Parquet shards.

Usage: python -m pipelines.generate --config configs/smoke.yaml
"""
