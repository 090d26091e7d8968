"""Stop policies behind one interface: DISCO FFN, SPRINTER verifier, SV bin table and the training-free baselines.

Usage: python -m pipelines.train --config configs/smoke.yaml
"""
