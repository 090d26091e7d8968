"""Data generation: prompts, prefixes, rollouts, one-pass labelling and Parquet shards, and the progress view every long
job shows.

Usage: python -m pipelines.generate --config configs/smoke.yaml
"""
