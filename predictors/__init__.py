"""Stop policies behind one interface: DISCO FFN, SPRINTER verifier, SV bin table and the training-free baselines;
their training, export and MLflow registry, and the MLflow fields and runs every job logs with (``tracking``).

Usage: python -m pipelines.train --config configs/smoke.yaml
"""
