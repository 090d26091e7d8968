"""Data generation: models, prompts, prefixes, rollouts, one-pass labelling and Parquet shards; generation as the jobs
run it (``generate.generate``, the main job's ``generate.ensure_data``) and the progress view every long job shows
(``progress``).

Usage: python -m pipelines.generate --config configs/smoke.yaml
"""
