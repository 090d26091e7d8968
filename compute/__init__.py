"""Models and the CPU compute path: model sources, prepacked linears, native kernels and the timing model.

The lowest layer: data generation, the predictors, the replay and the decoding engine all load models and run
kernels through it. Nothing here imports another specstop package.

Usage: python -m pipelines.measure_costs --out outputs/cost_model.json
"""
